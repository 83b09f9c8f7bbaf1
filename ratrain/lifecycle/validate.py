"""Check a schedule before running it: pipeline order, point-to-point matching, lifecycle legality.

Three checks, all pure (no MPI), each reading actions through its own `dispatch_table`:

- `check_pipeline`: per step and rank, every micro-batch is forwarded once and backwarded once,
  the forward first; activations are received before the forward and sent after it (gradients
  likewise); no messages past the pipeline's ends.
- `simulate`: runs every rank's list against its neighbours with *blocking rendezvous* sends
  (a send completes only when the peer reaches the matching receive: the strictest semantics,
  so a schedule that passes deadlocks under none) and `GradNorm` as a collective of all ranks;
  messages of a channel must match in order and micro-batch. A stuck state is reported with
  what every rank was waiting for.
- `check_lifecycle`: per rank over several steps and the final flush: a block's view is current
  (materialised after its master's last update) at each forward and backward; its gradient is
  allocated before its first backward; its sync starts after its last backward; the wait after
  the sync; the global norm after every block's wait; the update after its wait, the step's
  norm and the last backward, before the block's next forward; the gradient freed only after the
  update; nothing left pending after the flush. With the optimizer state sharded over the dp
  replicas (`sharded=True`) every sync must be a reduce-scatter and every view made by an
  all-gather (and none otherwise); a gathered view is usable only after its `WaitView`, and the
  view is never the master (it goes stale at the update, as in fp16). Each pass over the step
  (`lifecycle.passes`) checks its own actions, and may hook every other event, through an
  `Extension` of its own (`Pass.validator`): partial synchronization's averages
  (`lifecycle.passes.partial`), the memory tier's transfers (`lifecycle.passes.offload`).

`validate_policy(policy, info_per_stage)` runs all three over a few steps.
"""

from __future__ import annotations

from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.policies import Policy
from ratrain.lifecycle.schedule import dispatch_table, expand

LIFECYCLE = (sched.MaterializeView, sched.WaitView, sched.DropView, sched.AllocGrad, sched.FreeGrad, sched.SyncGrad, sched.WaitGrad,
             sched.GradNorm, sched.Update)


class ScheduleError(ValueError):
    """A schedule that would compute the wrong thing, deadlock, or misplace a lifecycle action."""


# -- pipeline order -----------------------------------------------------------------------------

# Per micro-batch action: (what must already have happened for the same micro-batch on this
# stage, given (first stage?, last stage?)), and which end of the pipeline it cannot occur at.
_NEEDS = dispatch_table("validate.check_pipeline", {
    sched.Forward: lambda first, last: [] if first else [sched.RecvForward],
    sched.SendForward: lambda first, last: [sched.Forward],
    sched.Backward: lambda first, last: [sched.Forward] + ([] if last else [sched.RecvBackward]),
    sched.SendBackward: lambda first, last: [sched.Backward],
    sched.RecvForward: lambda first, last: [],
    sched.RecvBackward: lambda first, last: [],
}, ignore=LIFECYCLE, default=None, others=None)  # a pass's actions: lifecycle
_NOT_AT = {sched.RecvForward: "first", sched.SendBackward: "first", sched.SendForward: "last", sched.RecvBackward: "last"}


def check_pipeline(lists, m: int) -> None:
    """`lists[stage]`: one step's actions of every stage (one replica)."""
    pp = len(lists)
    for s, actions in enumerate(lists):
        first, last = s == 0, s == pp - 1
        seen: dict[tuple[type, int], int] = {}
        for i, a in enumerate(actions):
            needs = _NEEDS[type(a)]
            if needs is None:  # a lifecycle action: no micro-batch
                continue
            mb = a.mb
            where = f"stage {s}, action {i} ({a})"
            if not 0 <= mb < m:
                raise ScheduleError(f"{where}: micro-batch {mb} outside 0..{m - 1}")
            if (type(a), mb) in seen:
                raise ScheduleError(f"{where}: {type(a).__name__}({mb}) appears twice")
            seen[type(a), mb] = i
            end = _NOT_AT.get(type(a))
            if (end == "first" and first) or (end == "last" and last):
                raise ScheduleError(f"{where}: the {end} stage has no "
                                    f"{'previous' if end == 'first' else 'next'} stage")
            for need in needs(first, last):
                if (need, mb) not in seen:
                    raise ScheduleError(f"{where}: comes before {need.__name__}({mb})")
        for t, ok in ((sched.Forward, True), (sched.Backward, True), (sched.SendForward, not last),
                      (sched.RecvForward, not first), (sched.SendBackward, not first), (sched.RecvBackward, not last)):
            missing = [mb for mb in range(m) if ok and (t, mb) not in seen]
            if missing:
                raise ScheduleError(f"stage {s}: no {t.__name__} of micro-batch(es) {missing}")


# -- deadlock -----------------------------------------------------------------------------------

# What an action is to the rendezvous simulation: a local step, a collective of every rank, or
# a message (channel, peer offset, role): a send on channel "fwd" of stage s matches the
# receive of stage s+1 on the same channel.
_LOCAL, _COLLECTIVE = "local", "collective"
_RENDEZVOUS = dispatch_table("validate.simulate", {
    sched.SendForward: ("fwd", +1, "send"),
    sched.RecvForward: ("fwd", -1, "recv"),
    sched.SendBackward: ("bwd", -1, "send"),
    sched.RecvBackward: ("bwd", +1, "recv"),
    sched.GradNorm: _COLLECTIVE,
}, ignore=(sched.Forward, sched.Backward, *[t for t in LIFECYCLE if t is not sched.GradNorm]),
   default=_LOCAL, others=_LOCAL)  # a pass's actions: local to the rank


def simulate(lists) -> list[list[int]]:
    """Run every rank's action list with rendezvous sends; returns, per rank, the global order
    index at which each action completed. Raises ScheduleError on deadlock or mismatch."""
    pp = len(lists)
    ip = [0] * pp
    done: list[list[int]] = [[] for _ in range(pp)]
    clock = 0

    def cur(s):
        return lists[s][ip[s]] if ip[s] < len(lists[s]) else None

    def role(a):
        return None if a is None else _RENDEZVOUS[type(a)]

    def advance(s):
        nonlocal clock
        done[s].append(clock)
        clock += 1
        ip[s] += 1

    while any(ip[s] < len(lists[s]) for s in range(pp)):
        progress = False
        for s in range(pp):
            a = cur(s)
            what = role(a)
            if what is None:
                continue
            if what == _COLLECTIVE:
                if all(role(cur(r)) == _COLLECTIVE for r in range(pp)):
                    for r in range(pp):
                        advance(r)
                    progress = True
                continue
            if what == _LOCAL:
                advance(s)
                progress = True
                continue
            chan, off, me = what
            peer = s + off
            b = cur(peer) if 0 <= peer < pp else None
            other = role(b)
            if not isinstance(other, tuple):
                continue
            if other[0] == chan and other[1] == -off and other[2] != me:
                if b.mb != a.mb:
                    raise ScheduleError(
                        f"stage {s} {a} meets stage {peer} {b}: micro-batches of a channel must "
                        "match in order")
                advance(s)
                advance(peer)
                progress = True
        if not progress:
            state = "; ".join(f"stage {s} at {cur(s) or 'end'} (action {ip[s]})" for s in range(pp))
            raise ScheduleError(f"deadlock with blocking sends: {state}")
    return done


# -- lifecycle ----------------------------------------------------------------------------------


class _Block:
    def __init__(self):
        self.master = 0  # master version (updates applied)
        self.view = None  # master version the view was made from; None = absent
        self.grad = None  # step whose gradient the buffer holds
        self.bwd = 0  # backwards this step
        self.pending = None  # step whose gradient awaits its update
        self.synced = None  # step last synced
        self.waited = None  # step last waited
        self.gathering = False  # a view all-gather in flight (sharded)


class Extension:
    """A pass's part of one stage's lifecycle check (`Pass.validator(life)`, `life` the stage's
    `_Lifecycle`: its `fail`, `stage`, `m`, step `k`, blocks' states `st`). `handlers()`:
    `{action type: f(action, block, block state)}` for its own actions (and any core action it
    checks instead of the core); `before` / `after`: called around every other event, with its
    block (None for a lifecycle action); `unsettled()`: what it leaves in flight at the end of
    a list (an error); `end()`: its last check after the flush."""

    def handlers(self) -> dict:
        return {}

    def before(self, blk, e) -> None:
        pass

    def after(self, blk, e) -> None:
        pass

    def unsettled(self) -> list[str]:
        return []

    def end(self) -> None:
        pass


class _Lifecycle:
    """The lifecycle state machine of one rank's blocks (see the module)."""

    def __init__(self, blocks, m: int, stage: int, fp16: bool, sharded: bool, passes=()):
        self.st = {b: _Block() for b in blocks}
        self.m, self.stage, self.sharded = m, stage, sharded
        self.view_is_master = not fp16 and not sharded
        self.norm_step = None
        self.k = 0
        self.ext = [x for x in (p.validator(self) for p in passes) if x is not None]
        self.table = dispatch_table("validate.check_lifecycle", {
            sched.Forward: self._use_view, sched.Backward: self._backward,
            sched.MaterializeView: self._materialize, sched.WaitView: self._wait_view,
            sched.DropView: self._drop_view, sched.AllocGrad: self._alloc, sched.SyncGrad: self._sync,
            sched.WaitGrad: self._wait, sched.Update: self._update, sched.FreeGrad: self._free,
            **{t: f for x in self.ext for t, f in x.handlers().items()},
        }, ignore=(sched.RecvForward, sched.SendForward, sched.RecvBackward, sched.SendBackward, sched.GradNorm),
            passes=passes)

    def fail(self, e, msg):
        raise ScheduleError(f"stage {self.stage}, step {self.k}, {e}: {msg}")

    def event(self, blk, e) -> None:
        flag = {sched.SyncGrad: "scatter", sched.WaitGrad: "scatter", sched.MaterializeView: "gather"}.get(type(e))
        if flag is not None and getattr(e, flag) != self.sharded:
            self.fail(e, f"{flag}={getattr(e, flag)} on a stage whose optimizer state is "
                         f"{'' if self.sharded else 'not '}sharded")
        for x in self.ext:
            x.before(blk, e)
        if isinstance(e, sched.GradNorm):
            late = [b for b, x in self.st.items() if x.waited != self.k]
            if late:
                self.fail(e, f"global norm before the sync wait of {late}")
            self.norm_step = self.k
            for x in self.ext:
                x.after(blk, e)
            return
        names = [blk] if blk is not None else (
            list(e.blocks) if hasattr(e, "blocks") else [e.block] if hasattr(e, "block") else [])
        for b in names:
            if b not in self.st:
                self.fail(e, f"block {b!r} is not on this stage")
            self.table[type(e)](e, b, self.st[b])
        for x in self.ext:
            x.after(blk, e)

    def _use_view(self, e, b, x):
        if x.view is None:
            self.fail(e, f"view of {b} not materialised")
        if x.gathering:
            self.fail(e, f"view of {b} used before its all-gather was waited for")
        if x.view != x.master or x.pending is not None:
            self.fail(e, f"view of {b} is stale (update pending or view made before it)")

    def _backward(self, e, b, x):
        self._use_view(e, b, x)
        if x.grad != self.k:
            self.fail(e, f"gradient of {b} not allocated for this step")
        x.bwd += 1
        if x.bwd == self.m:
            x.pending = self.k

    def _materialize(self, e, b, x):
        if x.gathering:
            self.fail(e, f"view of {b} made again while its all-gather is in flight")
        x.view = x.master
        x.gathering = e.gather

    def _wait_view(self, e, b, x):
        if not x.gathering:
            self.fail(e, f"wait for the view of {b} without an all-gather in flight")
        x.gathering = False

    def _drop_view(self, e, b, x):
        if x.view is None:
            self.fail(e, f"view of {b} dropped twice")
        if x.gathering:
            self.fail(e, f"view of {b} dropped while its all-gather is in flight")
        x.view = None

    def _alloc(self, e, b, x):
        if x.grad is not None:
            self.fail(e, f"gradient of {b} still held from step {x.grad}")
        x.grad = self.k

    def _sync(self, e, b, x):
        if x.pending != self.k or x.bwd != self.m:
            self.fail(e, f"sync of {b} before its last backward")
        if x.synced == self.k:
            self.fail(e, f"{b} synced twice")
        x.synced = self.k

    def _wait(self, e, b, x):
        if x.synced != self.k or x.waited == self.k:
            self.fail(e, f"wait of {b} without a sync in flight")
        x.waited = self.k

    def _update(self, e, b, x):
        j = x.pending
        if j is None:
            self.fail(e, f"no gradient of {b} awaits an update")
        if x.waited != j or self.norm_step != j:
            self.fail(e, f"update of {b} before its sync wait and the step's norm")
        if x.grad != j:
            self.fail(e, f"update of {b} without its gradient")
        x.master += 1
        x.pending = None
        if self.view_is_master and x.view is not None:
            x.view = x.master

    def _free(self, e, b, x):
        if x.grad is None or x.pending is not None:
            self.fail(e, f"gradient of {b} freed before its update")
        x.grad = None

    def end_step(self, is_step: bool) -> None:
        unsettled = [u for x in self.ext for u in x.unsettled()]
        if unsettled:
            raise ScheduleError(f"stage {self.stage}, step {self.k}: in flight at the end of "
                                f"the list: {', '.join(unsettled)}")
        if not is_step:
            return
        for b, x in self.st.items():
            if x.bwd != self.m or x.waited != self.k:
                raise ScheduleError(f"stage {self.stage}, step {self.k}: {b} not "
                                    "backwarded/synced")
        if self.norm_step != self.k:
            raise ScheduleError(f"stage {self.stage}, step {self.k}: no GradNorm")

    def end(self) -> None:
        for b, x in self.st.items():
            if x.pending is not None or x.grad is not None:
                raise ScheduleError(f"stage {self.stage}: {b} left with a pending update or "
                                    "gradient")
            if x.gathering:
                raise ScheduleError(f"stage {self.stage}: {b} left with a view all-gather in "
                                    "flight")
        for x in self.ext:
            x.end()


def check_lifecycle(steps, blocks, m: int, stage: int = 0, fp16: bool = True,
                    sharded: bool = False, passes=()) -> None:
    """`steps`: this rank's successive step lists; a trailing list without compute is the flush.
    In fp32 (`fp16=False`) and unsharded a materialised view is the master itself, so it never
    goes stale. `sharded`: masters and moments are cut over the dp replicas; `passes`: the
    plan's passes over the step, each checking its own actions (see the module)."""
    life = _Lifecycle(blocks, m, stage, fp16, sharded, passes)
    for k, actions in enumerate(steps):
        life.k = k
        for x in life.st.values():
            x.bwd = 0
        for a in actions:
            for blk, e in expand(a, blocks):
                life.event(blk, e)
        life.end_step(any(a.group == "compute" for a in actions))
    life.end()


def validate_policy(policy: Policy, infos, steps: int = 3) -> None:
    """All checks for one replica's stages (`infos[stage]`: StageInfo) over a few steps."""
    validate_stages([policy.steps(info, steps) for info in infos], infos, steps)


def validate_stages(per_rank, infos, steps: int, lifecycle: bool = True, passes=()) -> None:
    """All checks of `per_rank[stage]`: `steps` consecutive lists then the flush of each stage
    (`infos[stage]`: StageInfo); `lifecycle=False`: the pipeline order alone (a bare order);
    `passes`: the plan's passes over the step."""
    m = infos[0].num_micro_batches
    for k in range(steps):
        check_pipeline([r[k] for r in per_rank], m)
    simulate([[a for lst in r for a in lst] for r in per_rank])
    if lifecycle:
        for info, r in zip(infos, per_rank):
            check_lifecycle(r, info.blocks, m, info.stage, info.half, info.sharded, passes)


__all__ = [
    "Extension",
    "ScheduleError",
    "check_lifecycle",
    "check_pipeline",
    "simulate",
    "validate_policy",
    "validate_stages",
]
