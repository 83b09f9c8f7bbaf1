"""The survivors of a lost rank: who is lost, where training stands, and the smaller job.

`recover` runs on every survivor once `RankLost` has reached its training loop
(`ratrain.job.faults`). The steps:

1. Revoke every communicator (the ranks still waiting in one learn of the loss), abandon the
   old rank's engine and watchdog without their collective ends, and shrink the job's
   communicator to the survivors (ULFM's `Shrink`).
2. Agree on where training stands. A step's updates follow its global facts (the `GradNorm`
   all-reduce), and no rank can finish that all-reduce before every live rank has put its
   gradients in. So the last step whose facts any survivor holds (`committed`) is one every
   survivor can finish: one that missed the facts takes them from one that has them, and
   each applies the updates it had not yet applied (`Executor.settle`). The next step is
   the one redone.
3. The new layout: each data-parallel replica that lost a rank is dropped; the job goes on as
   pp x (dp - k) with the same global batch, its micro-batches shared over the replicas left
   (`new_parallel`). Where no replica is left whole, training cannot go on here: every
   survivor exits with the requeue code, and the last checkpoint is intact.
4. The state: each new rank gets its part of its stage's master and moments from the
   survivors (`reshard`), the lost replica's segment of a sharded state from the copy its
   stage's next replica keeps (`runtime.passes.mirror`). Without such a copy (`elastic.copies`
   off, or the copy lost too), the new ranks resume from the last checkpoint instead.
5. The survivors of dropped replicas send what they hold, then leave (exit 0). The others build
   the new job on a communicator of their own and go on from the redone step; what happened
   goes to metrics.jsonl, status.json and the log (`Event`).

Another loss during all this starts it again on the survivors of the survivors.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field, replace

from mpi4py import MPI

from ratrain.comm.topology import coords, grid
from ratrain.config import Config
from ratrain.exec.params import segment_bounds
from ratrain.job import faults
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.elastic import reshard


@dataclass(frozen=True)
class Survivor:
    """What a survivor tells the others after the shrink."""

    rank: int  # in the shrunk communicator
    old: int  # in the communicator before it
    origin: int  # in the job's first world (MPI.COMM_WORLD)
    stage: int
    replica: int
    facts_step: int  # the step of the last global facts it holds (-1: none)
    held: dict  # block -> (lo, hi) of its own state
    mirror: int | None = None  # the replica whose segment it keeps a copy of (sharded)
    mirror_held: dict = field(default_factory=dict)


@dataclass
class Event:
    """A recovery, as metrics.jsonl, status.json and the log record it."""

    lost: list  # the lost ranks, numbered as in the job's first world
    step: int  # the step redone (numbered from 1, as in metrics)
    detected_at: float  # wall-clock time the loss was first seen on this rank
    recovered_at: float = 0.0  # ... the new job was ready
    layout: str = ""
    how: str = "shrink"  # shrink | checkpoint (the lost state came from the last checkpoint)
    overrides: list = field(default_factory=list)  # --set lines of the new layout

    def record(self) -> dict:
        return {"event": "rank_lost", "lost_ranks": self.lost, "step_redone": self.step,
                "detect_to_ready_s": round(self.recovered_at - self.detected_at, 3),
                "layout": self.layout, "state_from": self.how, "overrides": self.overrides,
                "time": round(self.recovered_at, 3)}


def new_parallel(par, kept: list[int]):
    """`par` (the `parallel` section) with the replicas `kept` only and the same global batch:
    the micro-batches of every old replica shared over them, evenly, the first ones taking one
    more where they do not divide."""
    total = sum(par.shares)
    n = len(kept)
    base, extra = divmod(total, n)
    shares = [base + (1 if i < extra else 0) for i in range(n)]
    if extra == 0:
        return replace(par, dp=n, num_micro_batches=base, replica_shares=None)
    return replace(par, dp=n, num_micro_batches=base, replica_shares=tuple(shares))


def overrides_of(par) -> list[str]:
    """The `--set` lines that launch a job of `par`'s layout (the event names them, so that a
    run resumed on the same layout can be started by hand)."""
    out = [f"parallel.dp={par.dp}", f"parallel.num_micro_batches={par.num_micro_batches}"]
    if par.replica_shares:
        out.append("parallel.replica_shares=" + ",".join(map(str, par.replica_shares)))
    return out


def _old_layout(cfg: Config, rank: int):
    p = cfg.parallel
    return coords(rank, p.pp, p.dp, p.placement)


def shrink(comm):
    """The survivors' communicator of `comm` (collective over the survivors; a revoked `comm`
    is fine), returning its errors."""
    return faults.returning(comm.Shrink())


def tell(shrunk, cfg: Config, old_rank: int, origin: int, executor, mirror) -> list[Survivor]:
    """Every survivor's `Survivor` (collective over `shrunk`)."""
    stage, replica = _old_layout(cfg, old_rank)
    state = executor.state
    held = {b: state.segment(b) for b in state.block_names}
    seen = executor.facts_seen
    mine = Survivor(shrunk.Get_rank(), old_rank, origin, stage, replica,
                    seen[0] if seen is not None else -1, held,
                    mirror.replica if mirror is not None else None,
                    {b: mirror.state.segment(b) for b in mirror.state.block_names}
                    if mirror is not None else {})
    return shrunk.allgather(mine)


@dataclass
class Decision:
    """What the survivors agreed (the same on every one)."""

    failed: list  # old ranks lost
    kept: list  # old replicas kept, in order (their new numbers are their indices)
    cfg: Config | None  # the new layout's config (None: no replica is whole)
    committed: int  # the last step whose updates hold (0-based; -1: none)
    new_rank: dict  # shrunk rank -> rank in the new job (absent: it leaves)


def decide(cfg: Config, old_size: int, infos: list[Survivor]) -> Decision:
    """The new job from what every survivor told (a pure function: every survivor decides the
    same)."""
    p = cfg.parallel
    alive = {i.old for i in infos}
    failed = sorted(set(range(old_size)) - alive)
    lost = {_old_layout(cfg, r)[1] for r in failed}
    kept = [q for q in range(p.dp) if q not in lost]
    committed = max(i.facts_step for i in infos)
    if not kept:
        return Decision(failed, [], None, committed, {})
    par = new_parallel(p, kept)
    new_cfg = replace(cfg, parallel=par)
    g = grid(par.pp, par.dp, par.placement)  # (replica, stage) -> new rank
    new_rank = {i.rank: int(g[kept.index(i.replica), i.stage]) for i in infos
                if i.replica in kept}
    return Decision(failed, kept, new_cfg, committed, new_rank)


def sources_of(infos: list[Survivor], stage: int) -> list[reshard.Held]:
    """The survivors that hold stage `stage`'s state: each with its own part, then the peer
    copies they keep (taken only for what no own part holds)."""
    own = [reshard.Held(i.rank, i.held) for i in infos if i.stage == stage]
    copies = [reshard.Held(i.rank, i.mirror_held, copy=True) for i in infos
              if i.stage == stage and i.mirror is not None]
    return own + copies


def dests_of(decision: Decision, infos: list[Survivor], sizes: dict, stage: int
             ) -> list[reshard.Held]:
    """Every new rank of stage `stage` with the ranges its new state holds (whole blocks, or
    its new segment of each when the new plan shards)."""
    cfg = decision.cfg
    shards = PipelinePlan.from_config(cfg, validate=False).shards
    out = []
    for i in infos:
        if i.rank not in decision.new_rank or i.stage != stage:
            continue
        q = decision.kept.index(i.replica)
        out.append(reshard.Held(i.rank, {b: segment_bounds(n, q, shards) if shards > 1
                                         else (0, n) for b, n in sizes.items()}))
    return out


def identity() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def wall() -> float:
    return time.time()


__all__ = ["Decision", "Event", "Survivor", "decide", "dests_of", "new_parallel",
           "overrides_of", "shrink", "sources_of", "tell"]

_ = MPI  # the module runs under MPI: its communicators are MPI's
