"""Block kernels: the embedding and one decoder layer, and what every block shares (its cache,
the workspace tag, the compute-type cast, the gradient accumulation). The head, the third kind
of block, is `exec.head`; it has the same interface.

    embed_forward(ids, p, ctx) -> (x, cache)          embed_backward(dx, cache, p, g, ctx) -> None
    layer_forward(x, p, ctx, recompute) -> (y, cache) layer_backward(dy, cache, p, g, ctx) -> dx
    cache_nbytes(cache) -> int ; cache_arrays(cache) -> list of arrays (for ledger.track)
    layer_cache_nbytes(model, batch, precision, recompute) -> int  (the same, from shapes)

`p` maps local names to the block's working weight view (ctx.dtype: float16, bfloat16 or
float32, Hugging Face layout (out, in), y = x @ W.T); `g` maps local names to fp32 gradient
arrays that backward *adds* into.

A decoder layer (pre-norm LLaMA):
    h = x + Wo . attn(rope(Wq . rms(x)), rope(Wk . rms(x)), Wv . rms(x))
    y = h + Wd . (silu(Wg . rms(h)) * Wu . rms(h))
Wq/Wk/Wv and Wg/Wu are concatenated once per call (one GEMM each, forward and backward), and in
fp16 and bf16 mode on the CPU every weight view is converted to fp32 once per call into scratch
(`scratch.gemm`) so that each GEMM is an sgemm. On a device, and on a host whose BLAS takes the
16-bit dtype (`ctx.gemm_half`: `run.blas: mkl`), the GEMMs run in the 16-bit dtype on the views
themselves. Activations crossing blocks and kept in caches are ctx.dtype; inside a call the
arithmetic is fp32 (GEMM accumulation, norms, softmax). The host's 16-bit layout
(`ctx.half_layout`) keeps every GEMM operand in 16 bits, adds the residual and the weight
gradients by the GEMMs themselves (`accumulate_gemms`), and gives the same bits whatever the
threads and `recompute`. In fp16 and bf16 mode q, k, v are rounded to 16 bits
before attention (they are kept so), so that a recomputation from the kept values reproduces
the forward bit for bit. Every op runs through
the rank's kernel table (`ctx.kernels`, `exec.backends`): attention is its backend's
(`exec.attention`), handed q, k, v in the backend's `dtype` and giving back o and the softmax
statistics (lse) in a named cache.

`recompute` (schedule.recompute's per-layer value: what the backward re-runs, hence what the
cache holds for it):
    "none"       x, rstd, q, k, v (after RoPE), attention output o and its logsumexp, h, gate|up
    "selective"  the same less o and logsumexp: backward recomputes the attention core
                 (the attention forward: cheap, and o is as large as x)
    "full"       x only: backward re-runs the forward (full recomputation)
Backward gives bitwise the same gradients whatever `recompute` was.
"""

from __future__ import annotations

from dataclasses import dataclass, field


from ratrain.config import act_itemsize
from ratrain.device import stacked_rows
from ratrain.exec import kernels
from ratrain.exec.attention import AttentionCache
from ratrain.exec.gemm import SCRATCH_TAG
from ratrain.exec.profile import timed
from ratrain.exec.spec import RECOMPUTE

WORK_TAG = "scratch.exec"  # transient fp32 workspace of a block call (an estimate)


@dataclass
class BlockCache:
    """What a block's forward keeps for its backward. `parts` holds one dict per batch chunk."""

    role: str  # "embed" | "layer" | "head"
    recompute: str  # what the backward re-runs (layers; "none" for embed and head)
    x: object  # the block input (ids for the embedding)
    chunks: list
    parts: list | None
    extra: dict = field(default_factory=dict)


def cache_arrays(cache: BlockCache) -> list:
    """Every array the cache keeps alive (the input first), for ledger.track."""
    out = [cache.x]
    for part in cache.parts or ():
        out.extend(v for v in part.values() if hasattr(v, "nbytes"))
    out.extend(v for v in cache.extra.values() if hasattr(v, "nbytes"))
    return out


def cache_nbytes(cache: BlockCache) -> int:
    return int(sum(a.nbytes for a in cache_arrays(cache)))


def layer_cache_nbytes(model, batch: int, precision: str, recompute: str = "none") -> int:
    """Bytes a decoder layer's cache holds for a micro-batch of `batch` sequences, from shapes,
    as `layer_forward` keeps it (tested against `cache_nbytes`): the input, q, k, v, h, gate|up
    and the RMSNorm statistics; `none` adds o and its logsumexp; `full` keeps the input only.
    What offloading a layer moves to the memory tier and back (`plan.cost.offload_bytes`)."""
    n, e = batch * model.seq_len, act_itemsize(precision)
    hd, kvd = model.heads * model.head_dim, model.kv_heads * model.head_dim
    x = n * model.hidden * e
    if recompute == "full":
        return x
    kept = 2 * x + n * (hd + 2 * kvd + 2 * model.ffn_hidden) * e + 2 * 4 * n  # x, h; q k v, gu; rstd
    if recompute == "none":
        kept += n * hd * e + 4 * n * model.heads  # o, lse
    return kept


def _as(ctx, a, dtype):
    """`a` in `dtype` (itself when it has it), through the table's cast."""
    return a if a.dtype == dtype else ctx.kernels.cast(a, dtype)


def as_compute(ctx, a):
    """`a` in the compute type (itself when it has it)."""
    return _as(ctx, a, ctx.compute)


def kernel_input(ctx, a):
    """`a` as the norms', SwiGLU's and the head's kernels take it: itself where a device's
    kernels read 16 bits (`ctx.out16`), else in the compute type (the same values)."""
    return a if ctx.out16 is not None else as_compute(ctx, a)


def _g(ctx, a):
    """`a` as an operand of two GEMMs: in the device's 16-bit GEMM dtype, cast once (the same
    bits each GEMM's own cast gives), or itself where the GEMMs are fp32."""
    return a if ctx.gemm_half is None else _as(ctx, a, ctx.gemm_half)


def _normed(ctx, x, rstd, w):
    """The norm's output recomputed from the kept statistics, x * rstd * w (the forward's
    arithmetic: `rmsnorm_recompute`), written as the 16-bit GEMM operand where a device's
    kernels write those (`ctx.out16`), else in the compute type."""
    out = None if ctx.out16 is None else ctx.xp.empty(x.shape, ctx.out16)
    return ctx.kernels.rmsnorm_recompute(x, rstd, w, ctx.xp, out=out)


def _add_into(a, b, out, ctx):
    """out[...] = a + b, summed in the compute type and rounded once into out's dtype (as
    numpy's add into a float16 out does); `b` is overwritten when out's dtype differs."""
    if out.dtype == b.dtype:
        ctx.xp.add(a, b, out=out)
        return
    ctx.xp.add(a, b, out=b)
    ctx.kernels.assign(out, b)


# --------------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------------


def embed_forward(ids, p, ctx):
    """ids (B, T) -> x (B, T, C) in ctx.dtype."""
    x, _ = kernels.embedding_forward(ids, p["weight"], ctx.xp)  # (B, T, C)
    x = ctx.kernels.cast(x, ctx.dtype)
    return x, BlockCache("embed", "none", ids, [], None, {})


def embed_backward(dx, cache, p, g, ctx) -> None:
    kernels.embedding_backward(dx, (cache.x, p["weight"].shape), ctx.xp, dw=g["weight"])


# --------------------------------------------------------------------------------------------
# Decoder layer
# --------------------------------------------------------------------------------------------


def _dims(ctx):
    m = ctx.model
    return m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn_hidden


_STACKS = {"wqkv": ("attn.wq", "attn.wk", "attn.wv"), "wgu": ("mlp.w_gate", "mlp.w_up")}


def _stacked(arrays, dtype):
    """The rows of `arrays` as one (sum of their rows, C) view, when they lie back to back in
    memory as C-contiguous arrays of `dtype` (`device.stacked_rows`: on the host or a device),
    or None. The flat parameter buffers keep wq, wk, wv and w_gate, w_up in that order, so the
    layer's concatenated GEMM weights are views of the views, not copies, whenever the view's
    dtype is the GEMM's (fp32 on the host; the view dtype, fp16 or fp32, on a device)."""
    if not all(a.dtype == dtype for a in arrays):
        return None
    return stacked_rows(arrays)


def gemm_dtype(ctx):
    """The dtype of the layers' GEMM weights: the views' own where the GEMMs take them
    (`ctx.gemm_half`, and fp32 views), else the compute type (fp32 copies, on the host)."""
    return ctx.gemm_half or (ctx.compute if ctx.host else ctx.dtype)


def _gemm_weight_nbytes(p, ctx) -> int:
    """Scratch bytes of `_gemm_weights`: the concatenated copies that are not views, and fp32
    copies of wo, wd."""
    wdt = gemm_dtype(ctx)
    n = sum(sum(p[k].size for k in names) for names in _STACKS.values()
            if _stacked([p[k] for k in names], wdt) is None)
    if p["attn.wo"].dtype != wdt:
        n += p["attn.wo"].size + p["mlp.w_down"].size
    return n * wdt.itemsize


@timed("weight copies")
def _gemm_weights(p, ctx):
    """GEMM weights in `gemm_dtype` (fp32 copies of 16-bit views on a host whose GEMMs are
    fp32, else the views' dtype): wqkv (H*D + 2*KV*D, C), wo, wgu (2F, C),
    wd (account `_gemm_weight_nbytes` under scratch.gemm around their use). Views of the
    parameters where their dtype and layout allow (`_stacked`), else copies (converted)."""
    xp = ctx.xp
    wdt = gemm_dtype(ctx)
    out, copies = {}, []
    for key, names in _STACKS.items():
        srcs = [p[k] for k in names]
        out[key] = _stacked(srcs, wdt)
        if out[key] is None:
            out[key] = xp.empty((sum(a.shape[0] for a in srcs), srcs[0].shape[1]), wdt)
            r = 0
            for a in srcs:
                copies.append((out[key][r : r + a.shape[0]], a))
                r += a.shape[0]
    out["wo"], out["wd"] = p["attn.wo"], p["mlp.w_down"]
    # the norms' weights: the views themselves (the norms' kernels read 16 bits)
    out["attn_norm"], out["mlp_norm"] = p["attn_norm"], p["mlp_norm"]
    if out["wo"].dtype != wdt:
        out["wo"], out["wd"] = xp.empty(out["wo"].shape, wdt), xp.empty(out["wd"].shape, wdt)
        copies += [(out["wo"], p["attn.wo"]), (out["wd"], p["mlp.w_down"])]
    if copies:
        n = ctx.parts()

        def fill(i):  # rows i/n .. (i+1)/n of every copy (conversion runs in parallel)
            for dst, src in copies:
                r0, r1 = dst.shape[0] * i // n, dst.shape[0] * (i + 1) // n
                ctx.kernels.assign(dst[r0:r1], src[r0:r1])

        ctx.map(fill, range(n))
    return out


def layer_workspace_nbytes(ctx, batch: int, seq_len: int, backward: bool = False) -> int:
    """An estimate of the transient workspace of one layer call: the layer's own fp32 arrays and
    its attention backend's workspace (what the memory plan counts; see `_reserved_nbytes`)."""
    attn = ctx.kernels.attention.workspace_nbytes(ctx, batch, seq_len, backward)
    return _own_nbytes(ctx, batch, seq_len, backward) + attn


def _own_nbytes(ctx, batch: int, seq_len: int, backward: bool) -> int:
    C, H, KV, D, F = _dims(ctx)
    qkv = H * D + 2 * KV * D
    per_token = 4 * C + 2 * qkv + H * D + 3 * F  # x32, xn, h, mlp; qkv + roped; o; gate|up, act
    if backward:
        per_token += 2 * C + qkv + 3 * F + H * D  # dy, dh; dqkv; dgu, dact; do
    # the 16-bit layout keeps every chunk's weight-GEMM operands until they add into the
    # gradients: act, dgu; xn2, dh, xn1; dqkv; o (recomputed under selective)
    kept16 = 3 * F + 3 * C + qkv + H * D if backward and ctx.half_layout else 0
    return batch * seq_len * (4 * per_token + 2 * kept16)


def _reserved_nbytes(ctx, batch: int, seq_len: int, backward: bool = False) -> int:
    """What a layer call reserves under scratch.exec while it runs: its own arrays, and its
    attention backend's workspace unless the backend takes that from the ledger itself
    (`owns_workspace`: cuDNN's, a buffer under `scratch.attention` during its calls)."""
    attn = ctx.kernels.attention
    if attn.owns_workspace:
        return _own_nbytes(ctx, batch, seq_len, backward)
    return layer_workspace_nbytes(ctx, batch, seq_len, backward)


@timed("layer (rest)")
def _layer_fwd_chunk(x, p, w, ctx, recompute, y_out):
    """Forward of one batch chunk; returns the kept arrays. y_out None: skip the output."""
    xp, ops, ct, half16 = ctx.xp, ctx.kernels, ctx.compute, ctx.gemm_half
    C, H, KV, D, F = _dims(ctx)
    b, T, _ = x.shape
    N, HD, KVD = b * T, H * D, KV * D
    half = ctx.half
    cos, sin = ctx.rope(T)  # (T, D)
    cos3, sin3 = cos[:, None, :], sin[:, None, :]  # (T, 1, D) for the (b, T, heads, D) layout
    eps = ctx.model.norm_eps

    o16 = ctx.out16  # the 16-bit dtype a device's kernels write GEMM operands in, or None
    if o16 is None:
        x32 = as_compute(ctx, x)  # (b, T, C)
        xn, (_, rstd1, _) = ops.rmsnorm_forward(x32, w["attn_norm"], eps, xp)  # (b, T, C)
    else:  # the norm reads x as it is, writes Wqkv's 16-bit operand and x's fp32 copy
        x32 = xp.empty((b, T, C), ct)  # the residual, which Wo's GEMM adds into
        xn, (_, rstd1, _) = ops.rmsnorm_forward(x, w["attn_norm"], eps, xp,
                                                out=xp.empty((b, T, C), o16), x_copy=x32)
    qkv = ops.gemm(xn.reshape(N, C), w["wqkv"].T, xp=xp, half=half16)  # (N, HD + 2 KVD)
    attn = ops.attention
    adt = attn.dtype(ctx)  # the compute type, or ctx.dtype for a backend of 16-bit inputs
    # a device's RoPE writes the 16-bit q, k of a 16-bit attention itself, and v is copied into
    # its layout and rounded in one operation: the bits of rounding after
    qkv16 = o16 is not None and adt != ct
    q = xp.empty((b, H, T, D), adt if qkv16 else ct)
    ops.rope_forward(qkv[:, :HD].reshape(b, T, H, D), cos3, sin3, xp, out=q.transpose(0, 2, 1, 3))
    k = xp.empty((b, KV, T, D), q.dtype)
    ops.rope_forward(qkv[:, HD : HD + KVD].reshape(b, T, KV, D), cos3, sin3, xp,
                     out=k.transpose(0, 2, 1, 3))
    if qkv16:
        v = xp.empty((b, KV, T, D), adt)
        v.transpose(0, 2, 1, 3)[...] = qkv[:, HD + KVD :].reshape(b, T, KV, D)
        q16, k16, v16 = q, k, v
    else:
        v = xp.ascontiguousarray(qkv[:, HD + KVD :].reshape(b, T, KV, D).transpose(0, 2, 1, 3))
    del qkv
    if half and not qkv16:  # keep 16 bits, attend on the rounded values
        q16, k16, v16 = (ops.cast(a, ctx.dtype) for a in (q, k, v))
        if adt == ct:
            for a, a16 in ((q, q16), (k, k16), (v, v16)):
                ops.assign(a, a16)
        else:
            q, k, v = q16, k16, v16
    o = xp.empty((b, T, HD), adt)  # attention output, token-major for Wo
    lse = attn.forward(q, k, v, ctx, out=_heads(o, H))[1].lse
    if ctx.half_layout:  # o rounded once: Wo's operand and what the cache keeps
        o = ops.cast(o, ctx.dtype)
        h = x32  # (b, T, C): the residual, which Wo's GEMM adds into (beta = 1)
        ops.gemm(o.reshape(N, HD), w["wo"].T, out=h.reshape(N, C), xp=xp, half=half16,
                 accumulate=True)
    else:
        h = ops.gemm(o.reshape(N, HD), w["wo"].T, xp=xp, half=half16).reshape(b, T, C)
        h += x32  # (b, T, C)
    del x32
    # what the cache keeps of h: its 16-bit copy (written by the norm's kernel on a device)
    hk = xp.empty(h.shape, ctx.dtype) if o16 is not None else None
    xn2, (_, rstd2, _) = ops.rmsnorm_forward(h, w["mlp_norm"], eps, xp, out=xn,
                                             x_copy=hk)  # (b, T, C)
    gu = ops.gemm(xn2.reshape(N, C), w["wgu"].T, xp=xp, half=half16)  # (N, 2F)
    if hk is None:
        hk = ops.cast(h, ctx.dtype) if half else h
    if y_out is not None:
        act = None if o16 is None else xp.empty((N, F), o16)  # SwiGLU writes Wd's operand
        act, _ = ops.swiglu_forward(gu[:, :F], gu[:, F:], xp, out=act)  # (N, F)
        if ctx.half_layout:  # y = h + Wd . act: the GEMM adds into h, rounded once into y
            ops.gemm(_g(ctx, act), w["wd"].T, out=h.reshape(N, C), xp=xp, half=half16,
                     accumulate=True)
            ops.assign(y_out, h)
        else:
            mlp = ops.gemm(act, w["wd"].T, xp=xp, half=half16)  # (N, C)
            _add_into(h, mlp.reshape(b, T, C), y_out, ctx)
            del mlp
        del act
    kept = {"rstd1": rstd1, "rstd2": rstd2}
    if half:
        kept.update(q=q16, k=k16, v=v16, h=hk, gu=ops.cast(gu, ctx.dtype))
        if recompute == "none":
            kept.update(o=ops.cast(o, ctx.dtype), lse=lse)
    else:
        kept.update(q=q, k=k, v=v, h=h, gu=gu)
        if recompute == "none":
            kept.update(o=o, lse=lse)
    return kept


def _heads(a, H):
    """A token-major (b, T, H * D) array seen head-major (b, H, T, D) (a view)."""
    b, T, HD = a.shape
    return a.reshape(b, T, H, HD // H).transpose(0, 2, 1, 3)


def _weight_grad(ctx, parts, key, dy, x) -> None:
    """One chunk's weight gradient dy.T @ x (dy (N, out), x (N, in)) into `parts[key]`: the
    GEMM's fp32 partial, or in the 16-bit layout its two 16-bit operands, which
    `accumulate_gemms` later adds into the gradient by the GEMM itself."""
    if ctx.half_layout:
        parts[key] = (_g(ctx, dy), _g(ctx, x))
    else:
        parts[key] = ctx.kernels.gemm(dy.T, x, xp=ctx.xp, half=ctx.gemm_half)


def _layer_bwd_chunk(dy, x, kept, p, w, ctx, dx_out):
    """Backward of one batch chunk; writes dx_out and returns the weight-gradient partials."""
    parts = {}
    dh, dh16 = _mlp_backward(dy, kept, p, w, ctx, parts)  # (b, T, C) fp32, its 16-bit copy
    _attention_backward(dh, dh16, x, kept, p, w, ctx, parts, dx_out)
    return parts


@timed("layer (rest)")
def _mlp_backward(dy, kept, p, w, ctx, parts):
    """y = h + Wd . swiglu(g, u), [g | u] = Wgu . rms(h): returns dh (b, T, C) in the compute
    type, with its 16-bit copy where a device's kernels write one (`ctx.out16`, else None), and
    puts the wd, wgu and mlp_norm partials into `parts`."""
    xp, ops, ct, half16, o16 = ctx.xp, ctx.kernels, ctx.compute, ctx.gemm_half, ctx.out16
    C, _, _, _, F = _dims(ctx)
    b, T, _ = dy.shape
    N = b * T
    # (N, C): for the residual's add, unless the norm's kernel adds dy as it is
    dy32 = as_compute(ctx, dy).reshape(N, C) if o16 is None else None
    # both GEMMs' operand: dy itself where they take its 16 bits (the same bits as a cast of
    # dy32), else dy32
    dyg = dy32 if half16 is None else _g(ctx, dy.reshape(N, C))
    h, gu = kernel_input(ctx, kept["h"]), kernel_input(ctx, kept["gu"])  # (b, T, C), (N, 2F)
    dact = ops.gemm(dyg, w["wd"], xp=xp, half=half16)  # (N, F)
    dgu = xp.empty((N, 2 * F), o16 or ct)  # (N, 2F): d gate | d up (both GEMMs' operand)
    outs = (dgu[:, :F], dgu[:, F:]) + (() if o16 is None else (xp.empty((N, F), o16),))
    _, _, act = ops.swiglu_backward(dact, (gu[:, :F], gu[:, F:]), xp, out=outs,
                                    with_act=True)  # (N, F): Wd's gradient's operand
    del dact, gu
    _weight_grad(ctx, parts, "wd", dyg, act)  # (C, F)
    del act, dyg
    rms2 = (h, kept["rstd2"], w["mlp_norm"])
    xn2 = _normed(ctx, h, kept["rstd2"], w["mlp_norm"])  # (b, T, C)
    dgu = _g(ctx, dgu)  # both GEMMs' operand
    _weight_grad(ctx, parts, "wgu", dgu, xn2.reshape(N, C))  # (2F, C)
    del xn2
    dxn2 = ops.gemm(dgu, w["wgu"], xp=xp, half=half16)  # (N, C)
    del dgu
    if o16 is None:
        dh, parts["mlp_norm"] = ops.rmsnorm_backward(dxn2.reshape(b, T, C), rms2, xp)
        dh += dy32.reshape(b, T, C)  # (b, T, C)
        return dh, None
    # the norm's kernel adds the residual's gradient dy (its 16 bits as they are) and writes dh
    # in fp32 (the residual's) and in 16 bits (its two GEMMs' operand)
    dh16 = xp.empty((N, C), o16)
    dh, parts["mlp_norm"] = ops.rmsnorm_backward(
        dxn2.reshape(b, T, C), rms2, xp, residual=dy, out=xp.empty((b, T, C), ct),
        copy_out=dh16.reshape(b, T, C))
    return dh, dh16


@timed("layer (rest)")
def _attention_backward(dh, dh16, x, kept, p, w, ctx, parts, dx_out):
    """h = x + Wo . attn(rope(Wq . rms(x)), rope(Wk . rms(x)), Wv . rms(x)): writes dx_out (the
    layer's input gradient, dh included; `dh16`: dh's 16-bit copy, or None) and puts the wo,
    wqkv and attn_norm partials into `parts`. Under `recompute: selective` the attention core
    is re-run here first."""
    xp, ops, ct, half16 = ctx.xp, ctx.kernels, ctx.compute, ctx.gemm_half
    C, H, KV, D, _ = _dims(ctx)
    b, T, _ = x.shape
    N, HD, KVD = b * T, H * D, KV * D
    cos, sin = ctx.rope(T)
    cos3, sin3 = cos[:, None, :], sin[:, None, :]
    attn = ops.attention
    adt = attn.dtype(ctx)
    q, k, v = (_as(ctx, kept[n], adt) for n in ("q", "k", "v"))  # (b, H|KV, T, D)
    if "o" in kept:
        o_kept, lse = kept["o"], kept["lse"]  # (b, T, HD), (b, H, T)
    else:  # selective: recompute the attention core, rounded as the forward kept it
        o_kept = xp.empty((b, T, HD), adt)
        lse = attn.forward(q, k, v, ctx, out=_heads(o_kept, H))[1].lse
        if ctx.half:
            o_kept = ops.cast(o_kept, ctx.dtype)
    o = _as(ctx, o_kept, adt)
    dh2 = _g(ctx, dh.reshape(N, C)) if dh16 is None else dh16  # both GEMMs' operand
    # (C, HD); the 16-bit layout takes the 16 bits kept, the others o (the same values)
    _weight_grad(ctx, parts, "wo", dh2, (o_kept if ctx.half_layout else o).reshape(N, HD))
    do = xp.empty((N, HD), adt)  # (N, HD), in the dtype the attention backend takes
    ops.gemm(dh2, w["wo"], out=do, xp=xp, half=half16)
    del dh2
    dq, dk, dv = attn.backward(_heads(do.reshape(b, T, HD), H),
                               AttentionCache(q, k, v, _heads(o, H), lse), ctx)
    del do, q, k, v, o, o_kept
    # (N, HD + 2 KVD), token-major: both GEMMs' operand (in 16 bits where the kernels write it)
    dqkv = xp.empty((N, HD + 2 * KVD), ctx.out16 or ct)
    ops.rope_backward(dq.transpose(0, 2, 1, 3), (cos3, sin3), xp,
                      out=dqkv[:, :HD].reshape(b, T, H, D))
    ops.rope_backward(dk.transpose(0, 2, 1, 3), (cos3, sin3), xp,
                      out=dqkv[:, HD : HD + KVD].reshape(b, T, KV, D))
    dqkv[:, HD + KVD :].reshape(b, T, KV, D)[...] = dv.transpose(0, 2, 1, 3)
    del dq, dk, dv
    xk = kernel_input(ctx, x)
    rms1 = (xk, kept["rstd1"], w["attn_norm"])
    xn1 = _normed(ctx, xk, kept["rstd1"], w["attn_norm"])  # (b, T, C)
    dqkv = _g(ctx, dqkv)  # both GEMMs' operand
    _weight_grad(ctx, parts, "wqkv", dqkv, xn1.reshape(N, C))  # (HD + 2 KVD, C)
    del xn1
    dxn1 = ops.gemm(dqkv, w["wqkv"], xp=xp, half=half16)  # (N, C)
    del dqkv
    if ctx.out16 is None:
        dx1, parts["attn_norm"] = ops.rmsnorm_backward(dxn1.reshape(b, T, C), rms1, xp)
        _add_into(dh, dx1, dx_out, ctx)
    else:  # the norm's kernel adds dh and rounds the sum into the layer's 16-bit dx
        _, parts["attn_norm"] = ops.rmsnorm_backward(dxn1.reshape(b, T, C), rms1, xp,
                                                     residual=dh, out=dx_out)


def layer_forward(x, p, ctx, recompute="none"):
    """x (B, T, C) ctx.dtype -> (y (B, T, C) ctx.dtype, cache)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    xp = ctx.xp
    B = x.shape[0]
    chunks = ctx.split(B)
    y = xp.empty(x.shape, ctx.dtype)  # (B, T, C)
    with ctx.scratch(WORK_TAG, _reserved_nbytes(ctx, B, x.shape[1])), \
            ctx.scratch(SCRATCH_TAG, _gemm_weight_nbytes(p, ctx)):
        w = _gemm_weights(p, ctx)
        kept = ctx.map(lambda sl: _layer_fwd_chunk(x[sl], p, w, ctx, recompute, y[sl]), chunks)
    return y, BlockCache("layer", recompute, x, chunks, None if recompute == "full" else kept)


def layer_backward(dy, cache, p, g, ctx):
    """dy (B, T, C) -> dx (B, T, C) ctx.dtype; adds the weight gradients into g (fp32)."""
    xp = ctx.xp
    x, chunks = cache.x, cache.chunks
    C, H, KV, D, F = _dims(ctx)
    HD, KVD = H * D, KV * D
    dx = xp.empty(x.shape, ctx.dtype)  # (B, T, C)

    def run(i):
        sl = chunks[i]
        if cache.parts is None:  # recompute == "full": re-run the forward (no output needed)
            kept = _layer_fwd_chunk(x[sl], p, w, ctx, "none", None)
        else:
            kept = cache.parts[i]
        return _layer_bwd_chunk(dy[sl], x[sl], kept, p, w, ctx, dx[sl])

    pairs = [
        ("attn.wq", "wqkv", 0), ("attn.wk", "wqkv", HD), ("attn.wv", "wqkv", HD + KVD),
        ("attn.wo", "wo", 0), ("mlp.w_gate", "wgu", 0), ("mlp.w_up", "wgu", F),
        ("mlp.w_down", "wd", 0), ("attn_norm", "attn_norm", 0), ("mlp_norm", "mlp_norm", 0),
    ]
    with ctx.scratch(WORK_TAG, _reserved_nbytes(ctx, *x.shape[:2], backward=True)), \
            ctx.scratch(SCRATCH_TAG, _gemm_weight_nbytes(p, ctx)):
        w = _gemm_weights(p, ctx)
        parts = ctx.map(run, range(len(chunks)))
        if ctx.half_layout:  # the GEMMs' operands are in parts until they add into g
            accumulate_gemms(*_stacked_grads(g, pairs[:-2], parts, ctx), ctx)
            pairs = pairs[-2:]  # the norms' partials
    accumulate(g, parts, pairs, ctx)
    return dx


def _stacked_grads(g, pairs, parts, ctx):
    """(g, parts, pairs) for `accumulate_gemms`: on a device, the gradients of wq, wk, wv (and of
    w_gate, w_up) as one (rows, C) view where they lie back to back in memory (a block's flat
    gradient keeps them so), one GEMM each instead of three (two); on the host as given (its
    GEMMs go in row blocks for its threads, `GRAD_BLOCKS`)."""
    if ctx.host:
        return g, parts, pairs
    g, out = dict(g), []
    for key, names in _STACKS.items():
        view = stacked_rows([g[n] for n in names], writeable=True)
        if view is not None:
            g[key] = view
            out.append((key, key, 0))
    done = {n for key, *_ in out for n in _STACKS[key]}
    return g, parts, out + [pr for pr in pairs if pr[0] not in done]


@timed("grad accumulate")
def accumulate(g, parts, pairs, ctx):
    """g[name] += part[key][r0 : r0 + len(g[name])] for every chunk's part, in chunk order (the
    chunks are the batch's, so the order never depends on the thread count); the rows of each
    gradient are split across the threads (elementwise: any split gives the same bits)."""
    n = ctx.parts()

    def add(i):
        for name, key, r0 in pairs:
            dst = g[name]
            a, b = dst.shape[0] * i // n, dst.shape[0] * (i + 1) // n
            for part in parts:
                dst[a:b] += part[key][r0 + a : r0 + b]

    ctx.map(add, range(n))


# `accumulate_gemms` cuts a weight gradient into at most GRAD_BLOCKS blocks of rows (enough for
# the threads), each of at least GRAD_BLOCK_ROWS rows (GEMMs large enough to run at speed)
GRAD_BLOCKS, GRAD_BLOCK_ROWS = 8, 128


@timed("grad accumulate")
def accumulate_gemms(g, parts, pairs, ctx, alpha=1.0):
    """The 16-bit layout's `accumulate`: g[name] += alpha * dy[:, r0 : r0 + len(g[name])].T @ x for
    every chunk's (dy, x) = part[key], each chunk's product added by the GEMM itself (beta = 1)
    in chunk order, with no fp32 partial. The rows of each gradient go in blocks
    (`GRAD_BLOCKS`, `GRAD_BLOCK_ROWS`), spread over the threads. So every call's shapes, and
    the order in which each element is summed, are fixed by the batch and the model alone: any
    thread count gives the same bits."""
    ops, half = ctx.kernels, ctx.gemm_half
    jobs = []
    for name, key, r0 in pairs:
        rows = g[name].shape[0]
        # a device's gradient in one GEMM a chunk (its blocks are for the host's threads)
        step = max(GRAD_BLOCK_ROWS, -(-rows // GRAD_BLOCKS)) if ctx.host else rows
        jobs += [(g[name], key, r0, a, min(a + step, rows)) for a in range(0, rows, step)]

    def run(job):
        dst, key, r0, a, b = job
        for part in parts:  # in chunk order
            dy, x = part[key]
            ops.gemm(dy[:, r0 + a : r0 + b].T, x, out=dst[a:b], xp=ctx.xp, half=half,
                     accumulate=True, alpha=alpha)

    ctx.map(run, jobs)


__all__ = [
    "GRAD_BLOCKS",
    "GRAD_BLOCK_ROWS",
    "WORK_TAG",
    "BlockCache",
    "accumulate",
    "accumulate_gemms",
    "as_compute",
    "cache_arrays",
    "cache_nbytes",
    "embed_backward",
    "embed_forward",
    "gemm_dtype",
    "kernel_input",
    "layer_backward",
    "layer_cache_nbytes",
    "layer_forward",
    "layer_workspace_nbytes",
]
