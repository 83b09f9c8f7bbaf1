"""The executor: runs one rank's action list, step after step, and records its timeline (the
current step; with `run.trace` every step up to `run.trace_bytes`: `runtime.trace.Timeline`).

It decides nothing: its lists come from the `PipelinePlan` it is handed (`lifecycle.pipeline`),
its recompute choice from `set_recompute` (`runtime.rank.build_rank` measures and chooses it
as an explicit step); no collective runs in its constructor.

    rank = build_rank(cfg, comm)                       # runtime.rank: the usual way to get one
    res = rank.executor.run_step(step, (inputs, targets))  # (M, B, T) int64 each, or None
    res.loss, res.grad_norm, res.skipped ...           # known on every rank
    ex.flush()            # finish deferred lifecycle work: before a checkpoint, eval, the end
    ex.write_trace("trace.json")                       # collective: every rank calls
    for block, st in ex.iter_full_state(): ...  # whole fp32 master/m/v per block (collective over dp)
    ex.load_full_block(block, st)               # the inverse: keep this replica's segment (local)

Actions go through one `{type: handler}` table. Compute runs on this (the main) thread; every
message and collective goes through the communication engine (`ratrain.comm`): receives are
posted early (`Mailbox`), sends and gradient syncs are futures waited on only when their result
is needed. With pp = dp = 1 there is no communication at all and `engine` may be None (no MPI).

Numerics are the same under every policy: each block's gradient is summed across replicas by its
own ring collective (`SyncGrad` of a bucket submits one per block; an all-reduce, or under
`ratrain` with dp > 1 a reduce-scatter, whose segment q is reduced in exactly the all-reduce's
order), the global facts (`GradNorm`) are one exact all-reduce (`runtime.facts`), after
which every rank takes the same clip coefficient and the same skip decision, and updates its
blocks (or its segments of them) with the same elementwise AdamW.

Sharded optimizer state (`ratrain`, dp > 1, `schedule.shard_optimizer`): the `StageState` it is
given holds this replica's segments (`build_rank` builds it sharded; `runtime.rank.shard_state`
cuts a whole one); replica q
keeps segment q of each block's master, m and v, updates it from its reduce-scattered gradient
segment, and the next step's view is cast from the own master segment and ring all-gathered in
the engine (`MaterializeView(gather=True)`), waited for before the block's first forward
(`WaitView`). Whole blocks for checkpoints: `runtime.fullstate`.

Passes over the step (`lifecycle.passes`): each pass the plan holds has a runner here
(`runtime.passes`), made once, whose handlers join the table and which may change how the step
treats gradients. Partial synchronization's (`runtime.passes.partial.Averager`) averages some
blocks' masters each step (by its phase), seeds each replica's backward with its own
micro-batches and makes its norm its own (`GradNorm`); `iter_full_state(mean=True)` gives the
replicas' mean model (checkpoints). Offload's (`runtime.passes.offload.Offloader`) moves bytes
to and from the rank's memory tier.

Loss scaling: `head_backward` is seeded with loss_scale / (micro-batches of the global batch:
num_micro_batches * dp, or the sum of `parallel.replica_shares` when replicas take unequal
shares, each running its own plan of its own micro-batch count), gradients are summed over
replicas, the norm is taken on unscaled gradients, a non-finite norm skips the
step on every rank (fp32 too) and halves the scale in fp16.

Memory: activations are tracked in the ledger per micro-batch and block
(`activations.mb<i>.<block>`), received activations under `activations.mb<i>.input`,
gradient messages under `comm.*`. `recompute: auto` (`runtime.measure.fit_rank_recompute`) measures each choice's cache on this rank's
first layer (`runtime.measure`), then plays the action lists through `lifecycle.memory` to
pick the fewest layers to recompute that fit the DDR cap.

Pacing (platform.emulate): each block's compute is padded to its flops (`exec.spec.block_flops`)
at the platform's rate, each update and view cast to the bytes it moves at its DDR bandwidth.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np

from ratrain.device import HostStaging, host_floats, is_host, to_device
from ratrain.exec.optim import (
    ADAMW_BYTES_PER_PARAM,
    AdamW,
    LossScaler,
    global_grad_norm,
    grad_scale_for,
    lr_at,
)
from ratrain.exec.params import STATE_BUFFERS, segment_bounds, view_cast_bytes_per_param
from ratrain.exec.spec import OFFLOAD, kernel_recompute
from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.passes import offload
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.lifecycle.schedule import dispatch_table, event_name
from ratrain.runtime import fullstate, trace
from ratrain.runtime.compute import StageCompute
from ratrain.runtime.facts import FactsLayout
from ratrain.runtime.mailbox import Mailbox
from ratrain.runtime.passes import runners_for
from ratrain.runtime.staged import StagedEngine
from ratrain.shim.allocator import resident_bytes


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float  # mean token loss over micro-batches and replicas (every rank knows it)
    grad_norm: float  # global norm of the unscaled gradients (non-finite: overflow); partial
    # synchronization: the mean of the replicas' own norms
    lr: float
    loss_scale: float  # the scale this step's backward used
    skipped: bool  # no update (non-finite gradients), the same on every rank
    peak_ddr_bytes: int  # the largest ledger peak over ranks during the step
    local_peak_ddr_bytes: int  # this rank's
    step_time_s: float
    peaks_ddr_bytes: tuple[int, ...] = ()  # every world rank's ledger peak
    resident_bytes: tuple[int, ...] = ()  # every world rank's resident set at the step's GradNorm


@dataclass(frozen=True)
class _Pending:
    """What the updates of a step use (decided at its GradNorm)."""

    t: int  # AdamW update number
    lr: float
    grad_scale: float  # clip coefficient / loss scale
    skipped: bool


def _done(value=None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class Executor:
    """Runs the lists `plan` (a `PipelinePlan`) holds for this rank's stage; every part it runs
    on is handed to it (`runtime.rank.build_rank` makes them, then sets the recompute choice
    with `set_recompute`)."""

    def __init__(self, cfg, plan: PipelinePlan, topo, state, ctx, engine=None, ledger=None, *,
                 opt: AdamW | None = None, scaler: LossScaler | None = None,
                 total_steps: int | None = None, pacer=None, resources=None):
        self.cfg, self.plan, self.topo, self.state, self.ctx = cfg, plan, topo, state, ctx
        self._place(plan, topo, engine, ledger if ledger is not None else state.ledger)
        self.total_steps = total_steps if total_steps is not None else cfg.run.steps
        self.policy, self.info = plan.policy, plan.stages[self.stage]
        self.blocks, self.sharded = list(self.info.blocks), self.info.sharded
        self.pacer = pacer if pacer is not None and pacer.enabled else None
        self.compute = StageCompute(cfg, state, ctx, self.ledger, self.pacer)
        # global block order, for the norm partials; every replica's micro-batches
        self.global_index = {b: i for i, b in enumerate(x for s in plan.blocks for x in s)}
        self.shares = plan.shares
        self.facts = FactsLayout(len(self.global_index), self.dp, self.shares, self.world)
        # each pass's runner (`runtime.passes`; `resources`: what build_rank opened for a pass,
        # by its name: the memory tier's store for offload)
        self.runners = runners_for(self, plan.passes, resources)
        self._seed_count = self.facts.nl
        for r in self.runners.values():
            self._seed_count = r.seed_count(self._seed_count)
        self._check_state()
        self.opt = opt if opt is not None else AdamW(cfg.optim, ctx.kernels)
        self.scaler = scaler if scaler is not None else LossScaler.from_config(cfg.optim, cfg.precision)
        self._adam_t, self._carry, self._pending = self.opt.step, False, None
        self.facts_seen: tuple | None = None  # (step, global facts) of the last GradNorm
        self.gathers: dict[str, Future] = {}  # block -> view all-gather in flight
        self.mailbox, self.handlers = self._open_mailbox(), self._dispatch_table()
        # what it ran: the current step, or with run.trace every step up to run.trace_bytes
        self.timeline = trace.Timeline.for_run(cfg.run, self.ledger)
        self.step = -1  # before the first step (measurement may gather views)
        self._reset_step_state()
        self.set_recompute(self._plain_recompute(), None)

    def _place(self, plan: PipelinePlan, topo, engine, ledger) -> None:
        """Where this rank sits in the grid, its engine (device arrays reach MPI through host
        buffers: no CUDA-aware MPI) and ledger; the plan must run this replica's share."""
        if engine is not None and not is_host(self.ctx.xp):
            engine = StagedEngine(engine, HostStaging(self.ctx.xp))
        self.engine, self.ledger = engine, ledger
        self.pp, self.dp, self.num_micro_batches = plan.pp, plan.dp, plan.num_micro_batches
        self.stage, self.replica, self.rank = (
            (topo.stage, topo.replica, topo.rank) if topo is not None else (0, 0, 0))
        self.world, self.micro_batch = self.pp * self.dp, self.cfg.parallel.micro_batch
        if self.world > 1 and (topo is None or engine is None):
            raise ValueError(f"pp={self.pp} x dp={self.dp} needs a Topology and a CommEngine")
        if plan.shares[self.replica] != self.num_micro_batches:  # unequal replica shares
            raise ValueError(f"rank {self.rank}: the plan runs {self.num_micro_batches} "
                             f"micro-batches, replica {self.replica}'s share is "
                             f"{plan.shares[self.replica]} of {list(plan.shares)}: build it with "
                             f"PipelinePlan.from_config(cfg, replica={self.replica})")

    @property
    def offloader(self):
        """The memory tier's runner (`runtime.passes.offload.Offloader`), or None."""
        return self.runners.get(offload.NAME)

    def _open_mailbox(self) -> Mailbox | None:
        """The pipeline's messages (none for one stage)."""
        if self.pp == 1:
            return None
        from ratrain.comm.p2p import P2P  # loads MPI: only when there are stages to talk to

        p2p = P2P(self.topo, engine=self.engine, ledger=self.ledger)
        return Mailbox(p2p, self.ledger, self.act_shape, self.ctx.dtype, self.ctx.xp,
                       self._comm_event)

    def _dispatch_table(self) -> dict:
        return dispatch_table("Executor", {
            sched.Forward: self._forward, sched.Backward: self._backward,
            sched.RecvForward: self._recv, sched.RecvBackward: self._recv,
            sched.SendForward: self._send_forward, sched.SendBackward: self._send_backward,
            sched.MaterializeView: self._materialize_view, sched.WaitView: self._wait_view,
            sched.DropView: lambda a: self.state.drop_view(a.block), sched.AllocGrad: self._alloc_grad,
            sched.FreeGrad: lambda a: self.state.free_grad(a.block), sched.SyncGrad: self._sync_grad,
            sched.WaitGrad: self._wait_grad, sched.GradNorm: self._grad_norm, sched.Update: self._update,
            **{t: f for r in self.runners.values() for t, f in r.handlers().items()},
        }, passes=self.plan.passes)

    def _check_state(self) -> None:
        """Check the state holds what the plan needs: this stage's blocks, whole or this
        replica's segment as the policy shards (`runtime.rank.shard_state` cuts a whole one)."""
        state = self.state
        if state.block_names != self.blocks:
            raise ValueError(f"rank {self.rank}: the stage state holds blocks "
                             f"{state.block_names}, the plan's stage {self.stage} "
                             f"has {self.blocks}")
        if state.num_shards != self.info.shards or (
                state.sharded and state.shard_index != self.replica):
            raise ValueError(
                f"rank {self.rank}: the stage state holds segment {state.shard_index} of "
                f"{state.num_shards}, but policy {self.policy.name} at dp={self.dp} needs "
                + (f"segment {self.replica} of {self.dp}" if self.sharded else "whole blocks"))

    def _plain_recompute(self) -> dict[str, str]:
        """Per layer, `schedule.recompute` as it stands (`auto`: none until chosen;
        `offload.activations: all`: every layer offloaded)."""
        mode = self.cfg.schedule.recompute
        if self.cfg.offload.activations == "all":
            mode = OFFLOAD
        return {b: ("none" if mode == "auto" else mode)
                for b in self.blocks if self.compute.role[b] == "layer"}

    def set_recompute(self, choice: dict[str, str], predicted_peak: int | None) -> None:
        """What each layer recomputes (`offload`: keeps everything, in the tier), and the peak
        bytes the memory model predicts with it (`runtime.measure.fit_rank_recompute`; None:
        not measured). Offloaded layers put the tier's transfers in this stage's lists."""
        self.recovery = dict(choice)
        self.compute.recompute = {b: kernel_recompute(c) for b, c in choice.items()}
        self.predicted_peak = predicted_peak
        off = tuple(b for b, c in choice.items() if c == OFFLOAD)
        now = offload.layers_of(self.plan)
        if off != now[self.stage]:
            if off and self.offloader is None:
                raise ValueError(f"rank {self.rank}: layers {list(off)} are to be offloaded but "
                                 "the rank has no memory tier (offload.activations is off)")
            self.plan = offload.with_layers(
                self.plan, [off if s == self.stage else o for s, o in enumerate(now)])
            self.info = self.plan.stages[self.stage]

    # -- public API -------------------------------------------------------------------------

    @property
    def reports_loss(self) -> bool:
        """The one rank that writes metrics: replica 0 of the last stage."""
        return self.stage == self.pp - 1 and self.replica == 0

    @property
    def act_shape(self) -> tuple[int, int, int]:
        """One micro-batch's activations (and their gradients) between stages: (B, T, C)."""
        return (self.micro_batch, self.cfg.model.seq_len, self.cfg.model.hidden)

    def run_step(self, step: int, batch) -> StepResult:
        """One training step of this rank. `batch`: (inputs, targets), each (M, B, T) int64
        (inputs needed on the first stage, targets on the last; None elsewhere)."""
        t0 = time.perf_counter()
        inputs, targets = batch if batch is not None else (None, None)
        self._check_batch(inputs, targets)
        self._reset_step_state()
        self.step = step
        self.timeline.new_step()
        self.inputs, self.targets = self._to_device(inputs), self._to_device(targets)
        self.ledger.reset_peak()
        actions = self.plan.step_list(self.stage, self._carry, step)
        if self.mailbox is not None:
            self.mailbox.start(actions)  # the first receive of each direction, posted early
        # warm-up / steady / cool-down are all in the list; lifecycle actions sit between
        for a in actions:
            self._run(a)
        if self.mailbox is not None:
            self.mailbox.finish()
        self._carry = self.plan.carries()
        res = replace(self._result, step_time_s=time.perf_counter() - t0)
        self._result = res
        return res

    def flush(self) -> None:
        """Finish the last step's deferred lifecycle work (no-op when nothing is pending)."""
        if not self._carry:
            return
        for a in self.plan.flush_list(self.stage, self.step):
            self._run(a)
        self._carry = False

    def eval_loss(self, batches) -> float:
        """Mean loss over `batches` (a list of (inputs, targets), (M, B, T) each), forward only,
        with the current weights; every rank gets the same value."""
        self.flush()
        made = [b for b in self.blocks if not self.state.has_view(b)]
        for b in made:
            self.materialize_now(b)
        p2p = self.mailbox.p2p if self.mailbox is not None else None
        nl, before = self.facts.nl, sum(self.shares[:self.replica])
        losses = np.zeros(len(batches) * nl, np.float64)
        mine: dict[int, object] = {}  # index in `losses` -> this rank's loss (0-d, the device's)
        for k, (inputs, targets) in enumerate(batches):
            inputs, targets = self._to_device(inputs), self._to_device(targets)
            for mb in range(self.num_micro_batches):
                x = None
                if self.stage > 0:
                    x = self.ledger.alloc("activations.eval", self.act_shape, self.ctx.dtype,
                                          self.ctx.xp, zero=False)
                    p2p.irecv_forward(out=x).result()
                y, loss = self.compute.forward(mb, x, inputs, targets, keep_caches=False)
                if x is not None:
                    self.ledger.free(x)
                if self.stage < self.pp - 1:
                    p2p.isend_forward(y).result()
                else:
                    mine[k * nl + before + mb] = loss
        for i, v in zip(mine, host_floats(self.ctx.xp, mine.values())):  # one download
            losses[i] = v
        for b in made:
            self.state.drop_view(b)
        losses = self._allreduce_world(losses)
        return float(sum(losses.tolist()) / len(losses))

    def state_dict(self) -> dict:
        """Optimizer step and loss scaler (call `flush` first)."""
        return {"opt": self.opt.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.opt.load_state_dict(sd["opt"])
        self.scaler.load_state_dict(sd["scaler"])
        self._adam_t = self.opt.step
        for r in self.runners.values():  # a runner with an optimizer of its own (peer copies)
            r.load_state_dict(sd)

    def iter_full_state(self, buffers=STATE_BUFFERS, mean: bool = False):
        """Whole blocks of this stage, `(block, {buffer: {name: array}})`; collective over the
        stage's replicas when sharded, or with `mean` (the replicas' mean: partial
        synchronization) (`runtime.fullstate.iter_full_state`)."""
        return fullstate.iter_full_state(self, buffers, mean)

    def full_params(self) -> dict[str, np.ndarray]:
        """{global name: whole fp32 master (a copy)}; collective over the stage's replicas."""
        return fullstate.full_params(self)

    def load_full_block(self, block: str, arrays) -> None:
        """Load whole parameters of one block: `arrays` = {buffer: {global name: array}} with
        buffers from `("master", "m", "v")` (each given buffer must cover the block's
        parameters); this replica keeps its segment when sharded. Local: no communication (the
        views of the block are refreshed or dropped; the next step makes them); call between
        steps after `flush()`."""
        for k, named in arrays.items():
            self.state.load_named(named, k, blocks=[block])

    @property
    def events(self) -> list[tuple]:
        """The kept timeline, (name, group, t0, t1, tid, {"step": step}) oldest first
        (`runtime.trace.Timeline`)."""
        return self.timeline.events()

    def write_trace(self, path: str, png: str | None = None) -> None:
        """Gather every rank's timeline on rank 0 and write Chrome trace JSON (and a PNG Gantt
        of the last step when matplotlib is installed). Collective: every rank calls it."""
        trace.write(self, path, png)

    # -- running actions --------------------------------------------------------------------

    def _run(self, a, block: str | None = None) -> None:
        t0 = time.perf_counter()
        self.handlers[type(a)](a)
        self._event(event_name(a, block), a.group, t0, time.perf_counter())
        if self.mailbox is not None:
            self.mailbox.poll()

    def _event(self, name, group, t0, t1, tid=0, step=None):
        self.timeline.add(name, group, t0, t1, tid, self.step if step is None else step)

    def _comm_event(self, name, t0, fut) -> None:
        step = self.step

        def done(_f, name=name, t0=t0, step=step):
            self._event(name, "comm", t0, time.perf_counter(), 1, step)

        fut.add_done_callback(done)

    def _hooks(self, hooks, block):
        for b, h in hooks:
            if b == block:
                self._run(h)

    # -- compute ----------------------------------------------------------------------------

    def _forward(self, a: sched.Forward) -> None:
        x = self.recv_fwd.pop(a.mb, None) if self.stage > 0 else None
        y, loss = self.compute.forward(a.mb, x, self.inputs, self.targets, True, a.pre, a.post,
                                       self._hooks)
        if self.stage == self.pp - 1:
            self.losses[a.mb] = loss
        else:
            self.ledger.track("comm.send_forward", y)
            self.out_fwd[a.mb] = y

    def _backward(self, a: sched.Backward) -> None:
        dy = self.recv_bwd.pop(a.mb, None) if self.stage < self.pp - 1 else None
        # the mean over the global batch (a runner may say otherwise: partial sync, this replica's)
        dscale = self.scaler.scale / self._seed_count
        dx = self.compute.backward(a.mb, dy, dscale, a.pre, a.post, self._hooks)
        if dx is not None:  # the input gradient, for the previous stage
            self.ledger.free(dx)
            self.ledger.track("comm.send_backward", dx)
            self.out_bwd[a.mb] = dx

    # -- point-to-point ---------------------------------------------------------------------

    def _recv(self, a) -> None:
        into = self.recv_fwd if isinstance(a, sched.RecvForward) else self.recv_bwd
        into[a.mb] = self.mailbox.take(type(a), a.mb)

    def _send_forward(self, a: sched.SendForward) -> None:
        self.mailbox.send(sched.SendForward, a.mb, self.out_fwd.pop(a.mb))

    def _send_backward(self, a: sched.SendBackward) -> None:
        self.mailbox.send(sched.SendBackward, a.mb, self.out_bwd.pop(a.mb))

    # -- lifecycle --------------------------------------------------------------------------

    def _alloc_grad(self, a: sched.AllocGrad) -> None:
        if not self.state.has_grad(a.block):  # tied: the head's backward may have made embed's
            self.state.alloc_grad(a.block)

    def _materialize_view(self, a: sched.MaterializeView) -> None:
        with self._pace_memory(self._view_bytes(a.block)):
            view = self.state.materialize_view(a.block)
        if a.gather and self.dp > 1:  # the other replicas' segments, in the engine
            t0 = time.perf_counter()
            fut = self.engine.allgather(view, self.topo.dp_comm)
            self._comm_event(a.name(), t0, fut)
            self.gathers[a.block] = fut

    def _wait_view(self, a: sched.WaitView) -> None:
        fut = self.gathers.pop(a.block, None)
        if fut is not None:
            fut.result()

    def materialize_now(self, block: str) -> None:
        """Make a view outside the schedule (eval, measurement): cast, gather, wait. Collective
        over the stage's replicas when the state is sharded."""
        self._materialize_view(sched.MaterializeView(block, gather=self.sharded))
        self._wait_view(sched.WaitView(block))

    def _sync_grad(self, a: sched.SyncGrad) -> None:
        for b in a.blocks:  # one ring collective per block: the same order under every policy
            if self.dp > 1:
                t0 = time.perf_counter()
                g = self.state.grad_flat(b)
                if a.scatter:  # replica q ends with the reduced segment q
                    fut = self.engine.reduce_scatter(g, self.topo.dp_comm)
                else:
                    fut = self.engine.allreduce(g, self.topo.dp_comm)
                self._comm_event(replace(a, blocks=(b,)).name(), t0, fut)
            else:
                fut = _done()
            self.syncs[b] = fut

    def _wait_grad(self, a: sched.WaitGrad) -> None:
        for b in a.blocks:
            self.syncs.pop(b).result()
            if a.scatter:
                seg = self.state.shrink_grad(b)  # only the own segment is needed from here
            else:  # this replica's share of the norm work: its ring segment of the block
                n = self.state.block(b).size
                lo, hi = segment_bounds(n, self.replica, self.dp)
                seg = self.state.grad_flat(b)[lo:hi]
            self.sq[b] = self.ctx.kernels.grad_norm(seg, self.ctx.xp)

    def _grad_norm(self, a: sched.GradNorm) -> None:
        facts = self.facts
        for r in self.runners.values():  # partial sync: this replica's own gradients, whole
            self.sq = r.norm_partials(self.sq)
        vec = facts.vector()
        # the step's one host sync: every sum of squares and loss in one download
        sq = host_floats(self.ctx.xp, [*self.sq.values(), *self.losses.values()])
        for b, s in zip(self.sq, sq):  # (global block, dp segment): one contributor each
            facts.put_sq(vec, self.global_index[b], self.replica, s)
        for mb, loss in zip(self.losses, sq[len(self.sq):]):  # the last stage's
            facts.put_loss(vec, self.replica, mb, loss)
        facts.put_peak(vec, self.rank, self.ledger.peak)
        facts.put_resident(vec, self.rank, resident_bytes())
        self._take_facts(self._allreduce_world(vec))

    def _take_facts(self, vec) -> None:
        """The step's decisions from its global facts `vec` (the world's all-reduced vector, the
        same on every rank): the norm, the skip, the loss scale, the pending update."""
        facts = self.facts
        self.facts_seen = (self.step, vec)  # a survivor that missed them takes a peer's (elastic)
        loss_scale = self.scaler.scale
        norm = global_grad_norm(facts.sq_partials(vec), loss_scale, segments=self.dp)
        norms = (norm, norm, math.isfinite(norm))  # clipping, reported, finite everywhere
        for r in self.runners.values():  # partial sync: each replica clips by its own norm
            norms = r.step_norm(facts, vec, loss_scale, norms)
        grad_norm, reported, finite = norms
        skipped = self.scaler.update(not finite)
        lr = lr_at(self.step, self.cfg.optim, self.total_steps)
        if skipped:
            self._pending = _Pending(0, lr, 0.0, True)
        else:
            self._adam_t += 1
            scale = grad_scale_for(grad_norm, self.cfg.optim.grad_clip, loss_scale)
            self._pending = _Pending(self._adam_t, lr, scale, False)
        self._result = StepResult(
            step=self.step, loss=facts.mean_loss(vec), grad_norm=reported, lr=lr,
            loss_scale=loss_scale, skipped=skipped, peak_ddr_bytes=facts.peak(vec),
            local_peak_ddr_bytes=int(self.ledger.peak), step_time_s=0.0,
            peaks_ddr_bytes=facts.peaks(vec), resident_bytes=facts.resident(vec))

    def settle(self, step: int, vec) -> None:
        """Elastic recovery, on a survivor: finish step `step`'s committed work, so that every
        survivor holds the state after its update. `vec`: the step's global facts from a
        survivor that saw them, taken here if this rank did not (its all-reduce was cut off:
        every survivor had contributed to it, or none could have finished it); then every
        block not yet updated with them is (a deferred update cut off by the loss), and each
        runner settles its own (the peer copies of a sharded state)."""
        if vec is not None and (self.facts_seen is None or self.facts_seen[0] < step):
            self.step = step
            self._take_facts(vec)
        pend = self._pending
        if pend is None or pend.skipped:
            return
        for b in self.blocks:
            if self.opt.block_step(b) < pend.t:
                self._update(sched.Update(b))
        for r in self.runners.values():
            r.settle(pend)

    def _update(self, a: sched.Update) -> None:
        pend = self._pending
        if not pend.skipped:
            lo, hi = self.state.segment(a.block)
            with self._pace_memory(ADAMW_BYTES_PER_PARAM * (hi - lo)):
                self.opt.update_block(self.state, a.block, pend.t, pend.lr, pend.grad_scale)

    def _view_bytes(self, block: str) -> int:
        """Memory bytes a view's cast moves (read the own master segment, write the view's)."""
        lo, hi = self.state.segment(block)
        return view_cast_bytes_per_param(self.cfg.precision, self.info.shards) * (hi - lo)

    def _pace_memory(self, nbytes: int):
        """Pad memory-bound lifecycle work to nbytes / the profile's DDR bandwidth (emulate)."""
        if self.pacer is None or not nbytes:
            return contextlib.nullcontext()
        return self.pacer.memory(nbytes)

    def _allreduce_world(self, vec):
        if self.world == 1:
            return vec
        t0 = time.perf_counter()
        fut = self.engine.allreduce(vec, self.topo.comm)
        self._comm_event("global facts", t0, fut)
        fut.result()
        return vec

    # -- bookkeeping ------------------------------------------------------------------------

    def _reset_step_state(self) -> None:
        self.compute.caches = {}
        self.losses: dict[int, object] = {}  # mb -> 0-d loss array (on the device)
        self.recv_fwd: dict = {}
        self.recv_bwd: dict = {}
        self.out_fwd: dict = {}
        self.out_bwd: dict = {}
        self.syncs: dict = {}
        self.sq: dict[str, object] = {}  # block -> sum of squares (0-d on a device)

    def _to_device(self, a):
        """A batch array on this rank's device (one upload per step; None stays None)."""
        return None if a is None else to_device(self.ctx.xp, a)

    def _check_batch(self, inputs, targets) -> None:
        want = (self.num_micro_batches, self.micro_batch, self.cfg.model.seq_len)
        for name, arr, needed in (("inputs", inputs, self.stage == 0),
                                  ("targets", targets, self.stage == self.pp - 1)):
            if needed and (arr is None or tuple(arr.shape) != want):
                got = None if arr is None else tuple(arr.shape)
                raise ValueError(f"rank {self.rank} (stage {self.stage}): {name} of shape {got}, "
                                 f"expected {want} (num_micro_batches, micro_batch, seq_len)")


__all__ = ["Executor", "StepResult"]
