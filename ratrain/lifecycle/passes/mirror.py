"""Peer copies of a sharded optimizer state, a pass over the step (elastic mode).

With the optimizer state sharded over the dp replicas (`schedule.shard_optimizer`), replica q
alone holds segment q of each block's fp32 master and AdamW moments: lose its rank and that
segment is gone. Under `elastic.copies` each replica keeps a copy of the previous replica's
segment (replica q keeps (q - 1) mod dp's), kept current every step the way the segment's
owner keeps its own: with the same update from the same gradient. So the copy never lags,
whenever a rank is lost:

- `CopyGrad(blocks)`, right after the blocks' reduce-scatter is waited for (`WaitGrad`): each
  replica sends its reduced gradient segment of each block to its keeper and receives its
  kept peer's into the copy's gradient, in the communication engine;
- `WaitCopy`, just before the step's global facts (`GradNorm`): every copy's gradient is in.
  A step's facts thus exist on some rank only once every copy has its gradient, so the
  recovery's rule (the last step whose facts a survivor holds is the one that holds,
  `elastic.recover`) holds for the copies too;
- `CopyUpdate(block)`, right after the block's `Update`: AdamW on the copy, with the step's
  facts (the same kernel and inputs as the owner's: the same bits).

The bytes: a copy of 12 bytes per parameter of a segment and its 4-byte gradient, resident
(the memory model counts them); the link carries 4 bytes per parameter of a segment per step.
The runner is `runtime.passes.mirror`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ratrain.exec.params import GRAD_BYTES_PER_PARAM, STATE_BYTES_PER_PARAM, shard_size
from ratrain.lifecycle.passes.base import Handlers, Pass
from ratrain.lifecycle.policies import policy_of
from ratrain.lifecycle.schedule import Action, GradNorm, Update, WaitGrad
from ratrain.lifecycle.validate import Extension

NAME = "mirror"
COPY_BYTES_PER_PARAM = STATE_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM  # per parameter of a segment


@dataclass(frozen=True)
class CopyGrad(Action):
    """Send these blocks' reduced gradient segments to their keeper, receive the kept peer's
    into the copy (in the engine)."""

    blocks: tuple[str, ...]
    group: ClassVar[str] = "lifecycle"
    word: ClassVar[str] = "copy-grad"


@dataclass(frozen=True)
class WaitCopy(Action):
    """Wait for every copy gradient of the step, before its global facts."""

    group: ClassVar[str] = "lifecycle"
    word: ClassVar[str] = "wait-copy"


@dataclass(frozen=True)
class CopyUpdate(Action):
    """AdamW of the copy of the kept peer's segment of `block`, with the step's facts."""

    block: str
    group: ClassVar[str] = "lifecycle"
    word: ClassVar[str] = "copy-update"


@dataclass(frozen=True)
class MirrorPass(Pass):
    """Each replica keeps a copy of the previous replica's segment (see the module)."""

    name: ClassVar[str] = NAME
    actions: ClassVar[tuple[type[Action], ...]] = (CopyGrad, WaitCopy, CopyUpdate)
    legend: ClassVar[str] = ("copy-grad L / wait-copy / copy-update L   the kept peer's "
                             "gradient segment in, and its copy updated (elastic)")

    def check(self, policy, stages, passes) -> None:
        if not stages[0].sharded:
            raise ValueError("elastic.copies keeps copies of a sharded optimizer state, but "
                             "this plan keeps it whole on every replica: nothing to copy")

    def rewrite(self, lists, info, phase, policy):
        def one(lst):
            out = []
            for a in lst:
                if isinstance(a, GradNorm) and any(isinstance(x, WaitGrad) for x in lst):
                    out.append(WaitCopy())
                out.append(a)
                if isinstance(a, WaitGrad):
                    out.append(CopyGrad(a.blocks))
                elif isinstance(a, Update):
                    out.append(CopyUpdate(a.block))
            return tuple(out)
        return tuple(one(lst) for lst in lists)

    def validator(self, life):
        return CopyCheck(life)

    def memory(self, walk):
        return CopyBytes(walk)

    def simulator(self, flat):  # small messages and a segment's AdamW: not modelled
        return Handlers(dict.fromkeys(self.actions, lambda a: None))

    def describe(self) -> str:
        return "peer copies of the sharded optimizer state (elastic.copies)"


def of_config(cfg, blocks) -> MirrorPass | None:
    """The pass `elastic.copies` asks for where the optimizer state is sharded (None: off, or a
    whole state on every replica)."""
    el = cfg.elastic
    if not (el.enabled and el.copies):
        return None
    if policy_of(cfg.schedule).shards(cfg.parallel.dp) <= 1:
        return None
    return MirrorPass()


class CopyCheck(Extension):
    """The validator's view: a block's copy gradient is sent after its reduce-scatter is
    waited for, once a step; every one is waited for before the step's global facts; the
    copy's update follows the block's update at once."""

    def __init__(self, life):
        self.life = life
        self.sent: set[str] = set()
        self.waiting = False
        self.last_update: str | None = None

    def handlers(self) -> dict:
        return {CopyGrad: self._copy, WaitCopy: self._wait, CopyUpdate: self._update}

    def _copy(self, e, b, x):
        if x.waited != self.life.k:
            self.life.fail(e, f"copy of {b}'s gradient before its reduce-scatter is waited for")
        if b in self.sent:
            self.life.fail(e, f"copy of {b}'s gradient sent twice")
        self.sent.add(b)
        self.waiting = True

    def _wait(self, e, b, x):
        pass

    def _update(self, e, b, x):
        if self.last_update != b:
            self.life.fail(e, f"copy update of {b} not right after its update")

    def before(self, blk, e) -> None:
        if isinstance(e, GradNorm):
            missing = [b for b in self.life.st if b not in self.sent]
            if missing:
                self.life.fail(e, f"global facts before the copy gradients of {missing}")

    def after(self, blk, e) -> None:
        if isinstance(e, WaitCopy):
            self.waiting = False
        if isinstance(e, GradNorm):
            self.sent.clear()
        self.last_update = e.block if isinstance(e, Update) else None

    def unsettled(self) -> list[str]:
        return ["copy gradients not waited for"] if self.waiting else []


class CopyBytes:
    """The memory model's view: the copy and its gradient resident (unless the walk's static
    bytes were measured, which include them); the actions move no other bytes."""

    def __init__(self, walk):
        if walk.sizes.static is None:
            held = sum(shard_size(walk.sizes.params[b], walk.sizes.shards) for b in walk.blocks)
            walk.cur += COPY_BYTES_PER_PARAM * held

    def handlers(self) -> dict:
        return dict.fromkeys((CopyGrad, WaitCopy, CopyUpdate), lambda blk, e: None)


__all__ = ["COPY_BYTES_PER_PARAM", "CopyBytes", "CopyCheck", "CopyGrad", "CopyUpdate",
           "MirrorPass", "NAME", "WaitCopy", "of_config"]
