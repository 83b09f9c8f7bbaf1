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

A pass over the step (`lifecycle.passes`): `PartialSync` rewrites the policy's lists per phase
of its period and gives the validator, the memory model and the simulator their handlers of
its two actions; the executor's side, `Averager`, is `runtime.passes.partial`.

Not allowed (`PartialSync.check`): the optimizer state sharded over the replicas, whose
segments assume replicas that agree (partial synchronization turns `schedule.shard_optimizer`
off by itself where it is not set, `config.Config`; set true, it is refused); fp32 masters kept
in the memory tier (`offload.optimizer: masters`), which an average needs in the DDR next to
the block's update (just before it or just after it). With dp = 1 there is nothing to average
and partial is bitwise full.

    ps = PartialSync.of_sync(cfg.sync, blocks)       # None under sync.mode: full
    ps.blocks_at(step)                               # the blocks step `step` averages
    first, carried, flush = ps.rewrite(lists, info, phase, policy)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from ratrain.exec.spec import block_role
from ratrain.lifecycle.passes.base import Handlers, Pass
from ratrain.lifecycle.schedule import (
    Action,
    Backward,
    Forward,
    GradNorm,
    MaterializeView,
    SyncGrad,
    Update,
    WaitGrad,
)
from ratrain.lifecycle.validate import Extension, ScheduleError

NAME = "partial"
AVERAGE_BYTES_PER_PARAM = 8  # WaitAverage's division: read and write the fp32 master


@dataclass(frozen=True)
class AverageParams(Action):
    """Start the data-parallel sum of these blocks' fp32 masters (one collective per block, in
    place; DreamDDP's layer-wise parameter averaging): placed after the block's last backward,
    so it runs under the rest of the backward; `WaitAverage` completes the mean."""

    blocks: tuple[str, ...]
    group: ClassVar[str] = "lifecycle"
    word: ClassVar[str] = "avg"


@dataclass(frozen=True)
class WaitAverage(Action):
    """Wait for these blocks' parameter sums and divide them by dp (every replica then holds the
    same master), before the blocks' update."""

    blocks: tuple[str, ...]
    group: ClassVar[str] = "lifecycle"
    word: ClassVar[str] = "wait-avg"


@dataclass(frozen=True)
class PartialSync(Pass):
    """Which blocks each step averages: `phase[block]` = the step (mod `period`) in which the
    block is averaged; every block of the model has one. `after`: each average sits after the
    block's update instead of before it (`sync.average`)."""

    period: int  # steps in which every block is averaged once (`passes.period_of`)
    phase: Mapping[str, int]
    after: bool = False
    name: ClassVar[str] = NAME
    actions: ClassVar[tuple[type[Action], ...]] = (AverageParams, WaitAverage)
    legend: ClassVar[str] = ("avg L           start block L's parameter average (sync.mode "
                             "partial)   wait-avg L   its mean")

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

    def check(self, policy, stages, passes) -> None:
        """Refuse what partial synchronization cannot run with, in one line naming the keys."""
        if any(getattr(p, "state", None) == "masters" for p in passes):
            raise ValueError(
                "sync.mode=partial with offload.optimizer=masters cannot work: a block's average "
                "runs on its fp32 master next to its update, while the master lives in the tier; "
                "set offload.optimizer=moments (or off), or sync.mode=full")
        if stages[0].sharded:
            raise ValueError(
                f"sync.mode=partial with schedule.shard_optimizer=true (policy {policy.label} "
                f"shards the optimizer state over the parallel.dp={stages[0].shards} replicas) "
                "cannot work: "
                "the replicas' parameters differ between averages, so no replica can own a "
                "segment for all; leave schedule.shard_optimizer unset or false (or set "
                "sync.mode=full)")

    def rewrite(self, lists, info, phase, policy):
        """The policy's full-sync lists of stage `info` as phase `phase` of the period runs
        them (`partial_step`, `partial_flush`)."""
        first, carried, flush = lists
        mine = set(info.blocks)
        now, before = self.blocks_at(phase) & mine, self.blocks_at(phase - 1) & mine
        new_first = partial_step(first, now, after=self.after)
        new_carried = (partial_step(carried, now, before, self.after)
                       if policy.carries(info) else new_first)
        return new_first, new_carried, partial_flush(flush, now, self.after)

    def validator(self, life):
        return AverageCheck(life)

    def memory(self, walk):  # in place: no bytes
        return Handlers(dict.fromkeys(self.actions, lambda blk, e: None))

    def simulator(self, flat):
        return AverageItems(flat)

    def describe(self) -> str:
        return (f"partial sync (period {self.period}, averaged "
                f"{'after' if self.after else 'before'} the update)")


def of_config(cfg, blocks) -> PartialSync | None:
    """The pass `sync.mode: partial` asks for over every stage's `blocks` (None: full sync)."""
    return PartialSync.of_sync(cfg.sync, [b for names in blocks for b in names])


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


# -- the interpreters' handlers ----------------------------------------------------------------


class AverageCheck(Extension):
    """The validator's view of the averages (`lifecycle.validate`, see the module): there is no
    gradient sync (a block's gradient is final, and its own, at its last backward); an average
    starts between a block's last backward and its update, or after the update, once per
    update; it is waited for once; no forward, backward, view or update reads a master while it
    is being averaged, and a view made before the mean is stale."""

    def __init__(self, life):
        self.life = life
        self.averaging: dict[str, int] = {}  # block -> step whose average is in flight
        self.fresh: set[str] = set()  # updated since their last average

    def handlers(self) -> dict:
        return {SyncGrad: self._no_sync, WaitGrad: self._no_sync,
                AverageParams: self._average, WaitAverage: self._wait_average}

    def _no_sync(self, e, b, x):
        self.life.fail(e, "a gradient sync under partial synchronization")

    def before(self, blk, e) -> None:
        b = blk if blk is not None else getattr(e, "block", None)
        if b not in self.averaging:
            return
        if blk is not None and self.life.view_is_master:
            self.life.fail(e, f"master of {b} read while its average is in flight")
        if isinstance(e, MaterializeView):
            self.life.fail(e, f"view of {b} made from its master while its average is in flight")
        if isinstance(e, Update):
            self.life.fail(e, f"update of {b} while its average is in flight")

    def after(self, blk, e) -> None:
        life = self.life
        if isinstance(e, Backward) and life.st[blk].bwd == life.m:
            life.st[blk].waited = life.k  # its own gradient, final: nothing to sync
        if isinstance(e, Update):
            self.fresh.add(e.block)

    def _average(self, e, b, x):
        life = self.life
        # before the update: after the step's last backward; after it: once per update
        if not (x.pending == life.k and x.bwd == life.m or x.pending is None and b in self.fresh):
            life.fail(e, f"average of {b} neither between its last backward and its update "
                         "nor after its update")
        self.fresh.discard(b)
        if b in self.averaging:
            life.fail(e, f"{b} averaged while its previous average is in flight")
        self.averaging[b] = life.k

    def _wait_average(self, e, b, x):
        if self.averaging.pop(b, None) is None:
            self.life.fail(e, f"wait for the average of {b} without one in flight")
        x.master += 1  # the mean: a view made before it is stale
        if self.life.view_is_master and x.view is not None:
            x.view = x.master

    def end(self) -> None:
        for b in self.averaging:
            raise ScheduleError(f"stage {self.life.stage}: {b} left with its average in flight")


class AverageItems:
    """The averages as the simulator's items (`plan.events`): a block's sum is an engine
    collective of its fp32 master (`coll="average"`), its wait an engine wait, then the
    division by dp (part of the update's memory-bound work)."""

    def __init__(self, flat):
        self.flat = flat

    def handlers(self) -> dict:
        return {AverageParams: self._average, WaitAverage: self._wait}

    def _average(self, a):
        self.flat.add("sync", a, blocks=a.blocks, coll="average")

    def _wait(self, a):
        flat = self.flat
        flat.add("await", a, blocks=a.blocks)
        for b in a.blocks:
            flat.busy("update", flat.figure("average_time", block_role(b)), a)


__all__ = ["AVERAGE_BYTES_PER_PARAM", "AverageCheck", "AverageItems", "AverageParams", "NAME",
           "PartialSync", "WaitAverage", "of_config", "partial_flush", "partial_step"]
