"""Partial synchronization's plain reference: the replicas of a config one after another in one
process, each a dp = 1 rank stepping on its own share of the batch. Under `sync.average:
before-update` (DreamDDP's placement) a block averaged at step s gets the replicas' masters of
the step's start summed in the runtime's order (`comm.algos.reference`, hier) and divided by dp,
before the step's update; under `after-update` each block of the step is averaged so after the
step's update instead, so that every replica starts the next step from the same point (with
plain SGD and H = 1, full synchronization exactly). Each step is flushed (policies differ in
when, never in what). The runtime is bitwise this (tests/test_partial_mpi.py); `benchmarks/
psync.py curves` trains with it.

    reps = Replicas(cfg)                           # cfg.parallel.dp ranks, one process
    results = reps.step(step, [batch_of_replica_0, ...])
    reps.mean_master()                             # the replicas' mean (a checkpoint's model)
    reps.close()
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace

from ratrain.comm.algos import reference
from ratrain.runtime.passes import Averager
from ratrain.runtime.rank import build_rank


def _mean(bufs):
    """The replicas' `bufs` summed in the runtime's order (hier), divided by their number."""
    return reference(bufs, "hier") / len(bufs)


class SumsEngine:
    """A stand-in engine: each block's all-reduce leaves the sum set for its master's address
    before the step (`Replicas.step`)."""

    def __init__(self):
        self.sums: dict[int, object] = {}  # master slice's address -> its sum

    def allreduce(self, buf, comm):
        buf[...] = self.sums[buf.ctypes.data]
        fut: Future = Future()
        fut.set_result(None)
        return fut


class Replicas:
    """`cfg`'s data-parallel replicas in one process (see the module)."""

    def __init__(self, cfg):
        dp = cfg.parallel.dp
        after_update = cfg.sync.after_update
        one = replace(cfg, parallel=replace(cfg.parallel, dp=1))
        self.ranks = [build_rank(one, None) for _ in range(dp)]
        self.executors = [r.executor for r in self.ranks]
        self.engine = SumsEngine()
        self.after_update = after_update
        for ex in self.executors:  # after the update: the step's own averages do nothing
            ex.runners["partial"] = Averager.of_executor(ex, None)
            ex.runners["partial"].dp = 1 if after_update else dp
            ex.runners["partial"].engine = self.engine
            ex.handlers = ex._dispatch_table()  # the table holds the new runner's handlers

    def step(self, step: int, batches) -> list:
        """Every replica's `StepResult` of step `step`, replica r on `batches[r]`."""
        exs = self.executors
        now = exs[0].plan.pass_named("partial").blocks_at(step)
        self.engine.sums.clear()
        for b in () if self.after_update else now:
            total = reference([ex.state.master_flat(b) for ex in exs], "hier")
            self.engine.sums.update({ex.state.master_flat(b).ctypes.data: total for ex in exs})
        out = []
        for ex, batch in zip(exs, batches):
            out.append(ex.run_step(step, batch))
            ex.flush()  # a deferred update now: the next step starts from its masters
        for b in now if self.after_update else ():
            mean = _mean([ex.state.master_flat(b) for ex in exs])
            for ex in exs:
                ex.state.master_flat(b)[...] = mean
        return out

    def mean_master(self):
        """The replicas' whole masters summed in the runtime's order, divided by dp."""
        return _mean([ex.state.master_buf for ex in self.executors])

    def close(self) -> None:
        for r in self.ranks:
            r.close()
