"""The memory model of one rank: what a stage holds, when, under a lifecycle policy.

A rank holds, on top of its static state (fp32 masters and AdamW moments,
`STATE_BYTES_PER_PARAM` per parameter; with the optimizer state sharded over `shards` dp
replicas, per parameter of its segment, the largest segment being ceil(n / shards) of a block's
n), working views (`view_bytes_per_param`: fp16 2 bytes per parameter while materialised; fp32
none, the view is the master, unless sharded: 4), fp32 gradients (`GRAD_BYTES_PER_PARAM` while
allocated; sharded, only the own segment after the block's reduce-scatter is waited for), the
activations each block keeps per micro-batch in flight (by its recompute choice), the
pipeline's message buffers, and transients (a recomputed layer's full activations during its
backward, the optimizer's scratch of the updated part). `simulate_peak` plays a rank's action
lists with these sizes and returns the peak, so the same model serves the executor's
`recompute: auto` (with activation sizes measured from the kernels' caches,
`runtime.measure`) and the planner (with sizes computed from shapes, `stage_sizes`).

    act = {"none": ..., "full": ...}                      # bytes per layer per micro-batch
    recompute, peak = choose_recompute(cap, sizes, lists) # fewest layers recomputed that fit
    walk = play(lists, blocks, sizes, plan.passes)        # each pass's part: walk.parts[name]

A pass over the step (`lifecycle.passes`) gives the walk its part: the bytes its actions hold
(the memory tier's transfers, `lifecycle.passes.offload.MemoryTier`, with the tier's own peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ratrain.config import act_itemsize, is_half
from ratrain.exec.params import (
    GRAD_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    shard_size,
    view_bytes_per_param,
)
from ratrain.exec.spec import OFFLOAD, RECOMPUTE, block_params, block_role, kernel_recompute
from ratrain.exec.layers import layer_cache_nbytes
from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.schedule import dispatch_table, expand


@dataclass
class StageSizes:
    """Byte sizes the model plays with, for one rank."""

    precision: str
    params: dict[str, int]  # block -> parameter count
    act: dict[str, dict[str, int]]  # block -> recompute choice -> bytes kept per micro-batch
    full_act: dict[str, int]  # block -> bytes of a full forward (a recompute's transient)
    message_bytes: int = 0  # one activation / gradient message between stages
    static: int | None = None  # default: STATE_BYTES_PER_PARAM per held parameter
    extra: int = 0  # anything else resident (scratch reserve, comm buffers)
    recompute: dict[str, str] = field(default_factory=dict)  # block -> choice ("none" if absent)
    shards: int = 1  # dp segments of the optimizer state (1: whole blocks on every replica)

    def kept(self, block: str) -> int:
        """Bytes `block` keeps per micro-batch (an offloaded layer: what it moves to the tier,
        when the sizes say, else what `none` keeps)."""
        modes, choice = self.act[block], self.recompute.get(block, "none")
        if choice in modes:
            return modes[choice]
        return modes.get(kernel_recompute(choice), modes.get("none", 0))

    def with_recompute(self, recompute: dict[str, str]) -> StageSizes:
        return replace(self, recompute=dict(recompute))


def layer_activation_bytes(model, micro_batch: int, precision: str, recompute: str) -> int:
    """Bytes one decoder layer keeps per micro-batch, from shapes (the planner's estimate).

    Counted as the kernels keep them: `full` = the layer input only; `selective` = the inputs
    of the GEMMs and norms (x, normed x, q, k, v, attention output, mlp input, gate and up);
    `none` adds the cheap, memory-heavy intermediates (SwiGLU activation, RMSNorm statistics,
    attention softmax statistics). Within 10-20% of the measured caches; the executor measures.
    """
    b, t, h, f = micro_batch, model.seq_len, model.hidden, model.ffn_hidden
    kv = model.kv_heads * model.head_dim
    e = act_itemsize(precision)
    x = b * t * h * e
    if recompute == "full":
        return x
    sel = (
        x  # input
        + x  # attn-normed input
        + b * t * (h + 2 * kv) * e  # q, k, v (after RoPE)
        + x  # attention output
        + x  # residual / mlp-normed input
        + 2 * b * t * f * e  # gate, up
        + 2 * b * t * 4 * 2  # rms statistics (fp32)
        + b * model.heads * t * 4  # softmax log-sum-exp (fp32)
    )
    if recompute == "selective":
        return sel
    return sel + b * t * f * e + x  # SwiGLU output, mlp-norm input copy


def stage_sizes(model, micro_batch: int, precision: str, blocks,
                recompute: dict[str, str] | None = None, shards: int = 1) -> StageSizes:
    """`StageSizes` of one stage on the platform, from shapes.

    Layers keep `layer_activation_bytes` per micro-batch (and hold their full activations
    while a recomputation runs; an offloaded layer holds its cache as the kernels keep it,
    `exec.layers.layer_cache_nbytes`, while it is written or read); the head keeps its input
    and fp32 statistics; the embedding keeps the token ids. Kernel workspaces are not counted (the platform's fp16 GEMMs need no
    fp32 weight copies, unlike the CPU emulation, whose executor measures its own).
    """
    tokens = micro_batch * model.seq_len
    x = tokens * model.hidden * act_itemsize(precision)
    layer = {r: layer_activation_bytes(model, micro_batch, precision, r) for r in RECOMPUTE}
    # an offloaded layer's cache, as the kernels keep it: the bytes the tier moves
    layer[OFFLOAD] = layer_cache_nbytes(model, micro_batch, precision, "none")
    params, act, full = {}, {}, {}
    for b in blocks:
        role = block_role(b)
        params[b] = block_params(model, role)
        if role == "layer":
            act[b], full[b] = dict(layer), layer["none"]
        elif role == "head":
            act[b] = {"none": x + 3 * 8 * tokens}  # input, fp32 rstd and logsumexp, int64 targets
        else:
            act[b] = {"none": 8 * tokens}  # int64 token ids
    return StageSizes(precision=precision, params=params, act=act, full_act=full,
                      message_bytes=x, recompute=dict(recompute or {}), shards=shards)


class Walk:
    """One rank's bytes held, event by event (see the module); `parts[name]`: each pass's."""

    def __init__(self, blocks, sizes: StageSizes, passes=()):
        self.sizes, self.blocks, self.first_block = sizes, tuple(blocks), blocks[0]
        shards = sizes.shards
        self.separate = is_half(sizes.precision) or shards > 1  # views are buffers of their own
        self.vb = view_bytes_per_param(sizes.precision, shards)
        static = sizes.static if sizes.static is not None else (
            STATE_BYTES_PER_PARAM * sum(shard_size(sizes.params[b], shards) for b in blocks))
        self.cur = static + sizes.extra
        self.views: set[str] = set()
        self.grads: dict[str, int] = {}  # block -> bytes held
        self.msgs = 0  # received activations held until their micro-batch's backward
        self.parts = {p.name: x for p in passes if (x := p.memory(self)) is not None}
        self.peak = self.cur  # after the parts: what a pass keeps out of the DDR is not held
        self.table = dispatch_table("memory.simulate_peak", {
            sched.Forward: self._forward, sched.Backward: self._backward, sched.MaterializeView: self._view,
            sched.DropView: self._drop_view, sched.AllocGrad: self._alloc, sched.WaitGrad: self._wait,
            sched.FreeGrad: self._free, sched.Update: self._update, sched.RecvForward: self._recv_forward,
            sched.SendForward: self._message, sched.RecvBackward: self._message, sched.SendBackward: self._message,
            **{t: f for x in self.parts.values() for t, f in x.handlers().items()},
        }, ignore=(sched.WaitView, sched.SyncGrad, sched.GradNorm), passes=passes)

    def bump(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.cur + extra)

    def event(self, blk, e) -> None:
        self.table[type(e)](blk, e)
        self.bump()

    def _forward(self, blk, e):
        s = self.sizes
        self.cur += s.kept(blk)
        self.bump(s.full_act.get(blk, 0) - s.kept(blk))

    def _backward(self, blk, e):
        # a recomputed layer holds its full activations again while it runs backward
        self.bump(self.sizes.full_act.get(blk, 0))
        self.cur -= self.sizes.kept(blk)
        if blk == self.first_block and self.msgs:  # the stage input's backward: its message goes
            self.bump()
            self.msgs -= 1
            self.cur -= self.sizes.message_bytes

    def _view(self, blk, e):
        if self.separate and e.block not in self.views:
            self.views.add(e.block)
            self.cur += self.vb * self.sizes.params[e.block]

    def _drop_view(self, blk, e):
        if e.block in self.views:
            self.views.discard(e.block)
            self.cur -= self.vb * self.sizes.params[e.block]

    def _alloc(self, blk, e):
        self.grads[e.block] = GRAD_BYTES_PER_PARAM * self.sizes.params[e.block]
        self.cur += self.grads[e.block]

    def _wait(self, blk, e):
        if not e.scatter:
            return
        for b in e.blocks:  # keep the own segment only
            seg = GRAD_BYTES_PER_PARAM * shard_size(self.sizes.params[b], self.sizes.shards)
            if self.grads.get(b, 0) > seg:
                self.bump(seg)  # the segment's copy, next to the whole buffer
                self.cur -= self.grads[b] - seg
                self.grads[b] = seg

    def _free(self, blk, e):
        if e.block in self.grads:
            self.cur -= self.grads.pop(e.block)

    def _update(self, blk, e):  # the optimizer's scratch of the updated part
        self.bump(4 * shard_size(self.sizes.params[e.block], self.sizes.shards))

    def _recv_forward(self, blk, e):  # a received input lives until its backward
        self.msgs += 1
        self.cur += self.sizes.message_bytes

    def _message(self, blk, e):  # sends and gradients are held briefly
        self.bump(self.sizes.message_bytes)


def play(lists, blocks, sizes: StageSizes, passes=()) -> Walk:
    """The walk of a rank running `lists` (successive steps) in order, from nothing held, with
    the plan's `passes` (those whose actions the lists hold)."""
    walk = Walk(blocks, sizes, passes)
    for actions in lists:
        for a in actions:
            for blk, e in expand(a, blocks):
                walk.event(blk, e)
    return walk


def simulate_peak(lists, blocks, sizes: StageSizes, passes=()) -> int:
    """Peak bytes of a rank running `lists` (successive steps) in order, from nothing held."""
    return int(play(lists, blocks, sizes, passes).peak)


def choose_recompute(cap: int | None, sizes: StageSizes, lists, blocks, per_layer: bool = True,
                     passes=()) -> tuple[dict[str, str], int]:
    """The fewest layers fully recomputed (the first ones of the stage) whose simulated peak
    fits `cap`; returns ({layer: recompute choice}, peak). All of them when nothing fits.
    `per_layer=False` (uniform recovery): no layer, or every layer."""
    layers = [b for b in blocks if b.startswith("layers.")]
    counts = range(len(layers) + 1) if per_layer else sorted({0, len(layers)})
    best: tuple[dict[str, str], int] = ({}, 0)
    for k in counts:
        choice = {b: ("full" if i < k else "none") for i, b in enumerate(layers)}
        peak = simulate_peak(lists, blocks, sizes.with_recompute(choice), passes)
        best = (choice, peak)
        if cap is None or peak <= cap:
            return best
    return best


__all__ = ["StageSizes", "Walk", "act_itemsize", "choose_recompute", "layer_activation_bytes",
           "play", "simulate_peak", "stage_sizes"]
