"""The memory model of one rank: what a stage holds, when, under a lifecycle policy.

A rank holds, on top of its static state (fp32 masters and AdamW moments, 12 bytes per
parameter; with the optimizer state sharded over `shards` dp replicas, 12 bytes per parameter
of its segment, the largest segment being ceil(n / shards) of a block's n), working views
(fp16: 2 bytes per parameter while materialised; fp32: none, the view is the master, unless
sharded: 4), fp32 gradients (4 bytes per parameter while allocated; sharded, only the own
segment after the block's reduce-scatter is waited for), the activations each block keeps per
micro-batch in flight (by its recompute mode), the pipeline's message buffers, and transients
(a recomputed layer's full activations during its backward, the optimizer's scratch of the
updated part). `simulate_peak` plays a rank's action lists (`ratrain.lifecycle`) with
these sizes and returns the peak, so the same model serves the executor's `recompute: auto`
(with activation sizes measured from the kernels' caches) and the planner (with sizes computed
from shapes by `layer_activation_bytes`).

    act = {"all": ..., "input": ...}                # bytes per layer per micro-batch, by keep
    keep = choose_recompute(cap, sizes, lists)      # fewest layers recomputed that fit
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ratrain.lifecycle.schedule import (
    AllocGrad,
    Backward,
    DropView,
    Forward,
    FreeGrad,
    MaterializeView,
    RecvBackward,
    RecvForward,
    SendBackward,
    SendForward,
    Update,
    WaitGrad,
    expand,
)

STATIC_BYTES_PER_PARAM = 12  # fp32 master + AdamW m and v
GRAD_BYTES_PER_PARAM = 4


def view_bytes_per_param(precision: str, shards: int = 1) -> int:
    """Bytes per parameter of a materialised working view (0: the view is the master)."""
    if precision == "fp16":
        return 2
    return 4 if shards > 1 else 0


def shard_size(n: int, shards: int = 1) -> int:
    """The largest dp segment of n elements (the ring's segments differ by at most one)."""
    return -(-n // shards)


def act_itemsize(precision: str) -> int:
    return 2 if precision == "fp16" else 4


def layer_activation_bytes(model, micro_batch: int, precision: str, keep: str) -> int:
    """Bytes one decoder layer keeps per micro-batch, from shapes (for the planner).

    Counted as the kernels keep them: `input` = the layer input only; `selective` = the inputs
    of the GEMMs and norms (x, normed x, q, k, v, attention output, mlp input, gate and up);
    `all` adds the cheap, memory-heavy intermediates (SwiGLU activation, RMSNorm statistics,
    attention softmax statistics). Within 10-20% of the measured caches; the executor measures.
    """
    b, t, h, f = micro_batch, model.seq_len, model.hidden, model.ffn_hidden
    kv = model.kv_heads * model.head_dim
    e = act_itemsize(precision)
    x = b * t * h * e
    if keep == "input":
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
    if keep == "selective":
        return sel
    return sel + b * t * f * e + x  # SwiGLU output, mlp-norm input copy


@dataclass
class StageSizes:
    """Byte sizes the model plays with, for one rank."""

    precision: str
    params: dict[str, int]  # block -> parameter count
    act: dict[str, dict[str, int]]  # block -> keep -> bytes kept per micro-batch
    full_act: dict[str, int]  # block -> bytes of a full forward (a recompute's transient)
    message_bytes: int = 0  # one activation / gradient message between stages
    static: int | None = None  # default: 12 bytes per parameter
    extra: int = 0  # anything else resident (scratch reserve, comm buffers)
    keep: dict[str, str] = field(default_factory=dict)  # block -> keep mode ("all" if absent)
    shards: int = 1  # dp segments of the optimizer state (1: whole blocks on every replica)

    def kept(self, block: str) -> int:
        modes = self.act[block]
        return modes.get(self.keep.get(block, "all"), modes.get("all", 0))


def simulate_peak(lists, blocks, sizes: StageSizes) -> int:
    """Peak bytes of a rank running `lists` (successive steps) in order, from nothing held."""
    shards = sizes.shards
    separate = sizes.precision == "fp16" or shards > 1  # views are buffers of their own
    vb = view_bytes_per_param(sizes.precision, shards)
    static = sizes.static if sizes.static is not None else (
        STATIC_BYTES_PER_PARAM * sum(shard_size(sizes.params[b], shards) for b in blocks))
    cur = static + sizes.extra
    peak = cur
    views: set[str] = set()
    grads: dict[str, int] = {}  # block -> bytes held
    msgs = 0

    def bump(extra: int = 0):
        nonlocal peak
        peak = max(peak, cur + extra)

    for actions in lists:
        for a in actions:
            for blk, e in expand(a, blocks):
                if isinstance(e, Forward):
                    cur += sizes.kept(blk)
                    bump(sizes.full_act.get(blk, 0) - sizes.kept(blk))
                elif isinstance(e, Backward):
                    # a recomputed layer holds its full activations again while it runs backward
                    bump(sizes.full_act.get(blk, 0))
                    cur -= sizes.kept(blk)
                elif isinstance(e, MaterializeView) and separate and e.block not in views:
                    views.add(e.block)
                    cur += vb * sizes.params[e.block]
                elif isinstance(e, DropView) and e.block in views:
                    views.discard(e.block)
                    cur -= vb * sizes.params[e.block]
                elif isinstance(e, AllocGrad):
                    grads[e.block] = GRAD_BYTES_PER_PARAM * sizes.params[e.block]
                    cur += grads[e.block]
                elif isinstance(e, WaitGrad) and e.scatter:  # keep the own segment only
                    for b in e.blocks:
                        seg = GRAD_BYTES_PER_PARAM * shard_size(sizes.params[b], shards)
                        if grads.get(b, 0) > seg:
                            bump(seg)  # the segment's copy, next to the whole buffer
                            cur -= grads[b] - seg
                            grads[b] = seg
                elif isinstance(e, FreeGrad) and e.block in grads:
                    cur -= grads.pop(e.block)
                elif isinstance(e, Update):  # the optimizer's scratch of the updated part
                    bump(4 * shard_size(sizes.params[e.block], shards))
                elif isinstance(e, (RecvForward, RecvBackward, SendForward, SendBackward)):
                    # a received input lives until its backward; sends and gradients briefly
                    if isinstance(e, RecvForward):
                        msgs += 1
                        cur += sizes.message_bytes
                    else:
                        bump(sizes.message_bytes)
                bump()
                if isinstance(e, Backward) and blk == blocks[0] and msgs:
                    msgs -= 1
                    cur -= sizes.message_bytes
    return int(peak)


def choose_recompute(cap: int, sizes: StageSizes, lists, blocks) -> tuple[dict[str, str], int]:
    """The fewest layers recomputed (keep="input", the first ones of the stage) whose simulated
    peak fits `cap`; returns ({block: keep}, peak). All layers recomputed when nothing fits."""
    layers = [b for b in blocks if b.startswith("layers.")]
    best = None
    for k in range(len(layers) + 1):
        keep = {b: ("input" if i < k else "all") for i, b in enumerate(layers)}
        trial = StageSizes(**{**sizes.__dict__, "keep": keep})
        peak = simulate_peak(lists, blocks, trial)
        best = (keep, peak)
        if cap is None or peak <= cap:
            return best
    return best


__all__ = [
    "GRAD_BYTES_PER_PARAM",
    "STATIC_BYTES_PER_PARAM",
    "StageSizes",
    "act_itemsize",
    "choose_recompute",
    "layer_activation_bytes",
    "shard_size",
    "simulate_peak",
    "view_bytes_per_param",
]
