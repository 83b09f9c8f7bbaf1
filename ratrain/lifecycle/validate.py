"""Check a schedule before running it: pipeline order, point-to-point matching, lifecycle legality.

Three checks, all pure (no MPI):

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
  view is never the master (it goes stale at the update, as in fp16).

`validate_policy(policy, info_per_stage)` runs all three over a few steps.
"""

from __future__ import annotations

from ratrain.lifecycle.schedule import (
    AllocGrad,
    Backward,
    DropView,
    Forward,
    FreeGrad,
    GradNorm,
    MaterializeView,
    RecvBackward,
    RecvForward,
    SendBackward,
    SendForward,
    SyncGrad,
    Update,
    WaitGrad,
    WaitView,
    expand,
)


class ScheduleError(ValueError):
    """A schedule that would compute the wrong thing, deadlock, or misplace a lifecycle action."""


# -- pipeline order -----------------------------------------------------------------------------


def check_pipeline(lists, m: int) -> None:
    """`lists[stage]`: one step's actions of every stage (one replica)."""
    pp = len(lists)
    for s, actions in enumerate(lists):
        seen: dict[tuple[type, int], int] = {}
        for i, a in enumerate(actions):
            mb = getattr(a, "mb", None)
            if mb is None:
                continue
            where = f"stage {s}, action {i} ({a.label(s)})"
            if not 0 <= mb < m:
                raise ScheduleError(f"{where}: micro-batch {mb} outside 0..{m - 1}")
            key = (type(a), mb)
            if key in seen:
                raise ScheduleError(f"{where}: {type(a).__name__}({mb}) appears twice")
            seen[key] = i
            if isinstance(a, (RecvForward, SendBackward)) and s == 0:
                raise ScheduleError(f"{where}: stage 0 has no previous stage")
            if isinstance(a, (SendForward, RecvBackward)) and s == pp - 1:
                raise ScheduleError(f"{where}: the last stage has no next stage")

            # what must already have happened on this stage for this micro-batch
            needs = []
            if isinstance(a, Forward) and s > 0:
                needs.append(RecvForward)
            if isinstance(a, SendForward):
                needs.append(Forward)
            if isinstance(a, Backward):
                needs += [Forward] + ([RecvBackward] if s < pp - 1 else [])
            if isinstance(a, SendBackward):
                needs.append(Backward)
            for kind in needs:
                if (kind, mb) not in seen:
                    raise ScheduleError(f"{where}: comes before {kind.__name__}({mb})")
        for kind in (Forward, Backward):
            missing = [mb for mb in range(m) if (kind, mb) not in seen]
            if missing:
                raise ScheduleError(f"stage {s}: no {kind.__name__} of micro-batch(es) {missing}")
        for kind, ok in ((SendForward, s < pp - 1), (RecvForward, s > 0),
                         (SendBackward, s > 0), (RecvBackward, s < pp - 1)):
            missing = [mb for mb in range(m) if ok and (kind, mb) not in seen]
            if missing:
                raise ScheduleError(f"stage {s}: no {kind.__name__} of micro-batch(es) {missing}")


# -- deadlock -----------------------------------------------------------------------------------

# (direction, peer offset) of each p2p verb; a send on channel (s -> s+1, "fwd") matches the
# receive of stage s+1 on the same channel
_P2P = {
    SendForward: ("fwd", +1, "send"),
    RecvForward: ("fwd", -1, "recv"),
    SendBackward: ("bwd", -1, "send"),
    RecvBackward: ("bwd", +1, "recv"),
}


def simulate(lists) -> list[list[int]]:
    """Run every rank's action list with rendezvous sends; returns, per rank, the global order
    index at which each action completed. Raises ScheduleError on deadlock or mismatch."""
    pp = len(lists)
    ip = [0] * pp
    done: list[list[int]] = [[] for _ in range(pp)]
    clock = 0

    def cur(s):
        return lists[s][ip[s]] if ip[s] < len(lists[s]) else None

    def advance(s):
        nonlocal clock
        done[s].append(clock)
        clock += 1
        ip[s] += 1

    while any(ip[s] < len(lists[s]) for s in range(pp)):
        progress = False
        for s in range(pp):
            a = cur(s)
            if a is None:
                continue
            if isinstance(a, GradNorm):
                if all(isinstance(cur(r), GradNorm) for r in range(pp)):
                    for r in range(pp):
                        advance(r)
                    progress = True
                continue
            if type(a) not in _P2P:
                advance(s)
                progress = True
                continue
            chan, off, role = _P2P[type(a)]
            peer = s + off
            b = cur(peer) if 0 <= peer < pp else None
            if b is None or type(b) not in _P2P:
                continue
            pchan, poff, prole = _P2P[type(b)]
            if pchan == chan and poff == -off and prole != role:
                if b.mb != a.mb:
                    raise ScheduleError(
                        f"stage {s} {a.label(s)} meets stage {peer} {b.label(peer)}: "
                        "micro-batches of a channel must match in order"
                    )
                advance(s)
                advance(peer)
                progress = True
        if not progress:
            state = "; ".join(
                f"stage {s} at {cur(s).label(s) if cur(s) else 'end'} (action {ip[s]})"
                for s in range(pp)
            )
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


def check_lifecycle(steps, blocks, m: int, stage: int = 0, fp16: bool = True,
                    sharded: bool = False) -> None:
    """`steps`: this rank's successive step lists; a trailing list without compute is the flush.
    In fp32 (`fp16=False`) and unsharded a materialised view is the master itself, so it never
    goes stale. `sharded`: masters and moments are cut over the dp replicas (see the module)."""
    st = {b: _Block() for b in blocks}
    view_is_master = not fp16 and not sharded
    norm_step = None

    def fail(k, a, msg):
        raise ScheduleError(f"stage {stage}, step {k}, {a.label(stage)}: {msg}")

    for k, actions in enumerate(steps):
        is_step = any(isinstance(a, (Forward, Backward)) for a in actions)
        for x in st.values():
            x.bwd = 0
        for a in actions:
            for blk, e in expand(a, blocks):
                bs = [blk] if blk is not None else (
                    list(e.blocks) if isinstance(e, (SyncGrad, WaitGrad))
                    else [e.block] if hasattr(e, "block") else [])
                flag = {SyncGrad: "scatter", WaitGrad: "scatter", MaterializeView: "gather"}
                if type(e) in flag and getattr(e, flag[type(e)]) != sharded:
                    fail(k, e, f"{flag[type(e)]}={getattr(e, flag[type(e)])} on a stage whose "
                               f"optimizer state is {'' if sharded else 'not '}sharded")
                for b in bs:
                    if b not in st:
                        fail(k, e, f"block {b!r} is not on this stage")
                    x = st[b]
                    if isinstance(e, (Forward, Backward)):
                        if x.view is None:
                            fail(k, e, f"view of {b} not materialised")
                        if x.gathering:
                            fail(k, e, f"view of {b} used before its all-gather was waited for")
                        if x.view != x.master or x.pending is not None:
                            fail(k, e, f"view of {b} is stale (update pending or view made before it)")
                    if isinstance(e, Forward):
                        continue
                    if isinstance(e, Backward):
                        if x.grad != k:
                            fail(k, e, f"gradient of {b} not allocated for this step")
                        x.bwd += 1
                        if x.bwd == m:
                            x.pending = k
                    elif isinstance(e, MaterializeView):
                        if x.gathering:
                            fail(k, e, f"view of {b} made again while its all-gather is in flight")
                        x.view = x.master
                        x.gathering = e.gather
                    elif isinstance(e, WaitView):
                        if not x.gathering:
                            fail(k, e, f"wait for the view of {b} without an all-gather in flight")
                        x.gathering = False
                    elif isinstance(e, DropView):
                        if x.view is None:
                            fail(k, e, f"view of {b} dropped twice")
                        if x.gathering:
                            fail(k, e, f"view of {b} dropped while its all-gather is in flight")
                        x.view = None
                    elif isinstance(e, AllocGrad):
                        if x.grad is not None:
                            fail(k, e, f"gradient of {b} still held from step {x.grad}")
                        x.grad = k
                    elif isinstance(e, SyncGrad):
                        if x.pending != k or x.bwd != m:
                            fail(k, e, f"sync of {b} before its last backward")
                        if x.synced == k:
                            fail(k, e, f"{b} synced twice")
                        x.synced = k
                    elif isinstance(e, WaitGrad):
                        if x.synced != k or x.waited == k:
                            fail(k, e, f"wait of {b} without a sync in flight")
                        x.waited = k
                    elif isinstance(e, Update):
                        j = x.pending
                        if j is None:
                            fail(k, e, f"no gradient of {b} awaits an update")
                        if x.waited != j or norm_step != j:
                            fail(k, e, f"update of {b} before its sync wait and the step's norm")
                        if x.grad != j:
                            fail(k, e, f"update of {b} without its gradient")
                        x.master += 1
                        x.pending = None
                        if view_is_master and x.view is not None:
                            x.view = x.master
                    elif isinstance(e, FreeGrad):
                        if x.grad is None or x.pending is not None:
                            fail(k, e, f"gradient of {b} freed before its update")
                        x.grad = None
                if isinstance(e, GradNorm):
                    late = [b for b, x in st.items() if x.waited != k]
                    if late:
                        fail(k, e, f"global norm before the sync wait of {late}")
                    norm_step = k
        if is_step:
            for b, x in st.items():
                if x.bwd != m or x.waited != k:
                    raise ScheduleError(f"stage {stage}, step {k}: {b} not backwarded/synced")
            if norm_step != k:
                raise ScheduleError(f"stage {stage}, step {k}: no GradNorm")
    for b, x in st.items():
        if x.pending is not None or x.grad is not None:
            raise ScheduleError(f"stage {stage}: {b} left with a pending update or gradient")
        if x.gathering:
            raise ScheduleError(f"stage {stage}: {b} left with a view all-gather in flight")


def policy_steps(policy, info, steps: int = 3) -> list[tuple]:
    """The lists a rank runs for `steps` steps then a flush, as the executor would."""
    out, carry = [], False
    for _ in range(steps):
        out.append(policy.build_step(info, carry))
        carry = policy.carries(info)
    out.append(policy.build_flush(info))
    return out


def validate_policy(policy, infos, steps: int = 3) -> None:
    """All checks for one replica's stages (`infos[stage]`: StageInfo) over a few steps."""
    m = infos[0].num_micro_batches
    per_rank = [policy_steps(policy, info, steps) for info in infos]
    for k in range(steps):
        check_pipeline([r[k] for r in per_rank], m)
    simulate([[a for lst in r for a in lst] for r in per_rank])
    for info, r in zip(infos, per_rank):
        check_lifecycle(r, info.blocks, m, info.stage, info.fp16, info.sharded)


__all__ = [
    "ScheduleError",
    "check_lifecycle",
    "check_pipeline",
    "policy_steps",
    "simulate",
    "validate_policy",
]
