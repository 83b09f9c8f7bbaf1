"""Partial synchronization's runner (`sync.mode: partial`; the pass: `lifecycle.passes.partial`).

`Averager` starts each block's parameter sum in the communication engine (`AverageParams`),
completes the mean before the block's update (`WaitAverage`), and makes the step's gradients
each replica's own: its backward is seeded with its own micro-batches, its norm's partials are
its whole local gradients, and each replica clips by its own norm, the mean of them reported.
"""

from __future__ import annotations

import math
import time

from ratrain.exec.optim import global_grad_norm
from ratrain.lifecycle.passes.partial import (
    AVERAGE_BYTES_PER_PARAM,
    AverageParams,
    WaitAverage,
)
from ratrain.runtime.passes.base import Runner


class Averager(Runner):
    """The executor's side of partial synchronization: starts each block's parameter sum in the
    communication engine (`AverageParams`), completes the mean before the block's update
    (`WaitAverage`), and takes each replica's own gradient norm at `GradNorm`.

    `engine`, `comm`: the engine and the stage's data-parallel communicator (None at dp = 1:
    nothing to average); `pace(nbytes)`: the executor's memory pacing; `event(name, t0, fut)`:
    its communication timeline."""

    def __init__(self, state, dp: int, engine=None, comm=None, pace=None, event=None):
        self.state, self.dp, self.engine, self.comm = state, dp, engine, comm
        self.pace, self.event = pace, event
        self.futures: dict = {}  # block -> its sum in flight

    @classmethod
    def of_executor(cls, ex, p, resource=None) -> Averager:
        """The averager of executor `ex` (the pass `p` holds nothing it needs at run time)."""
        self = cls(ex.state, ex.dp, ex.engine, ex.topo.dp_comm if ex.dp > 1 else None,
                   ex._pace_memory, ex._comm_event)
        self.blocks, self.replica = list(ex.blocks), ex.replica
        self.num_micro_batches = ex.num_micro_batches
        self.kernels, self.xp = ex.ctx.kernels, ex.ctx.xp
        return self

    def average(self, a: AverageParams) -> None:
        if self.dp == 1:
            return
        for b in a.blocks:  # one collective per block, in place on the master
            t0 = time.perf_counter()
            fut = self.engine.allreduce(self.state.master_flat(b), self.comm)
            if self.event is not None:
                self.event(AverageParams((b,)).name(), t0, fut)
            self.futures[b] = fut

    def wait(self, a: WaitAverage) -> None:
        if self.dp == 1:
            return
        for b in a.blocks:
            self.futures.pop(b).result()
            master = self.state.master_flat(b)
            with self.pace(AVERAGE_BYTES_PER_PARAM * master.size):
                master /= self.dp  # the mean: the same bits on every replica

    def handlers(self) -> dict:
        return {AverageParams: self.average, WaitAverage: self.wait}

    def seed_count(self, n: int) -> int:
        return self.num_micro_batches  # the mean over this replica's micro-batches

    def norm_partials(self, sq: dict) -> dict:
        """Each block's sum of squares of this replica's whole (unsynchronised) gradient."""
        return {b: self.kernels.grad_norm(self.state.grad_flat(b), self.xp) for b in self.blocks}

    def step_norm(self, facts, vec, scale: float, norms: tuple) -> tuple:
        """Each replica clips by its own norm; any non-finite one skips every replica."""
        norms = replica_norms(facts, vec, scale)
        return norms[self.replica], sum(norms) / len(norms), all(map(math.isfinite, norms))


def replica_norms(facts, vec, loss_scale: float) -> list[float]:
    """Every replica's own gradient norm from the step's facts (each replica's whole-block sums
    of squares in its column of `facts`), added in global block order as the full norm is."""
    return [global_grad_norm(facts.replica_sq(vec, r), loss_scale) for r in range(facts.dp)]


__all__ = ["Averager", "replica_norms"]
