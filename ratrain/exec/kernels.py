"""Compute kernels of a LLaMA-family decoder, as pure functions over an array module `xp`.

Every kernel is a pair `*_forward(..., xp) -> (y, cache)` / `*_backward(dy, cache, xp) -> grads`
(llm.c's and ShallowSpeed's style): no globals, no MPI, `xp` is numpy or cupy. Arithmetic runs in
the *compute type* of the inputs: float64 stays float64 (finite-difference tests), float32 and
float16 compute in float32 (norms, softmax, loss and every reduction in fp32 in fp16 mode).
Python scalars are used for constants so that float32 arrays are never promoted to float64.

Shapes: B batch, T sequence, C hidden, H query heads, KV key/value heads (H % KV == 0, G = H / KV
query heads share one kv head, head h uses kv head h // G as Hugging Face's `repeat_kv`), D head
size, F MLP hidden, V vocabulary. Weights use the Hugging Face layout (out, in): y = x @ W.T.

Attention comes twice: `attention_*` is the plain reference (materialises the (T, T) scores),
`flash_attention_*` the blocked online-softmax version whose transient memory is
O(block^2 + block * D) per (batch, head) whatever T, and whose cache is only (q, k, v, o, lse).
"""

from __future__ import annotations

import math

import numpy as np

from ratrain.exec import devkernels, fused
from ratrain.exec.profile import add_flops, timed

NEG_INF = -math.inf


def compute_dtype(*arrays):
    """float64 if any input is float64, else float32 (float16 computes in float32)."""
    for a in arrays:
        if a.dtype == np.float64:
            return np.dtype(np.float64)
    return np.dtype(np.float32)


def _as(a, dt):
    return a if a.dtype == dt else a.astype(dt)


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
    if xp is not np:
        _embedding_backward_device(dx.reshape(-1, wshape[1]), flat, dw, xp)
        return dw
    order = xp.argsort(flat, kind="stable")  # rows of each token id together, in order
    sid = flat[order]
    starts = xp.flatnonzero(xp.concatenate([xp.ones(1, bool), sid[1:] != sid[:-1]]))
    rows = _as(dx.reshape(-1, wshape[1])[order], dw.dtype)  # (N, C) sorted by id
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
    hi = xp.cumsum(xp.bincount(flat, minlength=V))  # (V,) end of each id's run
    lo = hi - xp.bincount(flat, minlength=V)
    for v0 in range(0, V, EMBED_ROWS):
        v1 = min(V, v0 + EMBED_ROWS)
        dw[v0:v1] += (prefix[hi[v0:v1]] - prefix[lo[v0:v1]]).astype(dw.dtype)


# --------------------------------------------------------------------------------------------
# RMSNorm: y = x / sqrt(mean(x^2) + eps) * w
# --------------------------------------------------------------------------------------------


@timed("rmsnorm")
def rmsnorm_forward(x, w, eps, xp, out=None):
    """x (..., C), w (C,) -> y (..., C) in the compute type; cache (x, rstd, w)."""
    ct = compute_dtype(x, w)
    x = _as(x, ct)
    if devkernels.usable(xp, x, w, out) and x.flags.c_contiguous:
        return devkernels.rmsnorm_forward(x, w, eps, xp, out=out)
    if fused.usable(xp, x, w) and x.flags.c_contiguous:
        y = xp.empty(x.shape, ct) if out is None else out
        rstd = fused.rmsnorm_forward(x.reshape(-1, x.shape[-1]), w, eps,
                                     y.reshape(-1, x.shape[-1]))
        return y, (x, rstd.reshape(*x.shape[:-1], 1), w)
    y = xp.multiply(x, x, out=out)  # (..., C) scratch for x^2
    rstd = y.mean(axis=-1, keepdims=True, dtype=ct)  # (..., 1)
    rstd += eps
    xp.sqrt(rstd, out=rstd)
    xp.reciprocal(rstd, out=rstd)
    xp.multiply(x, rstd, out=y)
    y *= _as(w, ct)
    return y, (x, rstd, w)


@timed("rmsnorm")
def rmsnorm_backward(dy, cache, xp):
    """-> (dx (..., C), dw (C,)), in the compute type."""
    x, rstd, w = cache
    ct = x.dtype
    dy = _as(dy, ct)
    if devkernels.usable(xp, x, dy, w) and x.flags.c_contiguous and dy.flags.c_contiguous:
        return devkernels.rmsnorm_backward(dy, cache, xp)
    if fused.usable(xp, x, dy, w) and x.flags.c_contiguous and dy.flags.c_contiguous:
        dx, dw = fused.rmsnorm_backward(dy.reshape(-1, x.shape[-1]), x.reshape(-1, x.shape[-1]),
                                        rstd, w)
        return dx.reshape(x.shape), dw
    xhat = x * rstd  # (..., C)
    dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)  # (C,)
    gy = dy * _as(w, ct)  # (..., C)
    m = (gy * xhat).mean(axis=-1, keepdims=True, dtype=ct)  # (..., 1)
    xhat *= m
    gy -= xhat
    gy *= rstd  # dx
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
def rope_forward(x, cos, sin, xp, out=None):
    """y = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).

    x (..., D); cos, sin broadcastable to x ((T, D) for x (B, H, T, D), (T, 1, D) for
    x (B, T, H, D)). `out` may be a strided view (the layers write the head-major layout)."""
    ct = compute_dtype(x, cos)
    if devkernels.usable(xp, x, cos, sin, out):
        return devkernels.rope_forward(x, cos, sin, xp, out=out)
    if out is None:
        out = xp.empty(x.shape, ct)
    if x.ndim == 4 and cos.ndim == 3 and fused.usable(xp, x, cos, sin, out):
        return fused.rope(x, cos[:, 0], sin[:, 0], out), (cos, sin)  # (T, 1, D) tables
    d = x.shape[-1] // 2
    c, s = _as(cos[..., :d], ct), _as(sin[..., :d], ct)  # the halves are equal
    x1, x2 = x[..., :d], x[..., d:]
    o1, o2 = out[..., :d], out[..., d:]
    xp.multiply(x1, c, out=o1)
    o1 -= x2 * s
    xp.multiply(x2, c, out=o2)
    o2 += x1 * s
    return out, (cos, sin)


@timed("rope")
def rope_backward(dy, cache, xp, out=None):
    """dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T(z) = cat(z2, -z1)."""
    cos, sin = cache
    ct = compute_dtype(dy, cos)
    if devkernels.usable(xp, dy, cos, sin, out):
        return devkernels.rope_backward(dy, cache, xp, out=out)
    if out is None:
        out = xp.empty(dy.shape, ct)
    if dy.ndim == 4 and cos.ndim == 3 and fused.usable(xp, dy, cos, sin, out):
        return fused.rope(dy, cos[:, 0], sin[:, 0], out, backward=True)  # (T, 1, D) tables
    d = dy.shape[-1] // 2
    c, s = _as(cos[..., :d], ct), _as(sin[..., :d], ct)
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


def _groups(q, k):
    B, H, T, D = q.shape
    KV = k.shape[1]
    if H % KV:
        raise ValueError(f"attention: {H} query heads is not a multiple of {KV} kv heads")
    return B, H, T, D, KV, H // KV


def attention_forward(q, k, v, xp):
    """Causal softmax(q k^T / sqrt(D)) v. q (B, H, T, D); k, v (B, KV, T, D) -> o (B, H, T, D).
    Materialises the (B, H, T, T) probabilities: the reference for the blocked kernel."""
    B, H, T, D, KV, G = _groups(q, k)
    ct = compute_dtype(q, k, v)
    qg = _as(q, ct).reshape(B, KV, G, T, D)
    kg, vg = _as(k, ct)[:, :, None], _as(v, ct)[:, :, None]  # (B, KV, 1, T, D)
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
    dog = _as(do, p.dtype).reshape(B, KV, G, T, D)
    dv = xp.matmul(p.swapaxes(-1, -2), dog).sum(axis=2)  # (B, KV, T, D)
    dp = xp.matmul(dog, vg.swapaxes(-1, -2))  # (B, KV, G, T, T)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    ds *= 1.0 / math.sqrt(D)
    dq = xp.matmul(ds, kg).reshape(B, KV * G, T, D)  # (B, H, T, D)
    dk = xp.matmul(ds.swapaxes(-1, -2), qg).sum(axis=2)  # (B, KV, T, D)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Causal grouped-query attention: blocked online softmax (flash-attention style)
# --------------------------------------------------------------------------------------------


def _causal_bias(i0, i1, j0, j1, ct, xp):
    """(bq, bk) additive mask for query rows i0:i1 against keys j0:j1, or None if all visible."""
    if j1 - 1 <= i0:
        return None
    rows = xp.arange(i0, i1)[:, None]
    cols = xp.arange(j0, j1)[None, :]
    return xp.where(cols > rows, NEG_INF, 0.0).astype(ct)  # (bq, bk)


TILE_BYTES = 256 << 10  # score tiles of a batch group stay in a core's L2 cache


def _batch_groups(B, H, block, itemsize):
    n = max(1, TILE_BYTES // (H * block * block * itemsize))
    return [slice(b0, min(b0 + n, B)) for b0 in range(0, B, n)]


@timed("attention")
def flash_attention_forward(q, k, v, xp, block=128, out=None):
    """Causal GQA attention by blocks of `block` queries x `block` keys with an online softmax.

    q (B, H, T, D); k, v (B, KV, T, D) -> o (B, H, T, D) (written into `out` when given, which
    may be a strided view), cache (q, k, v, o, lse, block) with lse (B, H, T) the log-sum-exp
    of each row of scaled scores. Transient memory: a few (B, H, block, block) tiles."""
    B, H, T, D, KV, G = _groups(q, k)
    ct = compute_dtype(q, k, v)
    q, k, v = _as(q, ct), _as(k, ct), _as(v, ct)
    scale = 1.0 / math.sqrt(D)
    o = xp.empty((B, H, T, D), ct) if out is None else out
    lse = xp.empty((B, H, T), ct)
    for bs in _batch_groups(B, H, block, ct.itemsize):  # a few sequences at a time
        _flash_fwd_group(q[bs], k[bs], v[bs], o[bs], lse[bs], block, scale, xp)
    return o, (q, k, v, o, lse, block)


def _flash_fwd_group(q, k, v, o, lse, block, scale, xp):
    B, H, T, D, KV, G = _groups(q, k)
    ct = q.dtype
    qg = (q * scale).reshape(B, KV, G, T, D)  # scale folded into q: one pass over q, not s
    og = o.reshape(B, KV, G, T, D)  # splitting an axis is always a view
    lg = lse.reshape(B, KV, G, T)
    kt = k.swapaxes(-1, -2)[:, :, None]  # (B, KV, 1, D, T)
    vg = v[:, :, None]  # (B, KV, 1, T, D)
    for i0 in range(0, T, block):
        i1 = min(i0 + block, T)
        qi = qg[:, :, :, i0:i1]  # (B, KV, G, bq, D)
        m = l = acc = None
        for j0 in range(0, i1, block):
            j1 = min(j0 + block, i1)
            s = xp.matmul(qi, kt[..., j0:j1])  # scaled scores (B, KV, G, bq, bk)
            add_flops(4.0 * s.size * D)  # QK^T and PV of the tile
            bias = _causal_bias(i0, i1, j0, j1, ct, xp)
            if bias is not None:
                s += bias
            mj = s.max(axis=-1, keepdims=True)  # (B, KV, G, bq, 1)
            if m is None:
                m_new = mj
            else:
                m_new = xp.maximum(m, mj)
            s -= m_new
            p = xp.exp(s, out=s)  # (B, KV, G, bq, bk)
            pv = xp.matmul(p, vg[:, :, :, j0:j1])  # (B, KV, G, bq, D)
            if m is None:
                l, acc = p.sum(axis=-1, keepdims=True), pv
            else:
                alpha = xp.exp(m - m_new)  # (B, KV, G, bq, 1)
                l *= alpha
                l += p.sum(axis=-1, keepdims=True)
                acc *= alpha
                acc += pv
            m = m_new
        xp.divide(acc, l, out=og[:, :, :, i0:i1])
        xp.log(l, out=l)
        l += m
        lg[:, :, :, i0:i1] = l[..., 0]


@timed("attention")
def flash_attention_backward(do, cache, xp):
    """Blocked backward from (q, k, v, o, lse): scores are recomputed tile by tile.

    do (B, H, T, D) (may be a strided view) -> (dq (B, H, T, D), dk, dv (B, KV, T, D))."""
    q, k, v, o, lse, block = cache
    B, H, T, D, KV, G = _groups(q, k)
    ct = q.dtype
    scale = 1.0 / math.sqrt(D)
    do = _as(do, ct)
    dq = xp.empty((B, H, T, D), ct)
    dk = xp.empty((B, KV, T, D), ct)
    dv = xp.empty((B, KV, T, D), ct)
    for bs in _batch_groups(B, H, block, ct.itemsize):  # a few sequences at a time
        _flash_bwd_group(do[bs], q[bs], k[bs], v[bs], o[bs], lse[bs], block, scale, xp,
                         dq[bs], dk[bs], dv[bs])
    return dq, dk, dv


def _flash_bwd_group(do, q, k, v, o, lse, block, scale, xp, dq, dk, dv):
    B, H, T, D, KV, G = _groups(q, k)
    ct = q.dtype
    delta = (do * o).sum(axis=-1, dtype=ct).reshape(B, KV, G, T, 1)  # rowsum(dO * O)
    lg = lse.reshape(B, KV, G, T, 1)
    qg = (q * scale).reshape(B, KV, G, T, D)  # scaled q: s = qs k^T, dk = dS^T qs
    dog = do.reshape(B, KV, G, T, D)
    dq[...] = 0
    dqg = dq.reshape(B, KV, G, T, D)
    for j0 in range(0, T, block):
        j1 = min(j0 + block, T)
        kj = k[:, :, None, j0:j1]  # (B, KV, 1, bk, D)
        vj = v[:, :, None, j0:j1]  # (B, KV, 1, bk, D)
        dkj = dvj = None
        for i0 in range(j0, T, block):  # query blocks that see keys j0:j1
            i1 = min(i0 + block, T)
            qi, doi = qg[:, :, :, i0:i1], dog[:, :, :, i0:i1]  # (B, KV, G, bq, D)
            s = xp.matmul(qi, kj.swapaxes(-1, -2))  # scaled scores (B, KV, G, bq, bk)
            add_flops(10.0 * s.size * D)  # the tile's five GEMMs
            bias = _causal_bias(i0, i1, j0, j1, ct, xp)
            if bias is not None:
                s += bias
            s -= lg[:, :, :, i0:i1]
            p = xp.exp(s, out=s)  # probabilities (B, KV, G, bq, bk)
            pt = p.swapaxes(-1, -2)  # (B, KV, G, bk, bq)
            t = xp.matmul(pt, doi)  # (B, KV, G, bk, D)
            if dvj is None:
                dvj = t
            else:
                dvj += t
            dp = xp.matmul(doi, vj.swapaxes(-1, -2))  # (B, KV, G, bq, bk)
            dp -= delta[:, :, :, i0:i1]
            dp *= p  # dS / scale (the scale is applied to dq at the end; qs carries it for dk)
            dqg[:, :, :, i0:i1] += xp.matmul(dp, kj)
            t = xp.matmul(dp.swapaxes(-1, -2), qi)  # (B, KV, G, bk, D)
            if dkj is None:
                dkj = t
            else:
                dkj += t
        dk[:, :, j0:j1] = dkj.sum(axis=2) if G > 1 else dkj[:, :, 0]
        dv[:, :, j0:j1] = dvj.sum(axis=2) if G > 1 else dvj[:, :, 0]
    dq *= scale


# --------------------------------------------------------------------------------------------
# SwiGLU: act = silu(gate) * up
# --------------------------------------------------------------------------------------------


@timed("swiglu")
def swiglu_forward(gate, up, xp, out=None):
    """act = gate * sigmoid(gate) * up, in the compute type; cache (gate, up)."""
    ct = compute_dtype(gate, up)
    if gate.ndim == 2 and devkernels.usable(xp, gate, up, out):
        return devkernels.swiglu_forward(gate, up, xp, out=out)
    if gate.ndim == 2 and fused.usable(xp, gate, up):
        a = xp.empty(gate.shape, ct) if out is None else out
        return fused.swiglu_forward(gate, up, a), (gate, up)
    g = _as(gate, ct)
    a = xp.negative(g, out=out) if out is not None else xp.negative(g)  # (..., F)
    xp.exp(a, out=a)
    a += 1.0
    xp.divide(g, a, out=a)  # silu(g)
    a *= _as(up, ct)
    return a, (gate, up)


@timed("swiglu")
def swiglu_backward(dact, cache, xp, out=None, with_act=False):
    """-> (dgate, dup) in the compute type, written into `out` = (dgate, dup) when given (views
    welcome). `with_act`: also return act = silu(gate) * up, which the sigmoid computed here
    gives for one multiply (a layer's down-projection gradient needs it): (dgate, dup, act)."""
    gate, up = cache
    ct = compute_dtype(gate, up, dact)
    if gate.ndim == 2 and devkernels.usable(xp, gate, up, dact, *(out or ())):
        return devkernels.swiglu_backward(dact, cache, xp, out=out, with_act=with_act)
    if gate.ndim == 2 and fused.usable(xp, gate, up, dact):
        dgate, dup = out if out is not None else (xp.empty(gate.shape, ct), xp.empty(gate.shape, ct))
        act = xp.empty(gate.shape, ct) if with_act else None
        fused.swiglu_backward(dact, gate, up, dgate, dup, act)
        return (dgate, dup, act) if with_act else (dgate, dup)
    g, u, da = _as(gate, ct), _as(up, ct), _as(dact, ct)
    dgate, dup = out if out is not None else (None, None)
    sig = xp.negative(g)  # (..., F)
    xp.exp(sig, out=sig)
    sig += 1.0
    xp.reciprocal(sig, out=sig)  # sigmoid(g)
    silu = g * sig
    act = silu * u if with_act else None
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
# Cross-entropy (mean over tokens), numerically stable
# --------------------------------------------------------------------------------------------


def cross_entropy_forward(logits, targets, xp):
    """logits (N, V), targets (N,) integer -> mean_n(logsumexp(logits_n) - logits_n[t_n]).

    Computed in the compute type with the row max subtracted. Returns (loss 0-d, cache)."""
    ct = compute_dtype(logits)
    z = _as(logits, ct)
    lse = logsumexp_rows(z, xp)  # (N,)
    n = z.shape[0]
    picked = z[xp.arange(n), targets]  # (N,)
    losses = lse - picked
    return losses.mean(dtype=ct), (z, targets, lse)


@timed("head")
def logsumexp_rows(z, xp):
    """log(sum(exp(z), -1)) of rows of z (N, V), with the max subtracted first."""
    if devkernels.usable(xp, z) and z.flags.c_contiguous:
        return devkernels.logsumexp_rows(z, xp)
    m = z.max(axis=-1, keepdims=True)  # (N, 1)
    e = z - m
    xp.exp(e, out=e)
    return xp.log(e.sum(axis=-1, dtype=z.dtype)) + m[:, 0]  # (N,)


def cross_entropy_backward(dloss, cache, xp):
    """-> dlogits (N, V) = (softmax(logits) - onehot(targets)) * dloss / N."""
    z, targets, lse = cache
    n = z.shape[0]
    d = z - lse[:, None]  # (N, V)
    xp.exp(d, out=d)
    d[xp.arange(n), targets] -= 1.0
    d *= float(dloss) / n
    return d


__all__ = [
    "attention_backward",
    "attention_forward",
    "compute_dtype",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "embedding_backward",
    "embedding_forward",
    "flash_attention_backward",
    "flash_attention_forward",
    "linear_backward",
    "linear_forward",
    "logsumexp_rows",
    "mlp_backward",
    "mlp_forward",
    "rmsnorm_backward",
    "rmsnorm_forward",
    "rope_backward",
    "rope_forward",
    "rope_tables",
    "swiglu_backward",
    "swiglu_forward",
]
