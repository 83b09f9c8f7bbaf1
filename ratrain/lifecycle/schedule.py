"""The pipeline schedule as data: frozen action records and pure builders.

One rank's step is a tuple of actions run in order by the `Executor`:

- compute: `Forward(mb)` / `Backward(mb)` run every block of this stage for micro-batch `mb`
  (the executor loops over the blocks, consulting the per-block recompute choice);
- point-to-point: `RecvForward`, `SendForward`, `RecvBackward`, `SendBackward` (micro-batch `mb`),
  absent at the pipeline's ends;
- lifecycle, per block: `MaterializeView`, `DropView`, `AllocGrad`, `FreeGrad`, `SyncGrad`
  (start the data-parallel all-reduce of one or several blocks' gradients in the comm engine,
  non-blocking), `WaitGrad`, `Update` (AdamW of one block); and `GradNorm`, the step's global
  facts (gradient norm in global block order across stages, fp16 overflow flag, the loss).
  With the optimizer state sharded over the dp replicas (`ratrain`, dp > 1) the sync is a
  reduce-scatter (`SyncGrad(scatter=True)`, grid `R`), the view is cast from the own master
  segment and all-gathered (`MaterializeView(gather=True)`, grid `A`) and waited for before the
  block's first forward (`WaitView`, grid `Y`).

A lifecycle action may also ride on a compute action as a hook (`Backward(mb, post=(("layers.3",
SyncGrad(("layers.3",))),))`): it runs just before (`pre`) or just after (`post`) that block's part
of the compute, which is how a policy starts a block's gradient sync in the middle of the last
backward. Builders here are pure functions of (pp, stage, num_micro_batches); the policies in
`policies.py` add the lifecycle actions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

Hooks = tuple[tuple[str, "Action"], ...]  # ((block, action), ...) in run order


@dataclass(frozen=True)
class Action:
    """Base of every action record; `code` is the letter used by the grid printer."""

    code: ClassVar[str] = "?"

    def label(self, stage: int) -> str:  # pragma: no cover - overridden
        return self.code


# -- compute ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Forward(Action):
    mb: int
    pre: Hooks = ()  # lifecycle actions run just before a block's forward
    post: Hooks = ()  # ... just after it
    code: ClassVar[str] = "F"

    def label(self, stage: int) -> str:
        return f"{stage}F{self.mb}"


@dataclass(frozen=True)
class Backward(Action):
    mb: int
    pre: Hooks = ()  # e.g. AllocGrad just before the block's first backward
    post: Hooks = ()  # e.g. SyncGrad / DropView just after the block's last backward
    code: ClassVar[str] = "B"

    def label(self, stage: int) -> str:
        return f"{stage}B{self.mb}"


# -- point-to-point -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RecvForward(Action):
    mb: int
    code: ClassVar[str] = "rf"

    def label(self, stage: int) -> str:
        return f"rf{self.mb}"


@dataclass(frozen=True)
class SendForward(Action):
    mb: int
    code: ClassVar[str] = "sf"

    def label(self, stage: int) -> str:
        return f"sf{self.mb}"


@dataclass(frozen=True)
class RecvBackward(Action):
    mb: int
    code: ClassVar[str] = "rb"

    def label(self, stage: int) -> str:
        return f"rb{self.mb}"


@dataclass(frozen=True)
class SendBackward(Action):
    mb: int
    code: ClassVar[str] = "sb"

    def label(self, stage: int) -> str:
        return f"sb{self.mb}"


# -- lifecycle ----------------------------------------------------------------------------------


def short_block(block: str) -> str:
    """`embed` -> `e`, `layers.3` -> `3`, `head` -> `h` (grid cells)."""
    if block.startswith("layers."):
        return block[len("layers.") :]
    return block[:1]


@dataclass(frozen=True)
class MaterializeView(Action):
    """Make the block's working (fp16) view from its fp32 master; in fp32 the view is the master.

    `gather` (optimizer state sharded over the dp replicas): cast this replica's master segment
    into its segment of the view and start the ring all-gather of the view in the comm engine
    (non-blocking); `WaitView` completes it."""

    block: str
    gather: bool = False
    code: ClassVar[str] = "V"

    def label(self, stage: int) -> str:
        return f"{'A' if self.gather else 'V'}{short_block(self.block)}"


@dataclass(frozen=True)
class WaitView(Action):
    """Wait for the block's view all-gather (sharded optimizer state), before its first use."""

    block: str
    code: ClassVar[str] = "Y"

    def label(self, stage: int) -> str:
        return f"Y{short_block(self.block)}"


@dataclass(frozen=True)
class DropView(Action):
    block: str
    code: ClassVar[str] = "v"

    def label(self, stage: int) -> str:
        return f"v{short_block(self.block)}"


@dataclass(frozen=True)
class AllocGrad(Action):
    block: str
    code: ClassVar[str] = "G"

    def label(self, stage: int) -> str:
        return f"G{short_block(self.block)}"


@dataclass(frozen=True)
class FreeGrad(Action):
    block: str
    code: ClassVar[str] = "g"

    def label(self, stage: int) -> str:
        return f"g{short_block(self.block)}"


@dataclass(frozen=True)
class SyncGrad(Action):
    """Start the data-parallel sum of these blocks' gradients (one ring collective per block).

    `scatter` (optimizer state sharded over the dp replicas): a ring reduce-scatter, after which
    replica q holds the reduced segment q only (the same per-element order as the all-reduce)."""

    blocks: tuple[str, ...]
    scatter: bool = False
    code: ClassVar[str] = "S"

    def label(self, stage: int) -> str:
        return ("R" if self.scatter else "S") + ",".join(short_block(b) for b in self.blocks)


@dataclass(frozen=True)
class WaitGrad(Action):
    """Wait for these blocks' syncs; computes the fp64 sum of squares of this replica's segment
    of each block. `scatter`: the sync was a reduce-scatter; only the own segment is kept."""

    blocks: tuple[str, ...]
    scatter: bool = False
    code: ClassVar[str] = "W"

    def label(self, stage: int) -> str:
        return "W" + ",".join(short_block(b) for b in self.blocks)


@dataclass(frozen=True)
class GradNorm(Action):
    """The step's global facts: grad norm, overflow flag, mean loss (one small collective)."""

    code: ClassVar[str] = "N"

    def label(self, stage: int) -> str:
        return "N"


@dataclass(frozen=True)
class Update(Action):
    """AdamW of one block with the step's clip coefficient and loss scale."""

    block: str
    code: ClassVar[str] = "U"

    def label(self, stage: int) -> str:
        return f"U{short_block(self.block)}"


COMPUTE = (Forward, Backward)
P2P = (RecvForward, SendForward, RecvBackward, SendBackward)
LIFECYCLE = (MaterializeView, WaitView, DropView, AllocGrad, FreeGrad, SyncGrad, WaitGrad, GradNorm,
             Update)


# -- builders -----------------------------------------------------------------------------------


def _fwd(pp: int, stage: int, mb: int) -> list[Action]:
    out: list[Action] = []
    if stage > 0:
        out.append(RecvForward(mb))
    out.append(Forward(mb))
    if stage < pp - 1:
        out.append(SendForward(mb))
    return out


def _bwd(pp: int, stage: int, mb: int) -> list[Action]:
    out: list[Action] = []
    if stage < pp - 1:
        out.append(RecvBackward(mb))
    out.append(Backward(mb))
    if stage > 0:
        out.append(SendBackward(mb))
    return out


def _check(pp: int, stage: int, m: int) -> None:
    if pp < 1 or not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not a stage of a {pp}-stage pipeline")
    if m < 1:
        raise ValueError(f"num_micro_batches={m}: a step needs at least one micro-batch")


def one_f_one_b(pp: int, stage: int, m: int) -> tuple[Action, ...]:
    """Non-interleaved 1F1B (PipeDream-flush) for one stage: works for any m >= 1, m < pp too.

    Deadlock-free with blocking (rendezvous) sends: between stages s and s+1 every forward message
    of a micro-batch is exchanged before the backward one, so in the steady state stage s+1 posts
    its next receive-forward before sending its backward (stage s sends forward first).
    """
    _check(pp, stage, m)
    warmup = min(pp - stage - 1, m)
    steady = m - warmup
    out: list[Action] = []

    # warm-up: forwards only, filling the pipeline below this stage
    for mb in range(warmup):
        out += _fwd(pp, stage, mb)

    # steady state: one forward, one backward
    if steady and stage > 0:
        out.append(RecvForward(warmup))
    for i in range(steady):
        f = warmup + i
        out.append(Forward(f))
        if stage < pp - 1:
            out.append(SendForward(f))
            out.append(RecvBackward(i))
        out.append(Backward(i))
        if f + 1 < m and stage > 0:
            out.append(RecvForward(f + 1))  # before SendBackward: the neighbour sends forward first
        if stage > 0:
            out.append(SendBackward(i))

    # cool-down: the backwards of the warm-up micro-batches
    for mb in range(steady, m):
        out += _bwd(pp, stage, mb)
    return tuple(out)


def gpipe(pp: int, stage: int, m: int) -> tuple[Action, ...]:
    """GPipe, the reference: all forwards, then all backwards (in micro-batch order)."""
    _check(pp, stage, m)
    out: list[Action] = []
    for mb in range(m):  # fill
        out += _fwd(pp, stage, mb)
    for mb in range(m):  # drain
        out += _bwd(pp, stage, mb)
    return tuple(out)


BUILDERS = {"1f1b": one_f_one_b, "gpipe": gpipe}


def add_hooks(
    actions,
    fwd_pre: dict[int, list] | None = None,
    bwd_pre: dict[int, list] | None = None,
    bwd_post: dict[int, list] | None = None,
) -> tuple[Action, ...]:
    """Attach (block, action) hooks to compute actions by micro-batch."""
    fwd_pre, bwd_pre, bwd_post = fwd_pre or {}, bwd_pre or {}, bwd_post or {}
    out = []
    for a in actions:
        if isinstance(a, Forward) and a.mb in fwd_pre:
            a = replace(a, pre=a.pre + tuple(fwd_pre[a.mb]))
        if isinstance(a, Backward):
            if a.mb in bwd_pre:
                a = replace(a, pre=a.pre + tuple(bwd_pre[a.mb]))
            if a.mb in bwd_post:
                a = replace(a, post=a.post + tuple(bwd_post[a.mb]))
        out.append(a)
    return tuple(out)


def expand(action: Action, blocks) -> list[tuple[str | None, Action]]:
    """An action as a sequence of (block, action) events: compute actions become one event per
    block (forward in block order, backward in reverse) with their hooks around it; anything else
    is one event with block None. Used by the validator and the grid printer."""
    if isinstance(action, (Forward, Backward)):
        order = list(blocks) if isinstance(action, Forward) else list(reversed(blocks))
        pre, post = {}, {}
        for b, h in action.pre:
            pre.setdefault(b, []).append(h)
        for b, h in action.post:
            post.setdefault(b, []).append(h)
        unknown = (set(pre) | set(post)) - set(blocks)
        if unknown:
            raise ValueError(f"{action} hooks name blocks this stage does not hold: {sorted(unknown)}")
        out = []
        for b in order:
            out += [(None, h) for h in pre.get(b, [])]
            out.append((b, action))
            out += [(None, h) for h in post.get(b, [])]
        return out
    return [(None, action)]


__all__ = [
    "BUILDERS",
    "COMPUTE",
    "LIFECYCLE",
    "P2P",
    "Action",
    "AllocGrad",
    "Backward",
    "DropView",
    "Forward",
    "FreeGrad",
    "GradNorm",
    "MaterializeView",
    "RecvBackward",
    "RecvForward",
    "SendBackward",
    "SendForward",
    "SyncGrad",
    "Update",
    "WaitGrad",
    "WaitView",
    "add_hooks",
    "expand",
    "gpipe",
    "one_f_one_b",
    "short_block",
]
