"""The head block: the final RMSNorm, the LM head and the mean token cross-entropy.

    head_forward(x, targets, p, ctx, backward=False) -> (loss, cache)
    head_backward(dscale, cache, p, g, ctx) -> dx
    head_logits(x, p, ctx) -> logits (inference: the forward without the loss)
    head_workspace_nbytes(ctx, batch, seq_len, backward) -> int (what the memory plan counts)

The interface and conventions are `exec.layers`' (`p`, `g`, the cache, the workspace under
`scratch.exec`). With tied embeddings the caller passes the embedding's view and gradient as
the head's `p["weight"]` / `g["weight"]`.

Two ways (`ctx.head_once`, `run.head`). **Once**, on a device whose GEMMs and kernels write 16
bits (`ctx.out16`), for a forward a backward will follow (`backward=True`): one GEMM writes the
logits (N, V) whole in 16 bits, and the loss's kernel writes each row's gradient over them in
the same launch, times `DLOGITS_SCALE` (the loss's seed is not known yet). The cache keeps them
and the normed rows, and the backward runs two GEMMs that scale by the seed themselves (alpha):
dxn = dlogits @ w and g["weight"] += dlogits.T @ xn. That is three calls each way, and 2
bytes a token and vocabulary entry held from the forward to the backward, as PyTorch's autocast
holds its logits.

**In chunks** (a host, fp32, and any forward with no backward to follow), the logits never
exist whole. The forward walks them by rows, at most `head_chunk_bytes` of
fp32 at a time, and keeps each row's log-sum-exp. The backward walks them by columns of the
vocabulary, every batch chunk at each, and recomputes each chunk's logits from the kept
statistics (docs/INTERNALS.md, "Decisions, and why": the head's backward walks the vocabulary).
In the 16-bit layout (`ctx.half_layout`) each chunk's logits' gradient stays in 16 bits until
its weight GEMMs, which add into the gradient themselves (`layers.accumulate_gemms`), and the
chunks' terms of dxn are added by their GEMMs too: no fp32 piece or part.
"""

from __future__ import annotations

from ratrain.exec.gemm import SCRATCH_TAG
from ratrain.exec.layers import (
    WORK_TAG,
    BlockCache,
    accumulate,
    accumulate_gemms,
    gemm_dtype,
    kernel_input,
)
from ratrain.exec.profile import timed

# what the head computed once writes over its 16-bit logits: (softmax - onehot) times this power
# of two, which leaves |dlogits| <= 2**15 under fp16's largest (65504) and puts fp16's smallest
# normal at probabilities of 2**-29; the GEMMs' alpha divides it out again, exactly
DLOGITS_SCALE = 2.0 ** 15


def _head_rows(ctx, V):
    """Rows of the forward's logits chunk: (rows, V) fp32 within `head_chunk_bytes`."""
    return max(1, ctx.head_chunk_bytes // (4 * V))


def _head_cols(ctx, N):
    """Vocabulary columns of the backward's logits chunk: (N, cols) fp32 within
    `head_chunk_bytes`."""
    return max(1, ctx.head_chunk_bytes // (4 * N))


def head_workspace_nbytes(ctx, batch: int, seq_len: int, backward: bool = False) -> int:
    """An estimate of the transient workspace of one head call on a micro-batch of `batch`
    sequences. Forward, per batch chunk running at once: its fp32 rows (the input, the normed
    input, the norm's temporaries, statistics) and one logits chunk (`head_chunk_bytes` of
    fp32; the log-sum-exp takes a copy). Backward, every batch chunk at once (they meet at each
    vocabulary chunk): its rows (also dxn and a GEMM's result) and its weight-gradient piece
    (columns x C fp32; in the 16-bit layout its 16-bit logits' gradient, rows x columns), and
    a logits chunk per chunk running. On a device the logits chunk also has its 16-bit GEMM
    result and operand copy. The weights' fp32 copy on the host is `scratch.gemm`'s."""
    C, V = ctx.model.hidden, ctx.model.vocab_size
    chunks = ctx.split(batch)
    running = min(len(chunks), ctx.parts())
    n = max(s.stop - s.start for s in chunks) * seq_len  # rows of the largest chunk
    if ctx.head_once:  # the 16-bit logits and normed rows are the cache's: a possible fp32
        # copy of the input and the rows' statistics forward; dxn, the norm's fp32 dx and its
        # temporaries backward
        return (len(chunks) * 4 * n * (3 * C + 2) if backward
                else running * 4 * n * (C + 2))
    per_logit = (4 if backward else 8) if ctx.host else 10
    logits = min(ctx.head_chunk_bytes // 4, n * V) * per_logit
    if not backward:
        return running * (4 * n * (4 * C + 4) + logits)
    cols = min(_head_cols(ctx, n), V)
    piece = 2 * n * cols if ctx.half_layout else 4 * cols * C
    return len(chunks) * (4 * n * (6 * C + 4) + piece) + running * logits


@timed("head")
def _head_fwd_chunk(x, targets, p, w, ctx):
    xp, ops, ct = ctx.xp, ctx.kernels, ctx.compute
    xn, rstd = _head_norm(x, p, ctx)  # (N, C)
    N = xn.shape[0]
    t = targets.reshape(N)
    lse = xp.empty(N, ct)
    losses = xp.empty(N, ct)
    rows = _head_rows(ctx, w.shape[0])
    for r0 in range(0, N, rows):  # bounded logits: (rows, V) at a time
        r1 = min(r0 + rows, N)
        z = ops.gemm(xn[r0:r1], w.T, xp=xp, half=ctx.gemm_half)  # (rows, V)
        ops.cross_entropy_rows(z, t[r0:r1], xp, out=(lse[r0:r1], losses[r0:r1]))
    return {"rstd": rstd, "lse": lse}, losses


@timed("head")
def _head_fwd_once(x, targets, p, w, ctx):
    """One batch chunk's forward computed once (see the module) -> (kept, losses)."""
    xp = ctx.xp
    xn, rstd = _head_norm(x, p, ctx)  # (N, C), in 16 bits where the kernels write those
    N = xn.shape[0]
    d = ctx.kernels.gemm(xn, w.T, out=xp.empty((N, w.shape[0]), ctx.gemm_half), xp=xp,
                         half=ctx.gemm_half)  # the logits (N, V), rounded once into 16 bits
    lse, losses = xp.empty(N, ctx.compute), xp.empty(N, ctx.compute)
    ctx.kernels.cross_entropy_rows(d, targets.reshape(N), xp, out=(lse, losses),
                                   grad=DLOGITS_SCALE)  # d: the logits' gradient now
    return {"rstd": rstd, "xn": xn, "dlogits": d}, losses


@timed("head")
def _head_bwd_once(x, kept, p, w, alpha, ctx, dx_out):
    """One batch chunk's backward after a forward computed once: dxn = alpha * dlogits @ w
    by one GEMM, then the norm's backward into dx_out."""
    dxn = ctx.kernels.gemm(kept["dlogits"], w, xp=ctx.xp, half=ctx.gemm_half, alpha=alpha)
    return _head_bwd_finish(dxn.reshape(x.shape), (kernel_input(ctx, x), kept["rstd"], p["norm"]),
                            ctx, dx_out)


class _HeadRows:
    """One batch chunk's state through the head's backward (see `head_backward`)."""

    def __init__(self, x, targets, kept, p, ctx, cols, V):
        xp, half16 = ctx.xp, ctx.gemm_half
        b, T, C = x.shape
        self.shape, N = x.shape, b * T
        xk = kernel_input(ctx, x)
        self.rms = (xk, kept["rstd"], p["norm"])
        # the normed rows again (written in the GEMMs' 16 bits where the kernels write those)
        xn = ctx.kernels.rmsnorm_recompute(
            xk, kept["rstd"], p["norm"], xp,
            out=None if ctx.out16 is None else xp.empty(x.shape, ctx.out16)).reshape(N, C)
        self.xg = xn if half16 is None else ctx.kernels.cast(xn, half16)  # GEMMs' operand
        self.lse, self.targets = kept["lse"], targets.reshape(N)  # (N,) each
        self.dxn = xp.empty((N, C), ctx.compute)  # (N, C): the sum over vocabulary chunks
        many = cols < V and not ctx.half_layout  # the layout's GEMMs add into dxn themselves
        self.part = xp.empty((N, C), ctx.compute) if many else None  # a chunk's term of it
        # one chunk's weight-gradient rows (the layout keeps the 16-bit dlogits instead)
        self.piece = None if ctx.half_layout else xp.empty((cols, C), ctx.compute)


@timed("head")
def _head_bwd_rows(*args) -> _HeadRows:
    return _HeadRows(*args)


@timed("head")
def _head_bwd_cols(s, w, k, v0, v1, coef, ctx):
    """Vocabulary columns [v0, v1) (chunk k) of one batch chunk's head backward: its term of
    dxn, and its weight-gradient rows (the chunk's `piece`, returned), or in the 16-bit layout
    the chunk's 16-bit dlogits (N, v1 - v0), the weight GEMM's operand."""
    xp, ops, half16 = ctx.xp, ctx.kernels, ctx.gemm_half
    wk = w[v0:v1]  # (cols, C)
    d = ops.gemm(s.xg, wk.T, xp=xp, half=half16)  # logits (N, cols)
    # (softmax - the one-hot of the targets in this chunk) * coef, over d or rounded once into
    # the 16-bit operand of both GEMMs
    dg = d if half16 is None else xp.empty(d.shape, half16)
    ops.cross_entropy_grad(d, s.targets, s.lse, coef, xp, v0=v0,
                           out=None if half16 is None else dg)
    if ctx.half_layout:
        ops.gemm(dg, wk, out=s.dxn, xp=xp, half=half16, accumulate=k > 0)
        return dg
    piece = s.piece[: v1 - v0]
    ops.gemm(dg.T, s.xg, out=piece, xp=xp, half=half16)  # (cols, C)
    if k == 0:
        ops.gemm(dg, wk, out=s.dxn, xp=xp, half=half16)
    else:
        s.dxn += ops.gemm(dg, wk, out=s.part, xp=xp, half=half16)
    return piece


@timed("head")
def _head_bwd_finish(dxn, rms, ctx, dx_out):
    """The final norm's backward of one batch chunk: dxn (b, T, C) and the norm's cache `rms`
    -> dx into dx_out; returns the chunk's {"norm": its weight's gradient}."""
    if ctx.out16 is not None:  # the norm's kernel rounds dx into the 16-bit dx_out
        _, dnorm = ctx.kernels.rmsnorm_backward(dxn, rms, ctx.xp, out=dx_out)
        return {"norm": dnorm}
    dx, dnorm = ctx.kernels.rmsnorm_backward(dxn, rms, ctx.xp)
    ctx.kernels.assign(dx_out, dx)
    return {"norm": dnorm}


def _head_norm(x, p, ctx):
    """The head's final norm of x (b, T, C), in the compute dtype (in the GEMMs' 16 bits where
    a device's kernels write those, `ctx.out16`) -> (xn (b*T, C), rstd)."""
    b, T, C = x.shape
    o16 = ctx.out16
    xn, (_, rstd, _) = ctx.kernels.rmsnorm_forward(
        kernel_input(ctx, x), p["norm"], ctx.model.norm_eps, ctx.xp,
        out=None if o16 is None else ctx.xp.empty(x.shape, o16))  # (b, T, C)
    return xn.reshape(b * T, C), rstd


def head_logits(x, p, ctx):
    """x (B, T, C) -> next-token logits (B, T, V) in the compute dtype: the head's forward
    (the same norm, weight and GEMM) without the loss, for inference."""
    B, T, _ = x.shape
    w = _head_weight(p, ctx)
    with ctx.scratch(SCRATCH_TAG, w.nbytes if w is not p["weight"] else 0):
        xn, _ = _head_norm(x, p, ctx)  # (B*T, C)
        return ctx.kernels.gemm(xn, w.T, xp=ctx.xp, half=ctx.gemm_half).reshape(B, T, -1)


def _head_weight(p, ctx):
    w = p["weight"]
    wdt = gemm_dtype(ctx)
    return w if w.dtype == wdt else ctx.kernels.cast(w, wdt)


def head_forward(x, targets, p, ctx, backward=False):
    """x (B, T, C), targets (B, T) -> (mean token loss, fp32 0-d array, cache). `backward`:
    whether a backward will follow (the head is then computed once where `ctx.head_once`)."""
    xp = ctx.xp
    ct = ctx.compute
    chunks = ctx.split(x.shape[0])
    w = _head_weight(p, ctx)
    fwd = _head_fwd_once if backward and ctx.head_once else _head_fwd_chunk
    with ctx.scratch(WORK_TAG, head_workspace_nbytes(ctx, *x.shape[:2])), \
            ctx.scratch(SCRATCH_TAG, w.nbytes if w is not p["weight"] else 0):
        res = ctx.map(lambda sl: fwd(x[sl], targets[sl], p, w, ctx), chunks)
    losses = xp.concatenate([r[1] for r in res])  # (B * T,)
    loss = losses.mean(dtype=ct)
    return loss, BlockCache("head", "none", x, chunks, [r[0] for r in res], {"targets": targets})


def head_backward(dscale, cache, p, g, ctx):
    """Seeds d(loss) = dscale; adds into g["norm"], g["weight"]; -> dx (B, T, C) ctx.dtype.

    The logits are walked by chunks of the vocabulary, every batch chunk at each (in the
    threads): each batch chunk's weight-gradient rows of the chunk (its `piece`) are added into
    g in chunk order, as `accumulate` adds whole parts, so no (V, C) part is ever made, and
    the sums over chunks go into each batch chunk's dxn (tokens x hidden)."""
    xp = ctx.xp
    x, chunks, targets = cache.x, cache.chunks, cache.extra["targets"]
    coef = float(dscale) / (x.shape[0] * x.shape[1])
    dx = xp.empty(x.shape, ctx.dtype)
    w = _head_weight(p, ctx)
    if "dlogits" in cache.parts[0]:  # computed once by the forward
        return _backward_once(coef / DLOGITS_SCALE, cache, p, g, w, ctx, dx)
    V, gw = w.shape[0], g["weight"]
    cols = min(_head_cols(ctx, max(c.stop - c.start for c in chunks) * x.shape[1]), V)
    n = ctx.parts()
    with ctx.scratch(WORK_TAG, head_workspace_nbytes(ctx, *x.shape[:2], backward=True)), \
            ctx.scratch(SCRATCH_TAG, w.nbytes if w is not p["weight"] else 0):
        rows = ctx.map(lambda i: _head_bwd_rows(x[chunks[i]], targets[chunks[i]],
                                                cache.parts[i], p, ctx, cols, V),
                       range(len(chunks)))
        for k, v0 in enumerate(range(0, V, cols)):
            v1 = min(v0 + cols, V)
            pieces = ctx.map(lambda s, k=k, v0=v0, v1=v1: _head_bwd_cols(s, w, k, v0, v1, coef,
                                                                       ctx), rows)
            if ctx.half_layout:  # gw[v0:v1] += dlogits.T @ xn, chunk by chunk, by the GEMMs
                accumulate_gemms({"w": gw[v0:v1]}, [{"w": (dg, s.xg)} for dg, s in
                                                    zip(pieces, rows)], [("w", "w", 0)], ctx)
                continue

            def add(i, v0=v0, v1=v1, pieces=pieces):  # rows split across the threads
                a, b = (v1 - v0) * i // n, (v1 - v0) * (i + 1) // n
                for piece in pieces:  # in chunk order
                    gw[v0 + a : v0 + b] += piece[a:b]

            ctx.map(add, range(n))
        parts = ctx.map(lambda i: _head_bwd_finish(rows[i].dxn.reshape(rows[i].shape),
                                                   rows[i].rms, ctx, dx[chunks[i]]),
                        range(len(chunks)))
        accumulate(g, parts, [("norm", "norm", 0)], ctx)
    return dx


def _backward_once(alpha, cache, p, g, w, ctx, dx):
    """`head_backward` after a forward computed once: each chunk's dxn and norm, then
    g["weight"] += alpha * dlogits.T @ xn by the GEMMs, chunk by chunk."""
    x, chunks = cache.x, cache.chunks
    with ctx.scratch(WORK_TAG, head_workspace_nbytes(ctx, *x.shape[:2], backward=True)), \
            ctx.scratch(SCRATCH_TAG, w.nbytes if w is not p["weight"] else 0):
        parts = ctx.map(lambda i: _head_bwd_once(x[chunks[i]], cache.parts[i], p, w, alpha, ctx,
                                                 dx[chunks[i]]), range(len(chunks)))
        accumulate_gemms({"w": g["weight"]}, [{"w": (k["dlogits"], k["xn"])}
                                             for k in cache.parts], [("w", "w", 0)], ctx, alpha)
        accumulate(g, parts, [("norm", "norm", 0)], ctx)
    return dx


__all__ = ["DLOGITS_SCALE", "head_backward", "head_forward", "head_logits", "head_workspace_nbytes"]
