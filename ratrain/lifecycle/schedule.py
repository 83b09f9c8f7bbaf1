"""The pipeline schedule as data: the action vocabulary, its names, and the pure builders.

One rank's step is a tuple of frozen action records run in order by the `Executor`. Every
action belongs to one group:

- compute: `Forward(mb)` / `Backward(mb)` run every block of this stage for micro-batch `mb`
  (the executor loops over the blocks; a backward re-runs what the layer's recompute choice
  dropped);
- p2p: `RecvForward`, `SendForward`, `RecvBackward`, `SendBackward` of micro-batch `mb`, absent
  at the pipeline's ends;
- lifecycle, per block: `MaterializeView`, `WaitView`, `DropView`, `AllocGrad`, `FreeGrad`,
  `SyncGrad`, `WaitGrad`, `Update`, and `GradNorm`, the step's global facts.

These are the core vocabulary (`ACTIONS`). A pass over the step (`lifecycle.passes`) brings its
own actions and places them: partial synchronization's parameter averages, the memory tier's
transfers.

A lifecycle action may ride on a compute action as a hook (`Backward(mb, post=(("layers.3",
SyncGrad(("layers.3",))),))`): it runs just before (`pre`) or just after (`post`) that block's part
of the compute, which is how a policy starts a block's gradient sync in the middle of the last
backward. `expand` turns a compute action into its per-block events with the hooks in place.

Names: every action has one readable name, built here from its fields (`F mb3`, `sync L5`,
`update embed`, `recv-fwd mb0`); `event_name(action, block)` names one block's part of a compute
action (`B mb3 L5`). Traces, the grid, the validator's errors and the simulator all use them.

Interpreters: the executor, the validator, the grid printer, the memory model and the simulator
each read actions through one `{action type: handler}` table made by `dispatch_table`, which
refuses a table that neither handles nor explicitly ignores some action type, its passes'
included: a new action cannot be silently skipped by one of them.

Builders here are pure functions of (pp, stage, num_micro_batches); `policies.py` adds the
lifecycle actions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import ClassVar

Hooks = tuple[tuple[str, "Action"], ...]  # ((block, action), ...) in run order
GROUPS = ("compute", "p2p", "lifecycle")


def block_label(block: str) -> str:
    """`layers.5` -> `L5`; `embed`, `head` as they are (names in traces, grids, errors)."""
    return "L" + block[len("layers."):] if block.startswith("layers.") else block


@dataclass(frozen=True)
class Action:
    """Base of every action record: its group, and its readable name built from its fields
    (`word`, then `mb<i>`, the block or blocks)."""

    group: ClassVar[str] = ""
    word: ClassVar[str] = ""

    def verb(self) -> str:
        """The first word of the name (an action with a flag may say more)."""
        return self.word

    def name(self) -> str:
        parts = [self.verb()]
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "mb":
                parts.append(f"mb{v}")
            elif f.name == "block":
                parts.append(block_label(v))
            elif f.name == "blocks":
                parts.append(",".join(block_label(b) for b in v))
        return " ".join(parts)

    def __str__(self) -> str:
        return self.name()


# Deliberate repetition below: one small explicit record per action (its docstring and its word),
# so that the whole vocabulary reads in one place; the shared fields live in the bases.

# -- compute ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Compute(Action):
    mb: int
    pre: Hooks = ()  # lifecycle actions run just before a block's part (e.g. AllocGrad)
    post: Hooks = ()  # ... just after it (e.g. SyncGrad / DropView after the last backward)
    group: ClassVar[str] = "compute"


@dataclass(frozen=True)
class Forward(_Compute):
    """Run this stage's blocks forward on micro-batch `mb` (in block order), keeping what each
    layer's recompute choice lets it keep for the backward."""

    word: ClassVar[str] = "F"


@dataclass(frozen=True)
class Backward(_Compute):
    """Run this stage's blocks backward on micro-batch `mb` (in reverse block order), adding
    into each block's gradient buffer."""

    word: ClassVar[str] = "B"


# -- point-to-point -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Message(Action):
    mb: int
    group: ClassVar[str] = "p2p"


@dataclass(frozen=True)
class RecvForward(_Message):
    """Wait for micro-batch `mb`'s activations from the previous stage (posted early)."""

    word: ClassVar[str] = "recv-fwd"


@dataclass(frozen=True)
class SendForward(_Message):
    """Hand micro-batch `mb`'s output activations to the next stage (non-blocking)."""

    word: ClassVar[str] = "send-fwd"


@dataclass(frozen=True)
class RecvBackward(_Message):
    """Wait for the gradient of micro-batch `mb`'s output from the next stage (posted early)."""

    word: ClassVar[str] = "recv-bwd"


@dataclass(frozen=True)
class SendBackward(_Message):
    """Hand the gradient of micro-batch `mb`'s input to the previous stage (non-blocking)."""

    word: ClassVar[str] = "send-bwd"


# -- lifecycle ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _OfBlock(Action):
    block: str
    group: ClassVar[str] = "lifecycle"


@dataclass(frozen=True)
class _OfBlocks(Action):
    blocks: tuple[str, ...]
    scatter: bool = False  # the optimizer state is sharded over dp: a reduce-scatter
    group: ClassVar[str] = "lifecycle"


@dataclass(frozen=True)
class MaterializeView(_OfBlock):
    """Make the block's working (fp16) view from its fp32 master; in fp32 the view is the master.

    `gather` (optimizer state sharded over the dp replicas): cast this replica's master segment
    into its segment of the view and start the ring all-gather of the view in the comm engine
    (non-blocking); `WaitView` completes it."""

    gather: bool = False

    def verb(self) -> str:
        return "gather-view" if self.gather else "view"


@dataclass(frozen=True)
class WaitView(_OfBlock):
    """Wait for the block's view all-gather (sharded optimizer state), before its first use."""

    word: ClassVar[str] = "wait-view"


@dataclass(frozen=True)
class DropView(_OfBlock):
    """Release the block's separate working view (fp16, or a sharded master's copy)."""

    word: ClassVar[str] = "drop-view"


@dataclass(frozen=True)
class AllocGrad(_OfBlock):
    """Allocate the block's zeroed fp32 gradient buffer, before its first backward."""

    word: ClassVar[str] = "alloc-grad"


@dataclass(frozen=True)
class FreeGrad(_OfBlock):
    """Release the block's gradient buffer, after its update."""

    word: ClassVar[str] = "free-grad"


@dataclass(frozen=True)
class SyncGrad(_OfBlocks):
    """Start the data-parallel sum of these blocks' gradients (one ring collective per block).

    `scatter` (optimizer state sharded over the dp replicas): a ring reduce-scatter, after which
    replica q holds the reduced segment q only (the same per-element order as the all-reduce)."""

    def verb(self) -> str:
        return "sync-scatter" if self.scatter else "sync"


@dataclass(frozen=True)
class WaitGrad(_OfBlocks):
    """Wait for these blocks' syncs; computes the fp64 sum of squares of this replica's segment
    of each block. `scatter`: the sync was a reduce-scatter; only the own segment is kept."""

    word: ClassVar[str] = "wait-sync"


@dataclass(frozen=True)
class GradNorm(Action):
    """The step's global facts: grad norm, overflow flag, mean loss (one small collective)."""

    group: ClassVar[str] = "lifecycle"
    word: ClassVar[str] = "norm"


@dataclass(frozen=True)
class Update(_OfBlock):
    """AdamW of one block with the step's clip coefficient and loss scale."""

    word: ClassVar[str] = "update"


# The core vocabulary, which every interpreter handles; a pass over the step adds its own
# (`lifecycle.passes`: `Pass.actions`), which it gives each interpreter handlers for.
ACTIONS: tuple[type[Action], ...] = (
    Forward, Backward, RecvForward, SendForward, RecvBackward, SendBackward, MaterializeView,
    WaitView, DropView, AllocGrad, FreeGrad, SyncGrad, WaitGrad, GradNorm, Update,
)


def event_name(action: Action, block: str | None = None) -> str:
    """The name of an action, or of one block's part of a compute action (`F mb3 L5`)."""
    return action.name() if block is None else f"{action.name()} {block_label(block)}"


_REFUSE = object()  # ActionTable(others=...) unset: an action of an unknown pass is an error


class ActionTable(dict):
    """An interpreter's `{action type: handler}` table (see `dispatch_table`). An action type it
    does not hold belongs to a pass the interpreter was not given: `others` handles it (an
    interpreter to which every pass's action is alike, as the pipeline checks), or it is an
    error naming the action and the interpreter."""

    def __init__(self, consumer: str, others=_REFUSE):
        super().__init__()
        self.consumer, self.others = consumer, others

    def __missing__(self, t):
        if self.others is not _REFUSE and isinstance(t, type) and issubclass(t, Action):
            return self.others
        raise TypeError(f"{self.consumer}: no handler for {getattr(t, '__name__', t)}: an "
                        "action of a pass over the step that this interpreter was not given "
                        "(build it with the plan's passes)")


def dispatch_table(consumer: str, handlers: Mapping[type, Callable],
                   ignore: Iterable[type] = (), default: Callable = lambda *a, **k: None,
                   passes=(), others=_REFUSE) -> ActionTable:
    """A consumer's `{action type: handler}` table, checked to cover every core action type
    (`ACTIONS`) and every action of each pass in `passes` (`Pass.actions`, handled through
    the pass's own handlers merged into `handlers`): each is handled, or listed in `ignore`
    (mapped to `default`, a no-op unless given). A type neither handled nor ignored is a
    programming error raised here. `others`: the entry of actions of passes not in `passes`
    (unset: such an action is an error when it comes)."""
    ignore = tuple(ignore)
    known = set(ACTIONS).union(*(p.actions for p in passes))
    unknown = [t.__name__ for t in (*handlers, *ignore) if t not in known]
    missing = [t.__name__ for t in ACTIONS if t not in handlers and t not in ignore]
    missing += [f"{t.__name__} (pass {p.name})" for p in passes for t in p.actions
                if t not in handlers and t not in ignore]
    if unknown or missing:
        raise TypeError(f"{consumer}: action table " + (f"names unknown types {unknown}"
                        if unknown else f"neither handles nor ignores {missing}"))
    table = ActionTable(consumer, others)
    table.update(dict.fromkeys(ignore, default))
    table.update(handlers)
    return table


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
    is one event with block None. Used by every interpreter of action lists."""
    if action.group != "compute":
        return [(None, action)]
    order = list(blocks) if isinstance(action, Forward) else list(reversed(blocks))
    pre: dict[str, list] = {}
    post: dict[str, list] = {}
    for b, h in action.pre:
        pre.setdefault(b, []).append(h)
    for b, h in action.post:
        post.setdefault(b, []).append(h)
    unknown = (set(pre) | set(post)) - set(blocks)
    if unknown:
        raise ValueError(f"{action} hooks name blocks this stage does not hold: {sorted(unknown)}")
    out: list[tuple[str | None, Action]] = []
    for b in order:
        out += [(None, h) for h in pre.get(b, [])]
        out.append((b, action))
        out += [(None, h) for h in post.get(b, [])]
    return out


__all__ = [
    "ACTIONS",
    "BUILDERS",
    "GROUPS",
    "Action",
    "ActionTable",
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
    "block_label",
    "dispatch_table",
    "event_name",
    "expand",
    "gpipe",
    "one_f_one_b",
]
