"""Compute kernels of a LLaMA-family decoder, as pure functions over an array module `xp`.

Every kernel is a pair `*_forward(..., xp) -> (y, cache)` / `*_backward(dy, cache, xp) -> grads`
(llm.c's and ShallowSpeed's style): no globals, no MPI, `xp` is numpy or cupy. Arithmetic runs in
the *compute type* of the inputs: float64 stays float64 (finite-difference tests), float32,
float16 and bfloat16 compute in float32 (norms, softmax, loss and every reduction in fp32 in the
16-bit precisions).
Python scalars are used for constants so that float32 arrays are never promoted to float64.

Shapes: B batch, T sequence, C hidden, H query heads, KV key/value heads (H % KV == 0, G = H / KV
query heads share one kv head, head h uses kv head h // G as Hugging Face's `repeat_kv`), D head
size, F MLP hidden, V vocabulary. Weights use the Hugging Face layout (out, in): y = x @ W.T.

These are the plain references: the kernel table (`exec.backends`) puts a fast path (`fused` on
the host, `devkernels` on a GPU) in their place where one applies, and the tests check each fast
path against them. Attention here materialises the (T, T) scores: the reference of the
attention backends (`exec.attention`), which the layers call through the table.
"""

from __future__ import annotations

import functools
import inspect
import math

import ml_dtypes
import numpy as np

from ratrain.device import is_host, module_of
from ratrain.exec.profile import timed

NEG_INF = -math.inf
BF16 = np.dtype(ml_dtypes.bfloat16)  # bfloat16: ml_dtypes' dtype, numpy's and cupy's alike
HALF_DTYPES = (np.dtype(np.float16), BF16)
# each precision's dtype of activations and working views (fp64: finite-difference tests)
DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": BF16,
          "fp64": np.dtype(np.float64)}


def is_half_dtype(dtype) -> bool:
    """Whether `dtype` is a 16-bit float (float16 or bfloat16), computed in float32."""
    return np.dtype(dtype) in HALF_DTYPES


def compute_dtype(*arrays):
    """float64 if any input is float64, else float32 (float16 and bfloat16 compute in float32)."""
    for a in arrays:
        if a.dtype == np.float64:
            return np.dtype(np.float64)
    return np.dtype(np.float32)


def as_dtype(a, dt):
    """`a` in dtype `dt`: itself when it has it, else a copy (the reference of `fused.cast`)."""
    return a if a.dtype == dt else a.astype(dt)


def assign(dst, src) -> None:
    """dst[...] = src, cast to dst's dtype (the reference of `fused.assign`)."""
    dst[...] = src


def rounds_once(fn):
    """A reference that takes `out` (an array, or a tuple of them), made to round once into a
    16-bit `out`: it then computes into new arrays in the compute type and casts each result
    into `out`, the bits of a cast of what it returns without `out`. (Written into a 16-bit
    `out` directly, its intermediate steps would be rounded too.) A device's 16-bit layout
    hands the references such outs where its kernels write 16 bits themselves."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        out = bound.arguments.get("out")
        outs = out if isinstance(out, tuple) else (out,)
        if not any(o is not None and is_half_dtype(o.dtype) for o in outs):
            return fn(*args, **kwargs)
        bound.arguments["out"] = None
        r = fn(*bound.args, **bound.kwargs)
        if isinstance(out, tuple):  # results first, in `out`'s order
            for o, v in zip(out, r):
                assign(o, v)
            return (*out, *r[len(out):])
        if isinstance(r, tuple):  # (result, cache)
            assign(out, r[0])
            return (out, *r[1:])
        assign(out, r)
        return out

    return call


# --------------------------------------------------------------------------------------------
# Linear (plain; the layers use ratrain.exec.gemm for fp16 operands and fused weights)
# --------------------------------------------------------------------------------------------


def linear_forward(x, w, xp):
    """x (..., IN) @ w.T, w (OUT, IN) -> y (..., OUT)."""
    y = xp.matmul(x, w.T)  # (..., OUT)
    return y, (x, w)


def linear_backward(dy, cache, xp):
    """-> (dx (..., IN), dw (OUT, IN))."""
    x, w = cache
    dx = xp.matmul(dy, w)  # (..., IN)
    dw = xp.matmul(dy.reshape(-1, dy.shape[-1]).T, x.reshape(-1, x.shape[-1]))  # (OUT, IN)
    return dx, dw


# --------------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------------


@timed("embedding")
def embedding_forward(ids, w, xp):
    """ids (B, T) integer -> x (B, T, C) in w's dtype (a gather of rows of w (V, C))."""
    x = xp.take(w, ids, axis=0)  # (B, T, C)
    return x, (ids, w.shape)


@timed("embedding")
def embedding_backward(dx, cache, xp, dw=None):
    """Scatter-add dx (B, T, C) into dw (V, C) (a new zero array unless given); returns dw."""
    ids, wshape = cache
    if dw is None:
        dw = xp.zeros(wshape, compute_dtype(dx))
    flat = ids.reshape(-1)
    if not is_host(xp):
        _embedding_backward_device(dx.reshape(-1, wshape[1]), flat, dw, xp)
        return dw
    order = xp.argsort(flat, kind="stable")  # rows of each token id together, in order
    sid = flat[order]
    starts = xp.flatnonzero(xp.concatenate([xp.ones(1, bool), sid[1:] != sid[:-1]]))
    rows = as_dtype(dx.reshape(-1, wshape[1])[order], dw.dtype)  # (N, C) sorted by id
    dw[sid[starts]] += xp.add.reduceat(rows, starts, axis=0)  # unique ids: no collisions
    return dw


EMBED_ROWS = 4096  # vocabulary rows per pass of the device's embedding gradient


def _embedding_backward_device(rows, flat, dw, xp) -> None:
    """dw[id] += the sum of rows (N, C) whose token is id, on a device: deterministic (no
    atomic adds, whose order changes from run to run, so the policies stay bitwise equal) and
    with no host sync (no `nonzero`). The rows sorted by id are prefix-summed
    in float64; id's sum is the difference of the prefix sums at the ends of its run, which
    `bincount` and its cumulative sum locate for every id at once, EMBED_ROWS ids a pass (an id
    absent from the batch gets exactly 0)."""
    V, C = dw.shape
    order = xp.argsort(flat)  # cupy's sort is stable; any fixed order gives the same runs
    prefix = xp.zeros((rows.shape[0] + 1, C), xp.float64)
    xp.cumsum(rows[order].astype(xp.float64), axis=0, out=prefix[1:])
    ends = xp.zeros(V + 1, xp.int64)  # ends[v + 1]: the end of id v's run, ends[v] its start
    xp.cumsum(xp.bincount(flat, minlength=V), out=ends[1:])
    for v0 in range(0, V, EMBED_ROWS):
        v1 = min(V, v0 + EMBED_ROWS)
        at = prefix[ends[v0 : v1 + 1]]  # (v1 - v0 + 1, C): the prefix sums at the runs' ends
        dw[v0:v1] += (at[1:] - at[:-1]).astype(dw.dtype)


# --------------------------------------------------------------------------------------------
# RMSNorm: y = x / sqrt(mean(x^2) + eps) * w
# --------------------------------------------------------------------------------------------


@timed("rmsnorm")
@rounds_once
def rmsnorm_forward(x, w, eps, xp, out=None, x_copy=None):
    """x (..., C), w (C,) -> y (..., C) in the compute type; cache (x, rstd, w). `x_copy`:
    also x, in that array's dtype (a device's layers take the layer input's fp32 copy, and
    h's 16-bit one, from the norm's pass)."""
    if x_copy is not None:
        assign(x_copy, x)
    ct = compute_dtype(x, w)
    x = as_dtype(x, ct)
    y = xp.multiply(x, x, out=out)  # (..., C) scratch for x^2
    rstd = y.mean(axis=-1, keepdims=True, dtype=ct)  # (..., 1)
    rstd += eps
    xp.sqrt(rstd, out=rstd)
    xp.reciprocal(rstd, out=rstd)
    xp.multiply(x, rstd, out=y)
    y *= as_dtype(w, ct)
    return y, (x, rstd, w)


@timed("rmsnorm")
@rounds_once
def rmsnorm_recompute(x, rstd, w, xp, out=None):
    """The forward's y = x * rstd * w again, from its kept statistics rstd (..., 1), in the
    compute type: the backward's normed input for a weight gradient (x: what the forward
    normed, or its 16-bit copy)."""
    ct = compute_dtype(x, w)
    y = as_dtype(x, ct) * rstd
    y *= as_dtype(w, ct)
    return y


@timed("rmsnorm")
def rmsnorm_backward(dy, cache, xp, residual=None, out=None, copy_out=None):
    """-> (dx (..., C), dw (C,)), in the compute type (the cache's x: what the forward normed,
    or its 16-bit copy). `residual` (any dtype) is added to dx: the residual stream's gradient,
    which a layer's backward adds to what comes back through a norm. dx is rounded once into
    `out` when given (any dtype), and into `copy_out` too (a second dtype: a device's layers
    take dh in fp32 for the residual and in 16 bits for its GEMMs)."""
    x, rstd, w = cache
    ct = compute_dtype(x, dy, w)
    x, dy = as_dtype(x, ct), as_dtype(dy, ct)
    xhat = x * rstd  # (..., C)
    dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)  # (C,)
    gy = dy * as_dtype(w, ct)  # (..., C)
    m = (gy * xhat).mean(axis=-1, keepdims=True, dtype=ct)  # (..., 1)
    xhat *= m
    gy -= xhat
    gy *= rstd  # dx
    if residual is not None:
        gy += as_dtype(residual, ct)
    if copy_out is not None:
        assign(copy_out, gy)
    if out is not None:
        assign(out, gy)
        gy = out
    return gy, dw


# --------------------------------------------------------------------------------------------
# Rotary position embedding (Hugging Face LLaMA convention)
# --------------------------------------------------------------------------------------------


def rope_tables(seq_len, head_dim, theta, xp=np, dtype=np.float32):
    """cos, sin (T, D) as transformers' LlamaRotaryEmbedding builds them: inv_freq =
    1 / theta^(arange(0, D, 2) / D) in fp32, angles = positions x inv_freq in fp32, the
    halves concatenated (emb = cat(freqs, freqs)), cos and sin rounded to fp32."""
    inv_freq = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim))
    freqs = np.arange(seq_len, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)  # (T, D)
    # rounded to fp32 as transformers does (its tables are fp32 whatever the model dtype)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    return xp.asarray(cos.astype(dtype)), xp.asarray(sin.astype(dtype))


@timed("rope")
@rounds_once
def rope_forward(x, cos, sin, xp, out=None):
    """y = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).

    x (..., D); cos, sin broadcastable to x ((T, D) for x (B, H, T, D), (T, 1, D) for
    x (B, T, H, D)). `out` may be a strided view (the layers write the head-major layout)."""
    ct = compute_dtype(x, cos)
    if out is None:
        out = xp.empty(x.shape, ct)
    d = x.shape[-1] // 2
    c, s = as_dtype(cos[..., :d], ct), as_dtype(sin[..., :d], ct)  # the halves are equal
    x1, x2 = x[..., :d], x[..., d:]
    o1, o2 = out[..., :d], out[..., d:]
    xp.multiply(x1, c, out=o1)
    o1 -= x2 * s
    xp.multiply(x2, c, out=o2)
    o2 += x1 * s
    return out, (cos, sin)


@timed("rope")
@rounds_once
def rope_backward(dy, cache, xp, out=None):
    """dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T(z) = cat(z2, -z1)."""
    cos, sin = cache
    ct = compute_dtype(dy, cos)
    if out is None:
        out = xp.empty(dy.shape, ct)
    d = dy.shape[-1] // 2
    c, s = as_dtype(cos[..., :d], ct), as_dtype(sin[..., :d], ct)
    g1, g2 = dy[..., :d], dy[..., d:]
    o1, o2 = out[..., :d], out[..., d:]
    xp.multiply(g1, c, out=o1)
    o1 += g2 * s
    xp.multiply(g2, c, out=o2)
    o2 -= g1 * s
    return out


# --------------------------------------------------------------------------------------------
# Causal grouped-query attention: plain reference
# --------------------------------------------------------------------------------------------


def gqa_shape(q, k):
    """(B, H, T, D, KV, G) of q (B, H, T, D) and k (B, KV, T, D); G = H / KV query heads a kv head."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    if H % KV:
        raise ValueError(f"attention: {H} query heads is not a multiple of {KV} kv heads")
    return B, H, T, D, KV, H // KV


def attention_forward(q, k, v, xp):
    """Causal softmax(q k^T / sqrt(D)) v. q (B, H, T, D); k, v (B, KV, T, D) -> o (B, H, T, D).
    Materialises the (B, H, T, T) probabilities: the reference for the blocked kernel."""
    B, H, T, D, KV, G = gqa_shape(q, k)
    ct = compute_dtype(q, k, v)
    qg = as_dtype(q, ct).reshape(B, KV, G, T, D)
    kg, vg = as_dtype(k, ct)[:, :, None], as_dtype(v, ct)[:, :, None]  # (B, KV, 1, T, D)
    s = xp.matmul(qg, kg.swapaxes(-1, -2)) * (1.0 / math.sqrt(D))  # (B, KV, G, T, T)
    mask = xp.triu(xp.ones((T, T), dtype=bool), k=1)
    s = xp.where(mask, NEG_INF, s)
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = xp.matmul(p, vg).reshape(B, H, T, D)  # (B, H, T, D)
    return o, (qg, kg, vg, p)


def attention_backward(do, cache, xp):
    """-> (dq (B, H, T, D), dk (B, KV, T, D), dv (B, KV, T, D))."""
    qg, kg, vg, p = cache
    B, KV, G, T, D = qg.shape
    dog = as_dtype(do, p.dtype).reshape(B, KV, G, T, D)
    dv = xp.matmul(p.swapaxes(-1, -2), dog).sum(axis=2)  # (B, KV, T, D)
    dp = xp.matmul(dog, vg.swapaxes(-1, -2))  # (B, KV, G, T, T)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    ds *= 1.0 / math.sqrt(D)
    dq = xp.matmul(ds, kg).reshape(B, KV * G, T, D)  # (B, H, T, D)
    dk = xp.matmul(ds.swapaxes(-1, -2), qg).sum(axis=2)  # (B, KV, T, D)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# SwiGLU: act = silu(gate) * up
# --------------------------------------------------------------------------------------------


@timed("swiglu")
@rounds_once
def swiglu_forward(gate, up, xp, out=None):
    """act = gate * sigmoid(gate) * up, in the compute type; cache (gate, up)."""
    ct = compute_dtype(gate, up)
    g = as_dtype(gate, ct)
    a = xp.negative(g, out=out) if out is not None else xp.negative(g)  # (..., F)
    xp.exp(a, out=a)
    a += 1.0
    xp.divide(g, a, out=a)  # silu(g)
    a *= as_dtype(up, ct)
    return a, (gate, up)


@timed("swiglu")
@rounds_once
def swiglu_backward(dact, cache, xp, out=None, with_act=False):
    """-> (dgate, dup) in the compute type, written into `out` = (dgate, dup) when given (views
    welcome). `with_act`: also return act = silu(gate) * up, which the sigmoid computed here
    gives for one multiply (a layer's down-projection gradient needs it): (dgate, dup, act),
    act written into `out`'s third array when it has one."""
    gate, up = cache
    ct = compute_dtype(gate, up, dact)
    g, u, da = as_dtype(gate, ct), as_dtype(up, ct), as_dtype(dact, ct)
    dgate, dup, *act_out = out if out is not None else (None, None)
    sig = xp.negative(g)  # (..., F)
    xp.exp(sig, out=sig)
    sig += 1.0
    xp.reciprocal(sig, out=sig)  # sigmoid(g)
    silu = g * sig
    act = xp.multiply(silu, u, out=act_out[0] if act_out else None) if with_act else None
    dup = xp.multiply(da, silu, out=dup)
    # d silu / dg = sig * (1 + g * (1 - sig)) = sig + silu - silu * sig
    t = silu * sig
    xp.subtract(silu, t, out=t)
    t += sig
    dgate = xp.multiply(da, u, out=dgate)
    dgate *= t
    return (dgate, dup, act) if with_act else (dgate, dup)


def mlp_forward(x, w_gate, w_up, w_down, xp):
    """SwiGLU MLP: (silu(x Wg^T) * x Wu^T) Wd^T. x (..., C) -> (..., C)."""
    g, cg = linear_forward(x, w_gate, xp)
    u, cu = linear_forward(x, w_up, xp)
    a, ca = swiglu_forward(g, u, xp)
    y, cd = linear_forward(a, w_down, xp)
    return y, (cg, cu, ca, cd)


def mlp_backward(dy, cache, xp):
    """-> (dx, dw_gate, dw_up, dw_down)."""
    cg, cu, ca, cd = cache
    da, dwd = linear_backward(dy, cd, xp)
    dg, du = swiglu_backward(da, ca, xp)
    dxg, dwg = linear_backward(dg, cg, xp)
    dxu, dwu = linear_backward(du, cu, xp)
    return dxg + dxu, dwg, dwu, dwd


# --------------------------------------------------------------------------------------------
# The gradient norm's sum of squares
# --------------------------------------------------------------------------------------------


NORM_CHUNK = 1 << 16  # elements cast to float64 at a time by block_sq_norm (512 KiB)


@timed("grad norm")
def block_sq_norm(grad_flat, xp=None):
    """Sum of squares of a block's fp32 gradient, accumulated in float64: a Python float on
    the host, a 0-d float64 array on a device (no host sync: the executor downloads a step's
    sums together).

    Deterministic: the block is summed in fixed chunks in order (the fused form on a device,
    `devkernels.sum_squares`, in an order fixed by the size), so every rank holding the block
    computes the same value. inf / nan in the gradient make the result non-finite.
    """
    if xp is None:
        xp = module_of(grad_flat)
    total = xp.zeros((), xp.float64)  # stays on the device until the end
    n = grad_flat.shape[0]
    for i in range(0, n, NORM_CHUNK):
        c = grad_flat[i : i + NORM_CHUNK].astype(xp.float64)  # (chunk,)
        total += xp.sum(c * c)  # pairwise summation: deterministic, thread-count independent
    return float(total) if is_host(xp) else total


# --------------------------------------------------------------------------------------------
# Cross-entropy (mean over tokens), numerically stable
# --------------------------------------------------------------------------------------------


def cross_entropy_forward(logits, targets, xp):
    """logits (N, V), targets (N,) integer -> mean_n(logsumexp(logits_n) - logits_n[t_n]).

    Computed in the compute type with the row max subtracted. Returns (loss 0-d, cache)."""
    ct = compute_dtype(logits)
    z = as_dtype(logits, ct)
    lse, losses = cross_entropy_rows(z, targets, xp)  # (N,) each
    return losses.mean(dtype=ct), (z, targets, lse)


def cross_entropy_rows(z, targets, xp, out=None, grad=None):
    """The head's forward on rows of logits z (N, V) and their targets (N,): (lse, losses) in
    the compute type of z (fp32 for 16-bit logits; or written into `out` = (lse, losses)),
    lse = logsumexp_rows(z) and losses = lse - z[n, t_n].

    `grad` (a float): z is then overwritten by its rows' gradient, (softmax(z) -
    onehot(targets)) * grad, computed in the compute type and rounded once into z's dtype
    (`cross_entropy_grad` of the whole rows): the head computed once (`exec.head`)."""
    zc = as_dtype(z, compute_dtype(z))
    lse = logsumexp_rows(zc, xp)  # (N,)
    picked = zc[xp.arange(z.shape[0]), targets]  # (N,)
    if out is None:
        out = (lse, lse - picked)
    else:
        out[0][...] = lse
        xp.subtract(out[0], picked, out=out[1])
    if grad is not None:
        cross_entropy_grad(zc, targets, lse, grad, xp, out=None if zc is z else z)
    return out


@timed("head")
def logsumexp_rows(z, xp):
    """log(sum(exp(z), -1)) of rows of z (N, V), with the max subtracted first."""
    m = z.max(axis=-1, keepdims=True)  # (N, 1)
    e = z - m
    xp.exp(e, out=e)
    return xp.log(e.sum(axis=-1, dtype=z.dtype)) + m[:, 0]  # (N,)


def cross_entropy_backward(dloss, cache, xp):
    """-> dlogits (N, V) = (softmax(logits) - onehot(targets)) * dloss / N."""
    z, targets, lse = cache
    return cross_entropy_grad(z.copy(), targets, lse, float(dloss) / z.shape[0], xp)


def cross_entropy_grad(z, targets, lse, scale, xp, v0=0, out=None):
    """The head's backward on the vocabulary's columns [v0, v0 + W): from their logits z (N, W),
    the targets (N,) and the rows' lse (N,), dlogits = (exp(z - lse) - onehot(targets - v0)) *
    scale, computed over z (which it overwrites) and returned, or rounded into `out`."""
    n, w = z.shape
    z -= lse[:, None]
    xp.exp(z, out=z)  # softmax
    col = targets if v0 == 0 else targets - v0  # (N,) each target's column in this chunk
    at = xp.clip(col, 0, w - 1)  # a column in range (0 is subtracted where the target is not)
    z[xp.arange(n), at] -= (col == at).astype(z.dtype)
    z *= scale
    if out is None:
        return z
    assign(out, z)
    return out


__all__ = [
    "BF16",
    "DTYPES",
    "HALF_DTYPES",
    "as_dtype",
    "assign",
    "attention_backward",
    "attention_forward",
    "block_sq_norm",
    "compute_dtype",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "cross_entropy_grad",
    "cross_entropy_rows",
    "embedding_backward",
    "embedding_forward",
    "gqa_shape",
    "is_half_dtype",
    "linear_backward",
    "linear_forward",
    "logsumexp_rows",
    "mlp_backward",
    "mlp_forward",
    "rmsnorm_backward",
    "rmsnorm_forward",
    "rmsnorm_recompute",
    "rope_backward",
    "rope_forward",
    "rope_tables",
    "rounds_once",
    "swiglu_backward",
    "swiglu_forward",
]
