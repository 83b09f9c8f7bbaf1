"""Partial synchronization for slow links (`sync.mode: partial`), after DreamDDP.

What DreamDDP does (Tang et al., "DreamDDP: Accelerating Data Parallel Distributed LLM Training
with Layer-wise Scheduled Partial Synchronization", arXiv 2502.11058; its code,
github.com/trl730109/DreamDDP): local SGD made finer. No gradient is synchronised: every replica
steps on its own gradients with its own optimizer. Each iteration averages the *parameters* of
only some layers across the replicas, so that every layer is averaged once every H iterations;
the average of a layer is an in-place all-reduce of its parameters started by a hook as soon as
the layer's backward has produced its gradient, so it runs while the backward of the layers
below it goes on, and it is waited for before the optimizer step, which then applies the local
gradient to the averaged parameters (no extra memory: nothing is copied). Adam's moments are
never averaged: each worker keeps its own (`exp_avg`, `exp_avg_sq` stay local in its
`transformer_dream_ddp`). Which layers an iteration averages is DreamDDP's schedule: in its
simplest form every layer once per H iterations; its profiled form places each layer's sync in
the iteration where it hides behind the remaining backward.

What ratrain does. Under `sync.mode: partial` a step has no `SyncGrad` / `WaitGrad`. DreamDDP's
placement (`sync.average: before-update`): `AverageParams(blocks)` takes the place of the gradient
sync the policy placed (so each policy keeps its placement: `layer` right after the block's last
backward, `bucket` per bucket, `end` after the stage's backward) for the blocks this step averages,
and `WaitAverage(block)` comes just before the block's update (in the next step's warm-up bubble
under a deferred update). That leaves every replica one local update away from the mean even at H =
1, so its next forward and backward run off it. Under `sync.average: after-update` (the default:
nearer full sync at the same speed, docs/BENCHMARKS.md) the average of a block starts right after
the block's update of the step that averages it and is waited for just before the block's next
forward (as a hook of that forward, so that under a deferred update the later blocks' averages run
under the earlier blocks' forward; an fp16 view of the block is made after the wait), or at the end
of the list when no forward follows (a policy that updates at the end of its step; the flush):
every replica then takes its next step from the same point, and with plain SGD at H = 1 that is
full sync. The average sums the block's fp32 master over the stage's data-parallel group with the
runtime's own all-reduce (`hier` across nodes; every replica gets the same bits) and divides by dp,
in place. AdamW's moments stay local; each replica's gradient is the mean over its own
micro-batches and is clipped by its own norm; a non-finite norm on any replica skips the step on
every replica (so loss scale and AdamW's step count stay common). Every block of the model is
averaged once every `sync.period` = H steps: block i (model order, embed first) in steps with step
mod H = i mod H (`assign: round-robin`). With pp > 1 each stage's group averages its own blocks. A
checkpoint holds each replica's own state (resume is bitwise) and, as its model, the replicas' mean
(`Executor.iter_full_state(mean=True)`), which eval, export and generate load.

Not allowed (`check_partial`): the optimizer state sharded over the replicas
(`schedule.shard_optimizer`, on by default under `ratrain`), whose segments assume replicas that
agree; fp32 masters kept in the memory tier (`offload.optimizer: masters`), which an average
needs in the DDR next to the block's update (just before it or just after it).
With dp = 1 there is nothing to average and partial is bitwise full.

    ps = PartialSync.of_sync(cfg.sync, blocks)       # None under sync.mode: full
    ps.blocks_at(step)                               # the blocks step `step` averages
    lists = phase_lists(policy, info, ps)            # per phase: (first, carried, flush)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ratrain.exec.optim import global_grad_norm
from ratrain.lifecycle.policies import policy_of
from ratrain.lifecycle.schedule import (
    Action,
    AverageParams,
    Backward,
    Forward,
    GradNorm,
    MaterializeView,
    SyncGrad,
    Update,
    WaitAverage,
    WaitGrad,
)

AVERAGE_BYTES_PER_PARAM = 8  # WaitAverage's division: read and write the fp32 master


@dataclass(frozen=True)
class PartialSync:
    """Which blocks each step averages: `phase[block]` = the step (mod `period`) in which the
    block is averaged; every block of the model has one. `after`: each average sits after the
    block's update instead of before it (`sync.average`)."""

    period: int
    phase: Mapping[str, int]
    after: bool = False

    def __post_init__(self):
        if self.period < 1:
            raise ValueError(f"sync.period={self.period} must be >= 1")
        bad = {b: p for b, p in self.phase.items() if not 0 <= p < self.period}
        if bad:
            raise ValueError(f"blocks assigned outside the period {self.period}: {bad}")

    @classmethod
    def round_robin(cls, blocks, period: int, after: bool = False) -> PartialSync:
        """Block i of `blocks` (the whole model in model order) in steps i mod period."""
        return cls(period, {b: i % period for i, b in enumerate(blocks)}, after)

    @classmethod
    def of_sync(cls, sync, blocks) -> PartialSync | None:
        """A config's `sync` section's assignment over `blocks` (every block of the model, in
        model order); None under `sync.mode: full`."""
        if not sync.partial:
            return None
        # sync.assign: round-robin
        return cls.round_robin(blocks, sync.period, sync.after_update)

    def blocks_at(self, step: int) -> frozenset[str]:
        """The blocks step `step` (0-based) averages."""
        return frozenset(b for b, p in self.phase.items() if p == step % self.period)


def check_partial(policy, dp: int, offload_state: str = "off") -> None:
    """Refuse what partial synchronization cannot run with, in one line naming the keys."""
    if offload_state == "masters":
        raise ValueError(
            "sync.mode=partial with offload.optimizer=masters cannot work: a block's average "
            "runs on its fp32 master next to its update, while the master lives in the tier; "
            "set offload.optimizer=moments (or off), or sync.mode=full")
    if policy.shards(dp) > 1:
        raise ValueError(
            f"sync.mode=partial with schedule.shard_optimizer (policy {policy.name} shards the "
            f"optimizer state over the parallel.dp={dp} replicas) cannot work: the replicas' "
            "parameters differ between averages, so no replica can own a segment for all; set "
            "schedule.shard_optimizer=false (or sync.mode=full)")


def check_config(cfg) -> None:
    """`check_partial` for a config's policy and layout (start-up, before any work)."""
    if cfg.sync.partial:
        check_partial(policy_of(cfg.schedule), cfg.parallel.dp, cfg.offload.optimizer)


# -- the step lists ----------------------------------------------------------------------------


def _averages(a: SyncGrad, now) -> list[Action]:
    """A policy's gradient sync, as the average of the blocks of it this step averages."""
    mine = tuple(b for b in a.blocks if b in now)
    return [AverageParams(mine)] if mine else []


def partial_step(actions, now, before=frozenset(), after: bool = False) -> tuple[Action, ...]:
    """A full-sync step list as partial synchronization runs it: every `SyncGrad` and
    `WaitGrad` goes. Updates before the step's `GradNorm` are the previous step's (a deferred
    update) and belong to the blocks it averaged, `before`; later ones to `now`, this step's.
    Before the update (`after` False, DreamDDP's placement): every `SyncGrad` becomes the
    `AverageParams` of its blocks in `now` (dropped when none) and each update of an averaged
    block waits for its average first. After it (`_after_update`): each such update is followed
    by its block's `AverageParams`, waited for just before the block's next forward in the list,
    or at the list's end."""
    if after:
        return _after_update(actions, now, before)
    out: list[Action] = []
    pending = set(before)
    for a in actions:
        if isinstance(a, Backward) and any(isinstance(h, SyncGrad) for _, h in a.post):
            post = tuple((b, x) for b, h in a.post
                         for x in (_averages(h, now) if isinstance(h, SyncGrad) else [h]))
            a = replace(a, post=post)
        if isinstance(a, SyncGrad):
            out += _averages(a, now)
            continue
        if isinstance(a, WaitGrad):
            continue
        if isinstance(a, GradNorm):
            pending = set(now)
        if isinstance(a, Update) and a.block in pending:
            out.append(WaitAverage((a.block,)))
            pending.discard(a.block)
        out.append(a)
    return tuple(out)


def _after_update(actions, now, before) -> tuple[Action, ...]:
    """`partial_step`'s after-update placement (see there). A working view made from an
    averaged master (fp16) moves with the wait: to just before the block's next forward."""
    out: list[Action] = []
    due, flying = set(before), []  # blocks whose update starts an average; averages in flight
    views: dict[str, Action] = {}  # the views of blocks in flight, made after their wait
    for a in actions:
        if isinstance(a, Backward):
            a = replace(a, post=tuple((b, h) for b, h in a.post if not isinstance(h, SyncGrad)))
        if isinstance(a, (SyncGrad, WaitGrad)):
            continue
        if isinstance(a, GradNorm):
            due = set(now)
        if isinstance(a, MaterializeView) and a.block in flying:
            views[a.block] = a
            continue
        if isinstance(a, Forward) and flying:  # each just before its block's part
            a = replace(a, pre=_settle(flying, views) + a.pre)
            flying = []
        out.append(a)
        if isinstance(a, Update) and a.block in due:
            out.append(AverageParams((a.block,)))
            flying.append(a.block)
            due.discard(a.block)
    return tuple(out) + tuple(h for _, h in _settle(flying, views))


def _settle(blocks, views) -> tuple:
    """(block, action) hooks: each block's `WaitAverage`, then its view if one was held."""
    return tuple(x for b in blocks for x in [(b, WaitAverage((b,))),
                                             *([(b, views.pop(b))] if b in views else [])])


def partial_flush(actions, last, after: bool = False) -> tuple[Action, ...]:
    """A flush (deferred updates of the last step) after a step that averaged `last`: each
    update of an averaged block waits for its average first, or (`after`) starts it, every
    average waited for at the end."""
    if after:
        return _after_update(actions, frozenset(), last)
    out: list[Action] = []
    for a in actions:
        if isinstance(a, Update) and a.block in last:
            out.append(WaitAverage((a.block,)))
        out.append(a)
    return tuple(out)


def phase_lists(policy, info, ps: PartialSync):
    """Per phase p of the period: (this stage's step list with nothing carried, after a step,
    the flush after a step of phase p), from the policy's own full-sync lists."""
    mine = set(info.blocks)
    out = []
    for p in range(ps.period):
        now = ps.blocks_at(p) & mine
        before = ps.blocks_at(p - 1) & mine
        first = partial_step(policy.build_step(info), now, after=ps.after)
        carried = (partial_step(policy.build_step(info, True), now, before, ps.after)
                   if policy.carries(info) else first)
        out.append((first, carried, partial_flush(policy.build_flush(info), now, ps.after)))
    return tuple(out)


# -- running it ----------------------------------------------------------------------------------


class Averager:
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

    def start(self, a: AverageParams) -> None:
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

    def local_sq(self, blocks, kernels, xp) -> dict:
        """Each block's sum of squares of this replica's whole (unsynchronised) gradient."""
        return {b: kernels.grad_norm(self.state.grad_flat(b), xp) for b in blocks}


def replica_norms(facts, vec, loss_scale: float) -> list[float]:
    """Every replica's own gradient norm from the step's facts (each replica's whole-block sums
    of squares in its column of `facts`), added in global block order as the full norm is."""
    return [global_grad_norm(facts.replica_sq(vec, r), loss_scale) for r in range(facts.dp)]


__all__ = ["AVERAGE_BYTES_PER_PARAM", "Averager", "PartialSync", "check_config", "check_partial",
           "partial_flush", "partial_step", "phase_lists", "replica_norms"]
