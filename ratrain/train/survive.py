"""Elastic mode's training loop: the trainer run again, smaller, each time a rank is lost.

`run(setup, comm, ctl, timeout)` runs the `Trainer`; when a lost peer reaches its loop
(`job.faults.RankLost`) every survivor runs `survive` (the steps are `elastic.recover`'s):
revoke, shrink, agree where training stands and finish that step's updates, decide the new
layout, move the state in memory (`elastic.reshard`), and build the new job's `Trainer` on a
communicator of the kept ranks, which goes on from the redone step. Ranks of dropped replicas
leave (exit 0); where no replica is left whole every survivor exits with the requeue code, the
last checkpoint intact.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace

from mpi4py import MPI

from ratrain.checkpoint import checkpoint_root, read_manifest
from ratrain.checkpoint.stage import newest_committed
from ratrain.comm.topology import coords
from ratrain.elastic import recover as rec
from ratrain.elastic import reshard
from ratrain.exec.params import segment_bounds
from ratrain.exec.spec import block_params, block_role, stage_blocks
from ratrain.job import faults
from ratrain.job.control import Control
from ratrain.job.runctl import EXIT_OK, EXIT_STOPPED, write_status
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.train.startup import Setup
from ratrain.train.trainer import Trainer

ATTEMPTS = 8  # losses during one recovery before the survivors give up (requeue)
ARGS: list[str] = []  # the training command's arguments (a spawned process is started so)


@dataclass
class Peers:
    """The new job's start, from the survivors (`Trainer(peers=...)`): its first step (0-based,
    the one redone), the executor's and the data's state, the loader of each rank's part of
    its stage's state, the event to record, and a checkpoint to write first (its save was cut
    off by the loss), if any."""

    step: int
    state: dict
    load: object  # load(StageState)
    event: rec.Event
    save: int | None = None


def run(setup, comm, ctl, timeout: float) -> int:
    """Train; survive each lost rank (see the module). The exit code."""
    return _loop(Trainer(setup, comm, ctl), setup, ctl, MPI.COMM_WORLD.Get_rank(), timeout)


def _loop(trainer, setup, ctl, origin: int, timeout: float) -> int:
    while True:
        try:
            return trainer.run()
        except Exception as e:
            if not faults.lost(e):
                raise
        nxt = survive(trainer, setup, ctl, origin, timeout)
        if isinstance(nxt, int):
            return nxt
        setup, ctl, trainer = nxt


def _sizes(cfg, stage: int) -> dict:
    p = cfg.parallel
    return {b.name: block_params(cfg.model, block_role(b.name))
            for b in stage_blocks(cfg.model, p.pp, stage, p.stage_layers())}


def survive(trainer, setup, ctl, origin: int, timeout: float):
    """One recovery on this survivor (see `elastic.recover`): the new job's (setup, control,
    trainer), or an exit code (this rank leaves, or nobody can go on)."""
    detected = faults.seen_at() or time.time()
    faults.note_loss()
    faults.revoke_all()
    trainer.abandon()
    mirror = trainer.executor.runners.get("mirror")
    old, old_rank = ctl.comm, ctl.rank
    last = [old]  # the last survivors' communicator: another loss shrinks it again
    for _ in range(ATTEMPTS):
        try:
            return _recover(trainer, setup, old, old_rank, last, origin, detected, mirror,
                            timeout)
        except Exception as e:
            if not faults.lost(e):
                raise
            faults.revoke_all()
    print(f"[rank {origin}] error: ranks kept failing during the recovery; exiting with the "
          f"requeue code {EXIT_STOPPED}", file=sys.stderr, flush=True)
    return EXIT_STOPPED


def _recover(trainer, setup, old, old_rank, last, origin, detected, mirror, timeout):
    cfg, ex = trainer.cfg, trainer.executor
    shrunk = last[0] = rec.shrink(last[0])
    faults.unwatch_all()
    faults.watch([shrunk])
    me = shrunk.Get_rank()
    infos = rec.tell(shrunk, cfg, old_rank, origin, ex, mirror)
    dec = rec.decide(cfg, old.Get_size(), infos)
    lost = sorted(i for i in set(range(old.Get_size())) - {s.old for s in infos})
    origins = _origins(old, lost)
    if dec.committed >= 0:  # every survivor finishes the committed step's updates
        holder = min(i.rank for i in infos if i.facts_step == dec.committed)
        vec = shrunk.bcast(ex.facts_seen[1] if me == holder else None, root=holder)
        ex.settle(dec.committed, vec)
    if cfg.elastic.respawn:  # new processes in the lost ranks' places, where they can start
        nxt = _respawn(trainer, setup, shrunk, infos, dec, origins, detected, mirror, timeout)
        if nxt is not None:
            return nxt
    if dec.cfg is None:
        if me == 0:
            print(f"ratrain: lost rank(s) {origins}: no data-parallel replica is whole, so "
                  f"training cannot go on here; exiting with the requeue code {EXIT_STOPPED} "
                  "(the last checkpoint is intact)", file=sys.stderr, flush=True)
            write_status(cfg.run.dir, dec.committed + 1, EXIT_STOPPED,
                         f"lost rank(s) {origins} and no replica whole")
        return EXIT_STOPPED
    how, moves = "peers", []
    try:
        for s in range(cfg.parallel.pp):
            sizes = _sizes(cfg, s)
            moves += reshard.transfers(sizes, rec.sources_of(infos, s),
                                       rec.dests_of(dec, infos, sizes, s))
    except ValueError:  # a lost segment without its copy: the last checkpoint instead
        how, moves = "checkpoint", []
    held = _held(trainer, mirror)
    sends = reshard.post_sends(shrunk, me, moves, held)
    new_rank = dec.new_rank.get(me)
    new = shrunk.Split(0 if new_rank is not None else MPI.UNDEFINED,
                       new_rank if new_rank is not None else 0)
    if new_rank is None:  # a survivor of a dropped replica: what it held is sent; it leaves
        reshard.wait(sends)
        print(f"[rank {origin}] ratrain: this rank's replica lost a rank; it leaves the job "
              "(the others go on)", flush=True)
        return EXIT_OK
    new = faults.returning(new)
    ctl2 = _control(new, timeout)
    step = dec.committed + 1
    resume = None
    if how == "checkpoint":
        resume = newest_committed(checkpoint_root(cfg.checkpoint, cfg.run.dir))
        if resume is None:
            print(f"[rank {origin}] error: a lost optimizer segment has no copy "
                  "(elastic.copies off, or its keeper lost too) and no checkpoint was written "
                  f"yet: nothing to go on from; exiting with the requeue code {EXIT_STOPPED}",
                  file=sys.stderr, flush=True)
            return EXIT_STOPPED
        step = read_manifest(resume)["step"]  # the steps after it are redone
    event = rec.Event(origins, step + 1, detected, layout=_layout(dec.cfg),
                      how="the last checkpoint" if how == "checkpoint" else "peers",
                      overrides=rec.overrides_of(dec.cfg.parallel))
    peers = Peers(step, _state_of(trainer, step),
                  lambda state: reshard.receive(shrunk, me, moves, state, held), event,
                  save=trainer.saving if how == "peers" else None)
    return _start(setup, dec.cfg, resume, new, ctl2, peers, sends)


def _held(trainer, mirror) -> dict:
    """What this survivor can send (`reshard.post_sends`): its own state's parts (False) and
    the peer copies it keeps (True; None without the mirror pass)."""
    return {False: trainer.executor.state, True: mirror.state if mirror is not None else None}


def _control(new, timeout: float):
    """The new job's control plane on `new`; its communicators watched for the next loss."""
    ctl = Control.for_job(new, timeout)
    faults.unwatch_all()
    faults.watch([ctl.comm, new])
    return ctl


def _start(setup, cfg, resume, new, ctl, peers, sends):
    """The new job's (setup, control, trainer) on `new`, starting from `peers`; this rank's
    parts for the others (`sends`) are waited for whatever happens."""
    new_setup = replace(setup, cfg=cfg, resume=resume)
    try:
        trainer = Trainer(new_setup, new, ctl, peers=peers)
    finally:
        reshard.wait(sends)
    return new_setup, ctl, trainer


def _state_of(trainer, step: int) -> dict:
    """The executor's and the data's state after the settled step (the same on every
    survivor)."""
    return {"executor": trainer.executor.state_dict(), "data": trainer.train_ds.state_dict(step)}


def _respawn(trainer, setup, shrunk, infos, dec, origins, detected, mirror, timeout):
    """Spawn a process in each lost rank's place and go on in the original layout (see the
    module); None when no process can be started there (the survivors then shrink)."""
    cfg, me = trainer.cfg, shrunk.Get_rank()
    try:
        inter = shrunk.Spawn(sys.executable, args=["-m", "ratrain.train", *ARGS],
                             maxprocs=len(dec.failed), root=0)
    except MPI.Exception as e:
        if me == 0:
            print(f"ratrain: elastic.respawn: no process could be spawned ({e}); the "
                  "survivors shrink instead", file=sys.stderr, flush=True)
        return None
    merged = faults.returning(inter.Merge(high=False))  # survivors first, then the new ones
    size = shrunk.Get_size()
    new_rank = {i.rank: i.old for i in infos}
    new_rank.update({size + j: r for j, r in enumerate(dec.failed)})
    step, how, resume, moves = dec.committed + 1, "peers", None, []
    p = cfg.parallel
    try:
        shards = PipelinePlan.from_config(cfg, validate=False).shards
        for s in range(p.pp):
            sizes = _sizes(cfg, s)
            dests = [reshard.Held(m, {b: segment_bounds(n, q, shards) if shards > 1 else (0, n)
                                      for b, n in sizes.items()})
                     for m, r in new_rank.items()
                     for st, q in [coords(r, p.pp, p.dp, p.placement)] if st == s]
            moves += reshard.transfers(sizes, rec.sources_of(infos, s), dests)
    except ValueError:  # a lost segment without its copy: the last checkpoint instead
        how, moves = "checkpoint", []
        resume = newest_committed(checkpoint_root(cfg.checkpoint, cfg.run.dir))
        step = read_manifest(resume)["step"] if resume else step
    event = rec.Event(origins, step + 1, detected, layout=_layout(cfg) + ", respawned",
                      how="the last checkpoint" if how == "checkpoint" else "peers",
                      overrides=[])
    pack = {"cfg": cfg, "data_paths": setup.data_paths, "classes": setup.classes,
            "moves": moves, "new_rank": new_rank, "step": step, "event": event,
            "state": _state_of(trainer, step), "resume": resume, "timeout": timeout}
    merged.bcast(pack if me == 0 else None, root=0)
    held = _held(trainer, mirror)
    sends = reshard.post_sends(merged, me, moves, held)
    return _join_new(merged, me, pack, setup, held, sends)


def _join_new(merged, me, pack, setup, held, sends):
    """Build this rank of the respawned job (a survivor or a new process): its communicator,
    control plane and trainer, its state received from `pack`'s moves over `merged`."""
    new = faults.returning(merged.Split(0, pack["new_rank"][me]))
    ctl = _control(new, pack["timeout"])
    moves = pack["moves"]
    peers = Peers(pack["step"], pack["state"],
                  lambda state: reshard.receive(merged, me, moves, state, held), pack["event"])
    return _start(setup, pack["cfg"], pack["resume"], new, ctl, peers, sends)


def join(parent, timeout: float) -> int:
    """A process spawned in a lost rank's place (`elastic.respawn`): join the survivors, take
    the place and the state they give it, and train on as one of them (see `run`)."""
    faults.note_loss()  # it joins a job that lost ranks: it ends as they do (`faults.finalize`)
    merged = faults.returning(parent.Merge(high=True))
    faults.watch([merged])
    pack = merged.bcast(None, root=0)
    setup = Setup(cfg=pack["cfg"], data_paths=pack["data_paths"], resume=None,
                  classes=pack["classes"])
    setup, ctl, trainer = _join_new(merged, merged.Get_rank(), pack, setup, None, [])
    return _loop(trainer, setup, ctl, MPI.COMM_WORLD.Get_rank(), timeout)


def _origins(comm, ranks) -> list[int]:
    """`comm`'s ranks `ranks` as the job's first world numbers them."""
    if not ranks:
        return []
    out = comm.Get_group().Translate_ranks(list(ranks), MPI.COMM_WORLD.Get_group())
    return [int(r) for r in out]


def _layout(cfg) -> str:
    p = cfg.parallel
    shares = f", shares {list(p.replica_shares)}" if p.replica_shares else ""
    return f"pp {p.pp} x dp {p.dp} ({p.num_micro_batches} micro-batches a replica{shares})"


__all__ = ["Peers", "run", "survive"]
