"""The executor: runs one rank's action list, step after step, and records its timeline.

    ex = Executor(cfg, topo, state, ctx, engine, ledger)         # policy from cfg.schedule
    res = ex.run_step(step, (inputs, targets))                   # (M, B, T) int64 each, or None
    res.loss, res.grad_norm, res.skipped ...                     # known on every rank
    ex.flush()             # finish deferred lifecycle work: before a checkpoint, eval, the end
    ex.write_trace("trace.json")                                  # collective: every rank calls
    for block, st in ex.iter_full_state(): ...   # whole fp32 master/m/v per block (collective over dp)
    ex.load_full_block(block, st)                # the inverse: keep this replica's segment
    ex.full_params()                             # {name: whole fp32 master} (collective over dp)

Actions go through a `{type: handler}` table. Compute runs on this (the main) thread; every
message and collective goes through the communication engine (`ratrain.comm`): receives are
posted early (the first of each direction at step start, the next one as soon as one lands),
sends and gradient syncs are futures waited on only when their result is needed. With pp = dp = 1
there is no communication at all and `engine` may be None (no MPI launcher needed).

Numerics are the same under every policy: each block's gradient is summed across replicas by its
own ring collective (`SyncGrad` of a bucket submits one per block; an all-reduce, or under
`ratrain` with dp > 1 a reduce-scatter, whose segment q is reduced in exactly the all-reduce's
order), the global facts (`GradNorm`) are one float64 all-reduce over the world of a vector in
which every entry has exactly one non-zero contributor (so the reduction is exact): the sums of
squares per (block, dp segment), segment q written by replica q, in global block order, every
micro-batch loss of every replica in global micro-batch order, and every rank's peak DDR. Every
rank then adds them up in the same order, takes the same clip coefficient and the same skip
decision, and updates its blocks (or its segments of them) with the same elementwise AdamW.

Sharded optimizer state (`ratrain`, dp > 1, `schedule.shard_optimizer`): the executor shards the
`StageState` it is given (`state.shard(replica, dp)`, unless built with `shard=`); replica q
keeps segment q of each block's master, m and v, updates it from its reduce-scattered gradient
segment, and the next step's view is cast from the own master segment and ring all-gathered in
the engine (`MaterializeView(gather=True)`), waited for before the block's first forward
(`WaitView`). Whole blocks for checkpoints and hash checks: `iter_full_state`, `full_params`,
`load_full_block` (collective over the stage's replicas).

Loss scaling: `head_backward` is seeded with loss_scale / (num_micro_batches * dp), gradients
are summed over replicas, the norm is taken on unscaled gradients, a non-finite norm skips the
step on every rank (fp32 too) and halves the scale in fp16.

Memory: activations are tracked in the ledger per micro-batch and block
(`activations.mb<i>.<block>`), received activations under `activations.mb<i>.input`,
gradient messages under `comm.*`. `recompute: auto` measures each keep mode's cache on this
rank's first layer, then plays the action lists through `ratrain.plan.memory` to pick the fewest
layers to recompute that fit the DDR cap.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np

from ratrain.exec import layers as L
from ratrain.exec.optim import AdamW, LossScaler, global_grad_norm, grad_scale_for, lr_at
from ratrain.exec.optim import block_sq_norm as _sq_norm
from ratrain.exec.params import KINDS, segment_bounds
from ratrain.exec.spec import block_cost, stage_blocks
from ratrain.lifecycle.policies import Policy, StageInfo, as_policy
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
)
from ratrain.lifecycle.validate import check_lifecycle, validate_policy
from ratrain.plan.cost import ADAMW_BYTES_PER_PARAM  # the pacer pads an update to these / DDR
from ratrain.plan.memory import StageSizes, choose_recompute, simulate_peak

RECOMPUTE_KEEP = {"none": "all", "full": "input", "selective": "selective"}
MAX_EVENTS = 500_000  # timeline events kept per rank (the oldest are dropped beyond)


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float  # mean token loss over micro-batches and replicas (every rank knows it)
    grad_norm: float  # global norm of the unscaled gradients (non-finite: overflow)
    lr: float
    loss_scale: float  # the scale this step's backward used
    skipped: bool  # no update (non-finite gradients), the same on every rank
    peak_ddr_bytes: int  # the largest ledger peak over ranks during the step
    local_peak_ddr_bytes: int  # this rank's
    step_time_s: float


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
    def __init__(self, cfg, topo, state, ctx, engine=None, ledger=None, policy=None, *,
                 opt: AdamW | None = None, scaler: LossScaler | None = None,
                 total_steps: int | None = None, validate: bool = True, pacer=None):
        self.cfg = cfg
        self.topo = topo
        self.state = state
        self.ctx = ctx
        self.engine = engine
        self.ledger = ledger if ledger is not None else state.ledger
        par = cfg.parallel
        self.pp, self.dp = par.pp, par.dp
        self.stage = topo.stage if topo is not None else 0
        self.replica = topo.replica if topo is not None else 0
        self.world = self.pp * self.dp
        self.rank = topo.rank if topo is not None else 0
        if self.world > 1 and (topo is None or engine is None):
            raise ValueError(f"pp={self.pp} x dp={self.dp} needs a Topology and a CommEngine")
        self.m = par.num_micro_batches
        self.micro_batch = par.micro_batch
        self.total_steps = total_steps if total_steps is not None else cfg.run.steps
        self.blocks = [b.name for b in state.blocks]
        self.kind = {b.name: b.kind for b in state.blocks}
        self.tied = cfg.model.tie_embeddings and "head" in self.kind and "embed" in self.kind
        if cfg.model.tie_embeddings and self.pp > 1:
            raise ValueError("tied embeddings need pp=1 (embedding and head on one stage)")

        # global block order, for the norm partials
        all_blocks = [[b.name for b in stage_blocks(cfg.model, self.pp, s, par.layers_per_stage)]
                      for s in range(self.pp)]
        self.global_index = {b: i for i, b in enumerate(x for s in all_blocks for x in s)}
        self.num_global_blocks = len(self.global_index)

        # the schedule; sharded optimizer state (ratrain, dp > 1)
        self.policy: Policy = as_policy(policy if policy is not None else cfg.schedule.policy)
        self.info = StageInfo.from_config(cfg, self.stage, state.blocks, self.policy)
        self.sharded = self.info.sharded
        if self.sharded and not state.sharded:
            for b in self.blocks:
                state.drop_view(b)
            state.shard(self.replica, self.dp)
        if state.num_shards != self.info.shards or (
                state.sharded and state.shard_index != self.replica):
            raise ValueError(
                f"rank {self.rank}: the stage state holds segment {state.shard_index} of "
                f"{state.num_shards}, but policy {self.policy.name} at dp={self.dp} needs "
                + (f"segment {self.replica} of {self.dp}" if self.sharded else "whole blocks"))
        self.gathers: dict[str, Future] = {}  # block -> view all-gather in flight
        self._lists = {False: self.policy.build_step(self.info, False)}
        if self.policy.carries(self.info):
            self._lists[True] = self.policy.build_step(self.info, True)
        self._flush_list = self.policy.build_flush(self.info)
        if validate:
            infos = [replace(self.info, stage=s, blocks=tuple(all_blocks[s]),
                             block_bytes=tuple(0 for _ in all_blocks[s])) for s in range(self.pp)]
            validate_policy(self.policy, infos, steps=2)
            check_lifecycle(self._rank_lists(3), self.blocks, self.m, self.stage,
                            self.info.fp16, self.sharded)

        self.opt = opt if opt is not None else AdamW(cfg.optim)
        self.scaler = scaler if scaler is not None else LossScaler.from_config(cfg.optim, cfg.precision)
        self._adam_t = self.opt.step
        self._carry = False
        self._pending: _Pending | None = None

        self.p2p = None
        if self.pp > 1:
            from ratrain.comm.p2p import P2P

            self.p2p = P2P(topo, engine=engine, ledger=self.ledger)

        self.handlers = {
            Forward: self._forward,
            Backward: self._backward,
            RecvForward: self._recv_forward,
            RecvBackward: self._recv_backward,
            SendForward: self._send_forward,
            SendBackward: self._send_backward,
            MaterializeView: self._materialize_view,
            WaitView: self._wait_view,
            DropView: lambda a: self.state.drop_view(a.block),
            AllocGrad: self._alloc_grad,
            FreeGrad: lambda a: self.state.free_grad(a.block),
            SyncGrad: self._sync_grad,
            WaitGrad: self._wait_grad,
            GradNorm: self._grad_norm,
            Update: self._update,
        }
        if pacer is None and cfg.platform.emulate:
            from ratrain.shim.pacing import Pacer
            from ratrain.shim.platform import resolve_platform

            pacer = Pacer(resolve_platform(cfg.platform))
        self.pacer = pacer if pacer is not None and pacer.enabled else None
        self.events: list[tuple] = []  # (name, cat, t0, t1, tid, args)
        self.t_origin = time.perf_counter()
        self.step = -1  # before the first step (measurement may gather views)
        self.keep, self.predicted_peak = self._choose_keep()
        self._reset_step_state()

    # -- public API -------------------------------------------------------------------------

    @property
    def reports_loss(self) -> bool:
        """The one rank that writes metrics: replica 0 of the last stage."""
        return self.stage == self.pp - 1 and self.replica == 0

    def run_step(self, step: int, batch) -> StepResult:
        """One training step of this rank. `batch`: (inputs, targets), each (M, B, T) int64
        (inputs needed on the first stage, targets on the last; None elsewhere)."""
        t0 = time.perf_counter()
        inputs, targets = batch if batch is not None else (None, None)
        self._check_batch(inputs, targets)
        self._reset_step_state()
        self.step, self.inputs, self.targets = step, inputs, targets
        self.ledger.reset_peak()
        actions = self._lists[self._carry]
        self._post_first_receives(actions)
        # warm-up / steady / cool-down are all in the list; lifecycle actions sit between
        for a in actions:
            self._run(a)
        self._finish_sends()
        self._carry = self.policy.carries(self.info)
        res = replace(self._result, step_time_s=time.perf_counter() - t0)
        self._result = res
        return res

    def flush(self) -> None:
        """Finish the last step's deferred lifecycle work (no-op when nothing is pending)."""
        if not self._carry:
            return
        for a in self._flush_list:
            self._run(a)
        self._carry = False

    def eval_loss(self, batches) -> float:
        """Mean loss over `batches` (a list of (inputs, targets), (M, B, T) each), forward only,
        with the current weights; every rank gets the same value."""
        self.flush()
        made = [b for b in self.blocks if not self.state.has_view(b)]
        for b in made:
            self._materialize_now(b)
        losses = np.zeros(len(batches) * self.m * self.dp, np.float64)
        for k, (inputs, targets) in enumerate(batches):
            for mb in range(self.m):
                x = None
                if self.stage > 0:
                    x = self.ledger.alloc("activations.eval", self._act_shape(), self.ctx.dtype,
                                          self.ctx.xp, zero=False)
                    self.p2p.irecv_forward(out=x).result()
                y, loss = self._forward_blocks(mb, x, inputs, targets, keep_caches=False)
                if x is not None:
                    self.ledger.free(x)
                if self.stage < self.pp - 1:
                    self.p2p.isend_forward(y).result()
                else:
                    losses[(k * self.dp + self.replica) * self.m + mb] = loss
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

    def iter_full_state(self, kinds=KINDS):
        """Yield `(block, {kind: {global name: fp32 array of the parameter's shape}})` for each
        block of this stage in model order, kinds from `("master", "m", "v")`, with the step's
        deferred work flushed first. Collective over the stage's replicas (every replica of the
        stage iterates to the end, in the same order); every replica gets the whole block.

        Sharded: each kind of the block is ring all-gathered (through the engine, over
        `dp_comm`) into a block-sized buffer (ledger `comm.gather.<kind>`), released when the
        next block is asked for: at most one extra block is held, and the arrays are valid only
        until then (copy what you keep). Unsharded: views into the live buffers (no copy, no
        communication)."""
        self.flush()
        for k in kinds:
            if k not in KINDS:
                raise ValueError(f"kind={k!r} is not one of: {', '.join(KINDS)}")
        for b in self.blocks:
            spec = self.state.block(b)
            base, end = self.state.block_range(b)
            if not self.sharded:
                out = {k: {p.name: self.state.buffer(k)[slice(*self.state.param_range(p.name))]
                           .reshape(p.shape) for p in spec.params} for k in kinds}
                yield b, out
                continue
            lo, hi = self.state.segment(b)
            bufs = {}
            try:
                for k in kinds:
                    buf = self.ledger.alloc(f"comm.gather.{k}", (end - base,), np.float32,
                                            self.ctx.xp, zero=False)
                    bufs[k] = buf
                    buf[lo:hi] = self.state.flat(k, b)
                    self.engine.allgather(buf, self.topo.dp_comm).result()
                out = {}
                for k, buf in bufs.items():
                    out[k] = {}
                    for p in spec.params:
                        a, e = self.state.param_range(p.name)
                        out[k][p.name] = buf[a - base : e - base].reshape(p.shape)
                yield b, out
            finally:
                self.ledger.free(*bufs.values())

    def full_params(self) -> dict[str, np.ndarray]:
        """{global name: whole fp32 master (a copy)} of this stage's parameters; collective
        over the stage's replicas (see `iter_full_state`). For tests and hash checks."""
        return {name: np.array(a) for _, st in self.iter_full_state(("master",))
                for name, a in st["master"].items()}

    def load_full_block(self, block: str, arrays) -> None:
        """Load whole parameters of one block: `arrays` = {kind: {global name: array}} with
        kinds from `("master", "m", "v")` (each given kind must cover the block's parameters);
        this replica keeps its segment when sharded. Local (no communication); call between
        steps after `flush()`; views of the block are refreshed or dropped (the next step
        makes them)."""
        for k, named in arrays.items():
            self.state.load_named(named, k, blocks=[block])

    def step_lists(self, steps: int = 2) -> list[tuple]:
        return self._rank_lists(steps)

    def write_trace(self, path: str, png: str | None = None) -> None:
        """Gather every rank's timeline on rank 0 and write Chrome trace JSON (and a PNG Gantt
        of the last step when matplotlib is installed). Collective: every rank calls it."""
        from ratrain.lifecycle import trace

        trace.write(self, path, png)

    # -- running actions --------------------------------------------------------------------

    def _run(self, a) -> None:
        t0 = time.perf_counter()
        self.handlers[type(a)](a)
        self._event(a.label(self.stage), _category(a), t0, time.perf_counter())
        self._poll_sends()

    def _event(self, name, cat, t0, t1, tid=0, args=None):
        if len(self.events) >= MAX_EVENTS:
            del self.events[: MAX_EVENTS // 10]
        self.events.append((name, cat, t0, t1, tid, args or {"step": self.step}))

    def _hooks(self, hooks, block):
        for b, h in hooks:
            if b == block:
                self._run(h)

    # -- compute ----------------------------------------------------------------------------

    def _view(self, block):
        p = self.state.view(block)
        if self.tied and block == "head":
            p = {**p, "weight": self.state.view("embed")["weight"]}
        return p

    def _grad(self, block):
        g = self.state.grad(block)
        if self.tied and block == "head":
            if not self.state.has_grad("embed"):
                self.state.alloc_grad("embed")
            g = {**g, "weight": self.state.grad("embed")["weight"]}
        return g

    def _forward_blocks(self, mb, x, inputs, targets, keep_caches=True, pre=(), post=()):
        """Run this stage's blocks forward on micro-batch `mb`; returns (output, loss)."""
        loss = None
        for b in self.blocks:
            self._hooks(pre, b)
            kind, p = self.kind[b], self._view(b)
            with self._pace(kind, "forward"):
                if kind == "embed":
                    x, cache = L.embed_forward(inputs[mb], p, self.ctx)  # (B, T, C)
                elif kind == "layer":
                    keep = self.keep[b] if keep_caches else "input"
                    x, cache = L.layer_forward(x, p, self.ctx, keep)
                else:
                    loss, cache = L.head_forward(x, targets[mb], p, self.ctx)
                    loss = float(loss)
            if keep_caches:
                self.ledger.track(f"activations.mb{mb}.{b}", *L.cache_arrays(cache))
                self.caches[(mb, b)] = cache
            self._hooks(post, b)
        return x, loss

    def _pace(self, kind, phase, keep="all"):
        """Pad a block's compute to the platform's time for its flops (platform.emulate)."""
        if self.pacer is None or kind == "embed":
            return contextlib.nullcontext()
        m = self.cfg.model
        tokens = self.micro_batch * m.seq_len
        flops = block_cost(m, kind) * tokens / 3.0  # forward: a third of fwd + bwd
        if phase == "backward":
            flops *= 2.0
            if kind == "layer" and keep == "input":  # full recomputation
                flops += block_cost(m, kind) * tokens / 3.0
            elif kind == "layer" and keep == "selective":  # the attention core again
                flops += 2.0 * m.seq_len * m.hidden * tokens
        return self.pacer.compute(flops)

    def _forward(self, a: Forward) -> None:
        x = self.recv_fwd.pop(a.mb, None) if self.stage > 0 else None
        y, loss = self._forward_blocks(a.mb, x, self.inputs, self.targets, True, a.pre, a.post)
        if self.stage == self.pp - 1:
            self.losses[a.mb] = loss
        else:
            self.ledger.track("comm.send_forward", y)
            self.out_fwd[a.mb] = y

    def _backward(self, a: Backward) -> None:
        mb = a.mb
        dy = self.recv_bwd.pop(mb, None) if self.stage < self.pp - 1 else None
        dscale = self.scaler.scale / (self.m * self.dp)
        for b in reversed(self.blocks):
            self._hooks(a.pre, b)
            kind, cache = self.kind[b], self.caches.pop((mb, b))
            p, g = self._view(b), self._grad(b)
            with self._pace(kind, "backward", cache.keep):
                if kind == "head":
                    dx = L.head_backward(dscale, cache, p, g, self.ctx)  # (B, T, C)
                elif kind == "layer":
                    dx = L.layer_backward(dy, cache, p, g, self.ctx)
                else:
                    L.embed_backward(dy, cache, p, g, self.ctx)
                    dx = None
            self.ledger.free(*L.cache_arrays(cache), dy)
            if dx is not None:
                self.ledger.track(f"activations.mb{mb}.grad", dx)
            dy = dx
            self._hooks(a.post, b)
        if dy is not None:  # the input gradient, for the previous stage
            self.ledger.free(dy)
            self.ledger.track("comm.send_backward", dy)
            self.out_bwd[mb] = dy

    # -- point-to-point ---------------------------------------------------------------------

    def _act_shape(self):
        return (self.micro_batch, self.cfg.model.seq_len, self.cfg.model.hidden)

    def _post_first_receives(self, actions) -> None:
        self.recv_order = {
            RecvForward: [a.mb for a in actions if isinstance(a, RecvForward)],
            RecvBackward: [a.mb for a in actions if isinstance(a, RecvBackward)],
        }
        for kind in self.recv_order:
            self._post_next(kind)

    def _post_next(self, kind) -> None:
        order = self.recv_order[kind]
        if not order:
            return
        mb = order.pop(0)
        if kind is RecvForward:
            buf = self.ledger.alloc(f"activations.mb{mb}.input", self._act_shape(), self.ctx.dtype,
                                    self.ctx.xp, zero=False)
            t0 = time.perf_counter()
            fut = self.p2p.irecv_forward(out=buf)
        else:
            buf = self.ledger.alloc("comm.recv_backward", self._act_shape(), self.ctx.dtype,
                                    self.ctx.xp, zero=False)
            t0 = time.perf_counter()
            fut = self.p2p.irecv_backward(out=buf)
        name = ("rf" if kind is RecvForward else "rb") + str(mb)
        self._comm_event(fut, name, t0)
        self.posted[(kind, mb)] = (fut, buf)

    def _take(self, kind, mb):
        fut, buf = self.posted.pop((kind, mb))
        fut.result()
        self._post_next(kind)
        return buf

    def _recv_forward(self, a: RecvForward) -> None:
        self.recv_fwd[a.mb] = self._take(RecvForward, a.mb)

    def _recv_backward(self, a: RecvBackward) -> None:
        self.recv_bwd[a.mb] = self._take(RecvBackward, a.mb)

    def _send_forward(self, a: SendForward) -> None:
        y = self.out_fwd.pop(a.mb)
        t0 = time.perf_counter()
        fut = self.p2p.isend_forward(y)
        self._comm_event(fut, f"sf{a.mb}", t0)
        self.sends.append((fut, y))

    def _send_backward(self, a: SendBackward) -> None:
        dx = self.out_bwd.pop(a.mb)
        t0 = time.perf_counter()
        fut = self.p2p.isend_backward(dx)
        self._comm_event(fut, f"sb{a.mb}", t0)
        self.sends.append((fut, dx))

    def _poll_sends(self) -> None:
        if self.sends and self.sends[0][0].done():
            keep = []
            for fut, buf in self.sends:
                if fut.done():
                    fut.result()
                    self.ledger.free(buf)
                else:
                    keep.append((fut, buf))
            self.sends = keep

    def _finish_sends(self) -> None:
        for fut, buf in self.sends:
            fut.result()
            self.ledger.free(buf)
        self.sends = []

    def _comm_event(self, fut, name, t0) -> None:
        step = self.step

        def done(_f, name=name, t0=t0, step=step):
            self._event(name, "comm", t0, time.perf_counter(), 1, {"step": step})

        fut.add_done_callback(done)

    # -- lifecycle --------------------------------------------------------------------------

    def _alloc_grad(self, a: AllocGrad) -> None:
        if not self.state.has_grad(a.block):  # tied: the head's backward may have made embed's
            self.state.alloc_grad(a.block)

    def _materialize_view(self, a: MaterializeView) -> None:
        with self._pace_memory(self._view_bytes(a.block)):
            view = self.state.materialize_view(a.block)
        if a.gather and self.dp > 1:  # the other replicas' segments, in the engine
            t0 = time.perf_counter()
            fut = self.engine.allgather(view, self.topo.dp_comm)
            self._comm_event(fut, f"allgather {a.block}", t0)
            self.gathers[a.block] = fut

    def _wait_view(self, a: WaitView) -> None:
        fut = self.gathers.pop(a.block, None)
        if fut is not None:
            fut.result()

    def _materialize_now(self, block: str) -> None:
        """Make a view outside the schedule (eval, measurement): cast, gather, wait."""
        self._materialize_view(MaterializeView(block, gather=self.sharded))
        self._wait_view(WaitView(block))

    def _sync_grad(self, a: SyncGrad) -> None:
        for b in a.blocks:  # one ring collective per block: the same order under every policy
            if self.dp > 1:
                t0 = time.perf_counter()
                g = self.state.grad_flat(b)
                if a.scatter:  # replica q ends with the reduced segment q
                    fut = self.engine.reduce_scatter(g, self.topo.dp_comm)
                else:
                    fut = self.engine.allreduce(g, self.topo.dp_comm, algo="ring")
                self._comm_event(fut, f"{'reduce_scatter' if a.scatter else 'allreduce'} {b}", t0)
            else:
                fut = _done()
            self.syncs[b] = fut

    def _wait_grad(self, a: WaitGrad) -> None:
        for b in a.blocks:
            self.syncs.pop(b).result()
            if a.scatter:
                seg = self.state.shrink_grad(b)  # only the own segment is needed from here
            else:  # this replica's share of the norm work: its ring segment of the block
                n = self.state.block(b).size
                lo, hi = segment_bounds(n, self.replica, self.dp)
                seg = self.state.grad_flat(b)[lo:hi]
            self.sq[b] = _sq_norm(seg, self.ctx.xp)

    def _grad_norm(self, a: GradNorm) -> None:
        nb, nl, dp = self.num_global_blocks * self.dp, self.m * self.dp, self.dp
        vec = np.zeros(nb + nl + self.world, np.float64)
        for b, s in self.sq.items():  # (global block, dp segment): one contributor each
            vec[self.global_index[b] * dp + self.replica] = s
        if self.stage == self.pp - 1:
            for mb, loss in self.losses.items():
                vec[nb + self.replica * self.m + mb] = loss
        vec[nb + nl + self.rank] = self.ledger.peak
        vec = self._allreduce_world(vec)

        loss_scale = self.scaler.scale
        grad_norm = global_grad_norm(vec[:nb].tolist(), loss_scale, segments=dp)
        found_inf = not math.isfinite(grad_norm)
        skipped = self.scaler.update(found_inf)
        lr = lr_at(self.step, self.cfg.optim, self.total_steps)
        if skipped:
            self._pending = _Pending(0, lr, 0.0, True)
        else:
            self._adam_t += 1
            scale = grad_scale_for(grad_norm, self.cfg.optim.grad_clip, loss_scale)
            self._pending = _Pending(self._adam_t, lr, scale, False)
        self._result = StepResult(
            step=self.step,
            loss=float(sum(vec[nb : nb + nl].tolist()) / nl),
            grad_norm=grad_norm,
            lr=lr,
            loss_scale=loss_scale,
            skipped=skipped,
            peak_ddr_bytes=int(vec[nb + nl :].max()),
            local_peak_ddr_bytes=int(self.ledger.peak),
            step_time_s=0.0,
        )

    def _update(self, a: Update) -> None:
        pend = self._pending
        if not pend.skipped:
            lo, hi = self.state.segment(a.block)
            with self._pace_memory(ADAMW_BYTES_PER_PARAM * (hi - lo)):
                self.opt.update_block(self.state, a.block, pend.t, pend.lr, pend.grad_scale)

    def _view_bytes(self, block: str) -> int:
        """DDR bytes a view's cast moves: read the own fp32 master segment, write the view's
        segment (0 when the view is the master itself)."""
        if not self.state.separate_views:
            return 0
        lo, hi = self.state.segment(block)
        return (4 + np.dtype(self.state.view_dtype).itemsize) * (hi - lo)

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
        self._comm_event(fut, "global facts", t0)
        fut.result()
        return vec

    # -- bookkeeping ------------------------------------------------------------------------

    def _reset_step_state(self) -> None:
        self.step = getattr(self, "step", -1)
        self.caches: dict = {}
        self.losses: dict[int, float] = {}
        self.recv_fwd: dict = {}
        self.recv_bwd: dict = {}
        self.out_fwd: dict = {}
        self.out_bwd: dict = {}
        self.posted: dict = {}
        self.sends: list = []
        self.syncs: dict = {}
        self.sq: dict[str, float] = {}
        self.recv_order = {RecvForward: [], RecvBackward: []}

    def _check_batch(self, inputs, targets) -> None:
        want = (self.m, self.micro_batch, self.cfg.model.seq_len)
        for name, arr, needed in (("inputs", inputs, self.stage == 0),
                                  ("targets", targets, self.stage == self.pp - 1)):
            if needed and (arr is None or tuple(arr.shape) != want):
                got = None if arr is None else tuple(arr.shape)
                raise ValueError(f"rank {self.rank} (stage {self.stage}): {name} of shape {got}, "
                                 f"expected {want} (num_micro_batches, micro_batch, seq_len)")

    def _rank_lists(self, steps: int) -> list[tuple]:
        out, carry = [], False
        for _ in range(steps):
            out.append(self._lists[carry])
            carry = self.policy.carries(self.info)
        out.append(self._flush_list)
        return out

    def _choose_keep(self):
        """Per-layer keep mode from schedule.recompute, and the predicted peak DDR bytes."""
        mode = self.cfg.schedule.recompute
        layers = [b for b in self.blocks if self.kind[b] == "layer"]
        keep = {b: RECOMPUTE_KEEP.get(mode, "all") for b in layers}
        sizes = self._measure_sizes(keep)
        lists = self._rank_lists(2)[:2]
        if mode == "auto":
            chosen, peak = choose_recompute(self.ledger.cap, sizes, lists, self.blocks)
            return {b: chosen.get(b, "all") for b in layers}, peak
        return keep, simulate_peak(lists, self.blocks, StageSizes(**{**sizes.__dict__, "keep": keep}))

    def _measure_sizes(self, keep) -> StageSizes:
        """Activation bytes per keep mode, measured from the kernels' caches on zero inputs."""
        ctx, xp = self.ctx, self.ctx.xp
        shape = self._act_shape()
        made = [b for b in self.blocks if not self.state.has_view(b)]
        act: dict[str, dict[str, int]] = {}
        full: dict[str, int] = {}
        x = xp.zeros(shape, ctx.dtype)
        ids = xp.zeros(shape[:2], np.int64)
        try:
            layer_sizes = None
            for b in self.blocks:
                kind = self.kind[b]
                if kind == "layer" and layer_sizes is not None:
                    act[b], full[b] = dict(layer_sizes), layer_sizes["all"]
                    continue
                self._materialize_now(b)
                if self.tied and kind == "head" and not self.state.has_view("embed"):
                    self._materialize_now("embed")
                p = self._view(b)
                if kind == "embed":
                    _, c = L.embed_forward(ids, p, ctx)
                    act[b] = {"all": L.cache_nbytes(c)}
                elif kind == "head":
                    _, c = L.head_forward(x, ids, p, ctx)
                    act[b] = {"all": L.cache_nbytes(c)}
                else:
                    layer_sizes = {k: L.cache_nbytes(L.layer_forward(x, p, ctx, k)[1])
                                   for k in L.KEEP}
                    act[b] = dict(layer_sizes)
                full[b] = act[b]["all"]
        finally:
            for b in made:
                self.state.drop_view(b)
        params = {b.name: b.size for b in self.state.blocks}
        item = np.dtype(ctx.dtype).itemsize
        extra = L.layer_workspace_nbytes(ctx, self.micro_batch, self.cfg.model.seq_len,
                                          backward=True)
        if self.info.fp16:
            extra += 4 * max(params.values())  # fp32 GEMM copies of a block's weights
        return StageSizes(
            precision=self.cfg.precision, params=params, act=act, full_act=full,
            message_bytes=int(np.prod(shape)) * item,
            static=self.ledger.current - sum(4 * params[b] for b in self.blocks
                                             if self.state.has_grad(b)),
            extra=extra, keep=keep, shards=self.info.shards)


def _category(a) -> str:
    if isinstance(a, (Forward, Backward)):
        return "compute"
    if isinstance(a, (RecvForward, RecvBackward, SendForward, SendBackward)):
        return "p2p"
    return "lifecycle"


__all__ = ["Executor", "StepResult"]
