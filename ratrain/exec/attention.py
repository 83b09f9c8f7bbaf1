"""Attention backends: the causal grouped-query attention of a layer, behind one seam.

The kernel table (`exec.backends`) holds one backend per rank as its `attention` entry, made
once for the rank's device and precision; the layers call only this:

    attn.name                                       e.g. "tiled-64" (the banner, the table)
    attn.dtype(ctx)                                 the dtype q, k, v (and o) are handed in
    o, cache = attn.forward(q, k, v, ctx, out=o)    causal, grouped-query
    dq, dk, dv = attn.backward(do, cache, ctx)
    attn.workspace_nbytes(ctx, batch, seq_len, backward)   transient bytes of one layer call

Shapes: q (B, H, T, D), k and v (B, KV, T, D), H % KV == 0, query head h reading kv head
h // (H / KV) (Hugging Face's `repeat_kv`); `out` (the output, o's layout) and `do` may be
strided views (the layer's token-major buffers). The `AttentionCache` is what the backward
needs: q, k, v, o and lse (B, H, T) fp32, the logsumexp of each query row's scaled scores (the
softmax statistics; cuDNN's `sdpa` returns them as its stats). The layer keeps o and lse
(`recompute: none`) or re-runs `forward` (`selective`), then builds the cache from what it kept.

A backend is made once per rank, so it may keep state per shape (a compiled graph, say); its
transient memory is what `workspace_nbytes` says, which the layer reserves in the DDR ledger
(`scratch.exec`) around each call and the memory plan counts (`lifecycle.measure`). A backend
whose inputs are half precision says so with `dtype` (ctx.dtype); the layer then hands it the
rounded q, k, v it keeps, and o comes back in that dtype.

Entries here: the tiled online softmax (flash-attention style) of `flash_attention_*`, whose
transient memory is O(block^2 + block * D) per (batch, head) whatever T and whose cache holds
nothing T x T, at tile 64 on the host (`tiled-64`: a core's cache) and 1024 on a device
(`tiled-1024`); `exec.backends` registers them. `kernels.attention_*` (the (T, T) scores
materialised) is the plain reference both are tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ratrain.exec.kernels import NEG_INF, as_dtype, compute_dtype, gqa_shape
from ratrain.exec.profile import add_flops, timed


@dataclass
class AttentionCache:
    """What an attention backward needs (see the module): q (B, H, T, D), k, v (B, KV, T, D),
    the output o (B, H, T, D) and lse (B, H, T) fp32."""

    q: object
    k: object
    v: object
    o: object
    lse: object


class AttentionBackend:
    """The interface of an attention backend (see the module); subclasses implement it."""

    name = "attention"

    def dtype(self, ctx):
        """The dtype the layer hands q, k, v in: the compute type unless overridden."""
        return ctx.compute

    def forward(self, q, k, v, ctx, out=None):
        raise NotImplementedError

    def backward(self, do, cache: AttentionCache, ctx):
        raise NotImplementedError

    def workspace_nbytes(self, ctx, batch: int, seq_len: int, backward: bool = False) -> int:
        """Transient bytes of one layer call's attention, beyond its inputs and outputs."""
        return 0


class TiledAttention(AttentionBackend):
    """`flash_attention_*` by tiles of `block` queries x `block` keys."""

    def __init__(self, block: int):
        if block < 1:
            raise ValueError(f"attention tile {block}: must be at least 1")
        self.block = block
        self.name = f"tiled-{block}"

    def forward(self, q, k, v, ctx, out=None):
        return flash_attention_forward(q, k, v, ctx.xp, self.block, out=out)

    def backward(self, do, cache, ctx):
        return flash_attention_backward(do, cache, ctx.xp, self.block)

    def workspace_nbytes(self, ctx, batch, seq_len, backward=False):
        """Four fp32 (heads, block, block) score tiles per sequence in flight (one per thread,
        at most one per batch chunk); nothing for a single token."""
        if seq_len <= 1:
            return 0
        in_flight = min(batch, ctx.threads, len(ctx.split(batch)))
        return 4 * 4 * ctx.model.heads * self.block**2 * in_flight


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
    may be a strided view), `AttentionCache` with lse (B, H, T) the log-sum-exp of each row of
    scaled scores. Transient memory: a few (B, H, block, block) tiles."""
    B, H, T, D, KV, G = gqa_shape(q, k)
    ct = compute_dtype(q, k, v)
    q, k, v = as_dtype(q, ct), as_dtype(k, ct), as_dtype(v, ct)
    scale = 1.0 / math.sqrt(D)
    o = xp.empty((B, H, T, D), ct) if out is None else out
    lse = xp.empty((B, H, T), ct)
    for bs in _batch_groups(B, H, block, ct.itemsize):  # a few sequences at a time
        _flash_fwd_group(q[bs], k[bs], v[bs], o[bs], lse[bs], block, scale, xp)
    return o, AttentionCache(q, k, v, o, lse)


def _flash_fwd_group(q, k, v, o, lse, block, scale, xp):
    B, H, T, D, KV, G = gqa_shape(q, k)
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
def flash_attention_backward(do, cache, xp, block=128):
    """Blocked backward from the cache (q, k, v, o, lse): scores are recomputed tile by tile
    (`block` as the forward's, for the same bits as a recomputed forward).

    do (B, H, T, D) (may be a strided view) -> (dq (B, H, T, D), dk, dv (B, KV, T, D))."""
    q, k, v, o, lse = cache.q, cache.k, cache.v, cache.o, cache.lse
    B, H, T, D, KV, G = gqa_shape(q, k)
    ct = q.dtype
    scale = 1.0 / math.sqrt(D)
    do = as_dtype(do, ct)
    dq = xp.empty((B, H, T, D), ct)
    dk = xp.empty((B, KV, T, D), ct)
    dv = xp.empty((B, KV, T, D), ct)
    for bs in _batch_groups(B, H, block, ct.itemsize):  # a few sequences at a time
        _flash_bwd_group(do[bs], q[bs], k[bs], v[bs], o[bs], lse[bs], block, scale, xp,
                         dq[bs], dk[bs], dv[bs])
    return dq, dk, dv


def _flash_bwd_group(do, q, k, v, o, lse, block, scale, xp, dq, dk, dv):
    B, H, T, D, KV, G = gqa_shape(q, k)
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


__all__ = ["AttentionBackend", "AttentionCache", "TiledAttention", "flash_attention_backward",
           "flash_attention_forward"]
