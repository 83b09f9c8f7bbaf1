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
(`scratch.exec`) around each call and the memory plan counts (`runtime.measure`). A backend
whose inputs are half precision says so with `dtype` (ctx.dtype); the layer then hands it the
rounded q, k, v it keeps, and o comes back in that dtype.

A backend may also say which models it cannot run (`refuses(model, dtype)`: the reason, or ""),
which `run.attention: auto` takes as a reason to try the next backend, and may take its
workspace from the ledger itself (`owns_workspace`: then the layer does not reserve it).

Entries here: the tiled online softmax (flash-attention style) of `flash_attention_*`, whose
transient memory is O(block^2 + block * D) per (batch, head) whatever T and whose cache holds
nothing T x T, at tile 64 on the host (`tiled-64`: a core's cache) and 1024 on a device
(`tiled-1024`); cuDNN's fused SDPA on a GPU in fp16 and bf16 (`CudnnAttention`, `cudnn`);
`exec.backends` registers them. `kernels.attention_*` (the (T, T) scores materialised) is the
plain reference the tiled one is tested against, and the tiled one the fused one's.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import numpy as np

from ratrain.device import kind_of
from ratrain.exec import cudnn_sdpa as cs
from ratrain.exec.kernels import NEG_INF, as_dtype, compute_dtype, gqa_shape
from ratrain.exec.profile import add_flops, timed

WORKSPACE_TAG = "scratch.attention"  # a backend's own workspace in the ledger (owns_workspace)
TILE_BYTES = 256 << 10  # score tiles of a batch group stay in a core's L2 cache (the host)
# a device's bound on a group's score tile: at tile 1024 one 124M sequence's is 48 MiB (12
# heads), so 8 sequences (micro-batch 8) go as one group, a few dozen launches a layer call
# instead of 8 times as many; its four tiles in flight, 1.5 GiB, are the layer's workspace
DEVICE_GROUP_BYTES = 512 << 20


def _group_size(H, block, itemsize, group_bytes) -> int:
    """Sequences per batch group: their (H, block, block) score tiles within `group_bytes`."""
    return max(1, group_bytes // (H * block * block * itemsize))


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
    owns_workspace = False  # True: it allocates its workspace from ctx.ledger during its calls
    # whether a device graph may capture its calls (`exec.graphs`): no device sync, no upload,
    # no cuBLAS through cupy (which refuses a capturing stream)
    captures = False

    def refuses(self, model, dtype) -> str:
        """Why this backend cannot run `model`'s attention with `dtype` operands ("": it can)."""
        return ""

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
    """`flash_attention_*` by tiles of `block` queries x `block` keys, over groups of sequences
    whose score tiles fit `group_bytes` (a core's L2 on the host; on a device all of a batch
    chunk's sequences at once, up to `DEVICE_GROUP_BYTES`: each group is a few dozen launches
    whatever its size)."""

    def __init__(self, block: int, group_bytes: int = TILE_BYTES):
        if block < 1:
            raise ValueError(f"attention tile {block}: must be at least 1")
        self.block = block
        self.group_bytes = group_bytes
        self.name = f"tiled-{block}"

    def forward(self, q, k, v, ctx, out=None):
        return flash_attention_forward(q, k, v, ctx.xp, self.block, out=out,
                                       group_bytes=self.group_bytes)

    def backward(self, do, cache, ctx):
        return flash_attention_backward(do, cache, ctx.xp, self.block, self.group_bytes)

    def workspace_nbytes(self, ctx, batch, seq_len, backward=False):
        """Four fp32 (heads, block, block) score tiles per sequence of a group in flight (a
        group per thread, at most one per batch chunk); nothing for a single token."""
        if seq_len <= 1:
            return 0
        chunks = ctx.split(batch)
        in_flight = min(batch, ctx.threads, len(chunks))
        per_group = min(max(c.stop - c.start for c in chunks),
                        _group_size(ctx.model.heads, self.block, 4, self.group_bytes))
        return 4 * 4 * ctx.model.heads * self.block**2 * in_flight * per_group


class CudnnAttention(AttentionBackend):
    """cuDNN's fused causal GQA attention (`exec.cudnn_sdpa`) on a GPU rank in fp16 or bf16.

    q, k, v come in ctx.dtype (the layer's rounded, kept values), o goes into the layer's
    token-major buffer, lse is cuDNN's fp32 stats (the tiled path's numbers), dq, dk, dv come
    back in ctx.dtype (as PyTorch's SDPA under autocast). The `CudnnSdpa` (a handle on the
    current card) is made on first use and builds a graph per shape once (`sdpa.graphs`); each
    call's workspace is a buffer from the DDR ledger under `scratch.attention` (WORKSPACE_TAG),
    exactly the built graph's size, which `workspace_nbytes` reports to the memory plan (the
    forward's, or the larger of both for a backward: a selective backward runs both in turn).
    The backward is cuDNN's deterministic one: the same bytes for the same shapes on the same
    card and software, so every policy stays bitwise equal. Without a card, `refuses` builds
    and validates both graphs of a model (CI)."""

    name = "cudnn"
    owns_workspace = True
    captures = True  # a built graph's execute on a workspace of the call's (cuDNN captures it)

    def __init__(self, dp_workspace_limit: int | None = cs.DP_WORKSPACE_LIMIT,
                 on_card: bool = False, sdpa=None, name: str = "cudnn"):
        self.dp_workspace_limit = dp_workspace_limit
        self.on_card = on_card  # made for a GPU rank: `refuses` builds the graphs there too
        # `CudnnSdpa`'s interface: the card's, made on first use, unless given (the stand-in's
        # count, `devcount.CountedSdpa`)
        self._sdpa = sdpa
        self.name = name
        self._workspace: dict[tuple, int] = {}  # (dtype, batch, seq_len, backward) -> bytes

    @property
    def sdpa(self) -> cs.CudnnSdpa:
        """The rank's cuDNN handle and graphs, made on first use (needs a GPU)."""
        if self._sdpa is None:
            self._sdpa = cs.CudnnSdpa(self.dp_workspace_limit)
        return self._sdpa

    def dtype(self, ctx):
        return ctx.dtype

    def specs(self, model, dtype, batch: int, seq_len: int) -> tuple[cs.SdpaSpec, cs.SdpaSpec]:
        """The (forward, backward) graphs' specs of a layer call: q, k, v, dq, dk, dv
        contiguous, o and do views of the layer's token-major (B, T, H * D) buffers."""
        B, H, KV, T, D = batch, model.heads, model.kv_heads, seq_len, model.head_dim
        q, kv = cs.row_major((B, H, T, D)), cs.row_major((B, KV, T, D))
        tok = (T * H * D, D, H * D, 1)  # (B, T, H, D) seen as (B, H, T, D)
        dt = np.dtype(dtype).name
        return (cs.SdpaSpec("forward", B, H, KV, T, D, dt, strides=(q, kv, kv, tok)),
                cs.SdpaSpec("backward", B, H, KV, T, D, dt, strides=(q, kv, kv, tok, tok, q, kv, kv),
                            dp_workspace_limit=self.dp_workspace_limit))

    def refuses(self, model, dtype) -> str:
        """Why cuDNN cannot run `model`'s attention ("" when it can): the spec's checks (fp16 or
        bf16, head size a multiple of 8 up to 256) and the frontend's validate() of both graphs
        for one sequence of the model's length (no card needed); `on_card`, both graphs also
        built on the card (its support, cuDNN's own checks)."""
        try:
            for spec in self.specs(model, dtype, 1, model.seq_len):
                if self.on_card:
                    self.sdpa.graph(spec)
                else:
                    cs.describe(spec)
        except (ValueError, cs.CudnnUnavailable) as e:
            return str(e)
        return ""

    @contextlib.contextmanager
    def _workspace_for(self, ctx, spec):
        """A device byte buffer of the graph's workspace, from the ledger while the call runs
        (None when the graph needs none)."""
        n = self.sdpa.workspace_nbytes(spec)
        if n == 0 or ctx.ledger is None:
            yield None if n == 0 else ctx.xp.empty(n, np.uint8)
            return
        buf = ctx.ledger.alloc(WORKSPACE_TAG, (n,), np.uint8, ctx.xp, zero=False)
        try:
            yield buf
        finally:
            ctx.ledger.free(buf)

    @timed("attention")
    def forward(self, q, k, v, ctx, out=None):
        o = ctx.xp.empty(q.shape, q.dtype) if out is None else out
        spec = cs.spec_of("forward", dict(q=q, k=k, v=v, o=o), causal=True)
        add_flops(2.0 * q.size * q.shape[2])  # QK^T and PV, half of it masked
        with self._workspace_for(ctx, spec) as ws:
            o, lse = self.sdpa.forward(q, k, v, out=o, workspace=ws)
        return o, AttentionCache(q, k, v, o, lse)

    @timed("attention")
    def backward(self, do, cache, ctx):
        q, k, v, o, lse = cache.q, cache.k, cache.v, cache.o, cache.lse
        xp = ctx.xp
        do = as_dtype(do, q.dtype)
        out = (xp.empty(q.shape, q.dtype), xp.empty(k.shape, q.dtype), xp.empty(v.shape, q.dtype))
        spec = cs.spec_of("backward", dict(q=q, k=k, v=v, o=o, do=do, dq=out[0], dk=out[1],
                                           dv=out[2]), True, self.dp_workspace_limit)
        add_flops(5.0 * q.size * q.shape[2])  # the backward's five GEMMs, half masked
        with self._workspace_for(ctx, spec) as ws:
            return self.sdpa.backward(q, k, v, o, do, lse, out=out, workspace=ws)

    def workspace_nbytes(self, ctx, batch, seq_len, backward=False):
        """The built graphs' workspace bytes at the layer's layout (built now if not yet)."""
        key = (ctx.dtype.name, batch, seq_len, backward)
        if key not in self._workspace:
            fwd, bwd = self.specs(ctx.model, ctx.dtype, batch, seq_len)
            n = self.sdpa.workspace_nbytes(fwd)
            self._workspace[key] = max(n, self.sdpa.workspace_nbytes(bwd)) if backward else n
        return self._workspace[key]


# --------------------------------------------------------------------------------------------
# Causal grouped-query attention: blocked online softmax (flash-attention style)
# --------------------------------------------------------------------------------------------


def _causal_bias(i0, i1, j0, j1, ct, xp):
    """(bq, bk) additive mask for query rows i0:i1 against keys j0:j1, or None if all visible.
    Read only: it depends on the tile's shape and its offset from the diagonal alone, so one
    array serves every call with them (`_bias`; four launches a tile on a device otherwise)."""
    if j1 - 1 <= i0:
        return None
    card = xp.cuda.runtime.getDevice() if kind_of(xp) == "gpu" else None  # cupy's current
    return _bias(i1 - i0, j1 - j0, i0 - j0, np.dtype(ct), xp, card)


@functools.lru_cache(maxsize=16)
def _bias(bq, bk, offset, ct, xp, card):
    """The mask of a (bq, bk) tile whose first query is `offset` rows past its first key:
    -inf where a key comes after the query (key column c > query row r + offset)."""
    rows = xp.arange(offset, offset + bq)[:, None]
    cols = xp.arange(bk)[None, :]
    return xp.where(cols > rows, NEG_INF, 0.0).astype(ct)  # (bq, bk)


def _batch_groups(B, H, block, itemsize, group_bytes=TILE_BYTES):
    n = _group_size(H, block, itemsize, group_bytes)
    return [slice(b0, min(b0 + n, B)) for b0 in range(0, B, n)]


@timed("attention")
def flash_attention_forward(q, k, v, xp, block=128, out=None, group_bytes=TILE_BYTES):
    """Causal GQA attention by blocks of `block` queries x `block` keys with an online softmax.

    q (B, H, T, D); k, v (B, KV, T, D) -> o (B, H, T, D) (written into `out` when given, which
    may be a strided view), `AttentionCache` with lse (B, H, T) the log-sum-exp of each row of
    scaled scores. Transient memory: a few (b, H, block, block) tiles, b the sequences whose
    tiles fit `group_bytes` (at least one)."""
    B, H, T, D, KV, G = gqa_shape(q, k)
    ct = compute_dtype(q, k, v)
    q, k, v = as_dtype(q, ct), as_dtype(k, ct), as_dtype(v, ct)
    scale = 1.0 / math.sqrt(D)
    o = xp.empty((B, H, T, D), ct) if out is None else out
    lse = xp.empty((B, H, T), ct)
    for bs in _batch_groups(B, H, block, ct.itemsize, group_bytes):  # a few sequences at a time
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
def flash_attention_backward(do, cache, xp, block=128, group_bytes=TILE_BYTES):
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
    for bs in _batch_groups(B, H, block, ct.itemsize, group_bytes):  # a few sequences at a time
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


__all__ = ["DEVICE_GROUP_BYTES", "TILE_BYTES", "WORKSPACE_TAG", "AttentionBackend",
           "AttentionCache", "CudnnAttention", "TiledAttention", "flash_attention_backward", "flash_attention_forward"]
