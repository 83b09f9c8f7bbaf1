"""Device kernels no run calls: the fused cross-entropy (loss and gradient in one launch), the
softmax of an attention score tile, and the fp32 <-> fp16 cast. They were written beside
`ratrain.exec.devkernels` for the GPU path; no step calls them (the head computes its loss
from `devkernels.logsumexp_rows`, attention runs through its backend, casts through the kernel
table), so they live here, with their tests (tests/test_devkernels.py) and their benchmark
(benchmarks/devkernels.py), until a GPU measurement says one pays and it is wired.

    kernel                    matches                                     launch
    cross_entropy_forward     kernels.cross_entropy_forward (mean loss)    a block per row
    cross_entropy_backward    kernels.cross_entropy_backward               grid-stride
    cross_entropy_fused       both at once: losses, lse, dlogits           a block per row
    softmax_forward           attention_forward's softmax of a score tile  a block per row
    softmax_backward          attention_backward's dS                      a block per row
    cast                      fused.cast_into (round to nearest even)      grid-stride

They are built as `devkernels`' own are (its device functions, launch and checks) and share its
conventions: float32 / float16 inputs computed in fp32, `threads` per block, results float32
or `out`'s dtype.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

from ratrain.exec import devlaunch as dk
from ratrain.exec.devkernels import LONG_ROW_THREADS
from ratrain.exec.devlaunch import F16, F32
from ratrain.exec.devlaunch import block_threads as _threads
from ratrain.exec.devlaunch import check as _check
from ratrain.exec.devlaunch import grid as _grid
from ratrain.exec.devlaunch import launch as _launch
from ratrain.exec.devlaunch import out_array as _out
from ratrain.exec.devlaunch import rows as _rows

# set by `_kernels`: module globals, as the simulator swaps the `cuda` global of a kernel's
# module for its per-thread stand-in
cuda = float32 = None


@functools.cache
def _kernels(TPB: int) -> SimpleNamespace:
    global cuda, float32
    cuda = dk.load()
    float32 = cuda.float32
    f = dk.device_functions(TPB)
    fexp, flog, fmax, block_reduce = f.fexp, f.flog, f.fmax, f.block_reduce
    row_logsumexp = f.row_logsumexp
    inf = math.inf

    @cuda.jit
    def ce_rows(z, targets, lse, losses, d, scale, with_grad):
        """A block per row of z (N, V): lse = log(sum(exp(z - max))) + max; the row's loss
        lse - z[t] (NaN for a target outside [0, V)); d = (exp(z - lse) - onehot) * scale."""
        sh = cuda.shared.array(TPB, float32)
        r, t = cuda.blockIdx.x, cuda.threadIdx.x
        V = z.shape[1]
        tr = targets[r]
        zt = float32(math.nan)  # the target's logit, read before the barriers (d may be z)
        if t == 0 and 0 <= tr < V:
            zt = float32(z[r, tr])
        ls = row_logsumexp(sh, z, r, t)
        if t == 0:
            lse[r] = ls
            losses[r] = ls - zt
        if with_grad:  # every read of the row is done (the tree synchronised): d may be z
            for c in range(t, V, TPB):
                p = fexp(float32(z[r, c]) - ls)
                if c == tr:
                    p -= float32(1.0)
                d[r, c] = p * scale

    @cuda.jit
    def ce_grad(z, targets, lse, scale, d):  # elementwise from the rows' lse
        V = z.shape[1]
        i, step = cuda.grid(1), cuda.gridsize(1)
        while i < z.shape[0] * V:
            r = i // V
            c = i - r * V
            p = fexp(float32(z[r, c]) - float32(lse[r]))
            if c == targets[r]:
                p -= float32(1.0)
            d[r, c] = p * scale
            i += step

    @cuda.jit
    def softmax_fwd(s, p, lse, scale, causal, q0, k0, tq, with_lse):
        """A block per row of s (R, Tk), row r the query q0 + r % tq against keys k0...: the
        scaled, causally masked softmax; lse of the scaled row (-inf, p = 0 when all masked)."""
        sh = cuda.shared.array(TPB, float32)
        r, t = cuda.blockIdx.x, cuda.threadIdx.x
        K = s.shape[1]
        last = K if not causal else min(K, q0 + r % tq - k0 + 1)  # keys c < last are visible
        m = float32(-inf)
        for c in range(t, last, TPB):
            m = fmax(m, float32(s[r, c]) * scale)
        m = block_reduce(sh, t, m, True)
        acc = float32(0.0)
        if m != float32(-inf):
            for c in range(t, last, TPB):
                acc += fexp(float32(s[r, c]) * scale - m)
        total = block_reduce(sh, t, acc, False)
        if with_lse and t == 0:
            lse[r] = flog(total) + m
        for c in range(t, K, TPB):
            if c < last:
                p[r, c] = fexp(float32(s[r, c]) * scale - m) / total
            else:
                p[r, c] = float32(0.0)

    @cuda.jit
    def softmax_bwd(dp, p, ds, scale, delta, with_delta):
        """ds = p * (dp - rowsum(dp * p)) * scale (rowsum given as delta: the flash form)."""
        sh = cuda.shared.array(TPB, float32)
        r, t = cuda.blockIdx.x, cuda.threadIdx.x
        K = p.shape[1]
        if with_delta:
            rs = float32(delta[r])
        else:
            acc = float32(0.0)
            for c in range(t, K, TPB):
                acc += float32(dp[r, c]) * float32(p[r, c])
            rs = block_reduce(sh, t, acc, False)
        for c in range(t, K, TPB):
            ds[r, c] = float32(p[r, c]) * (float32(dp[r, c]) - rs) * scale

    @cuda.jit
    def cast(src, dst, scale, scaled):  # flat; dst = src (* scale in fp32), rounded once
        i, step = cuda.grid(1), cuda.gridsize(1)
        while i < src.shape[0]:
            if scaled:
                dst[i] = float32(src[i]) * scale
            else:
                dst[i] = src[i]
            i += step

    return SimpleNamespace(ce_rows=ce_rows, ce_grad=ce_grad, softmax_fwd=softmax_fwd,
                           softmax_bwd=softmax_bwd, cast=cast)


# --------------------------------------------------------------------------------------------
# Cross-entropy (mean over tokens)
# --------------------------------------------------------------------------------------------


def _ce(logits, targets, xp, scale, grad, out, threads):
    _check(xp, logits)
    tpb = _threads(threads, LONG_ROW_THREADS)
    if logits.ndim != 2 or tuple(targets.shape) != (logits.shape[0],):
        raise ValueError(f"cross-entropy: logits (N, V) and targets (N,), got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if targets.dtype.kind not in "iu":
        raise TypeError(f"cross-entropy: targets are token ids (integers), not {targets.dtype}")
    N = logits.shape[0]
    lse, loss = xp.empty(N, F32), xp.empty(N, F32)
    d = _out(out, logits.shape, F32, xp) if grad else None
    if N:
        _launch(_kernels(tpb).ce_rows, N, tpb, xp, logits, targets, lse, loss,
                d if grad else logits, np.float32(scale), grad)
    return loss, lse, d


def cross_entropy_forward(logits, targets, xp, threads=None):
    """logits (N, V), targets (N,) integer -> (mean loss, 0-d float32, cache (logits, targets,
    lse)): `kernels.cross_entropy_forward`. A target outside [0, V) makes its row's loss NaN
    (the reference raises IndexError; a kernel cannot, and must not read out of bounds)."""
    losses, lse, _ = _ce(logits, targets, xp, 1.0, False, None, threads)
    return losses.mean(dtype=F32), (logits, targets, lse)


def cross_entropy_backward(dloss, cache, xp, out=None, threads=None):
    """-> dlogits (N, V) = (softmax(logits) - onehot(targets)) * dloss / N, float32 (or `out`'s
    dtype): `kernels.cross_entropy_backward`. `float(dloss)`: give a Python number (a device
    0-d array would be a host sync)."""
    z, targets, lse = cache
    _check(xp, z)
    tpb = _threads(threads)
    d = _out(out, z.shape, F32, xp)
    if z.size:
        _launch(_kernels(tpb).ce_grad, _grid(z.size, tpb), tpb, xp, z, targets, lse,
                np.float32(float(dloss) / z.shape[0]), d)
    return d


def cross_entropy_fused(logits, targets, scale, xp, out=None, threads=None):
    """Loss and gradient in one launch, a block per row: -> (losses (N,), lse (N,), dlogits)
    with losses = lse - logits[t] (float32), dlogits = (softmax - onehot(t)) * scale (float32,
    or `out`'s dtype; `out` may be `logits` itself: each row is read before it is written).
    `kernels.cross_entropy_forward` / `_backward` with scale = dloss / N (the mean's factor;
    the head passes dscale / (B * T))."""
    return _ce(logits, targets, xp, scale, True, out, threads)


# --------------------------------------------------------------------------------------------
# Attention: the softmax of a materialised or tiled score block
# --------------------------------------------------------------------------------------------


def softmax_forward(s, xp, scale=1.0, causal=True, q0=0, k0=0, out=None, with_lse=False,
                    threads=None):
    """s (..., Tq, Tk) raw scores of queries q0 + i against keys k0 + j -> p = softmax(s * scale)
    along the last axis with keys j > i masked (causal), float32 (or `out`'s dtype; `out` may be
    `s`); with `with_lse` also the rows' logsumexp of the scaled scores (..., Tq) float32 (-inf,
    and p = 0, for a row whose keys are all masked). `kernels.attention_forward`'s softmax
    (scale applied to the scores, then the mask, the max subtracted, divided by the sum)."""
    _check(xp, s)
    if s.ndim < 2:
        raise ValueError(f"softmax: scores (..., Tq, Tk), got shape {tuple(s.shape)}")
    tpb = _threads(threads)
    p = _out(out, s.shape, F32, xp)
    lse = xp.empty(s.shape[:-1], F32) if with_lse else None
    s2 = _rows(s)
    if s2.shape[0] and s.shape[-1]:
        _launch(_kernels(tpb).softmax_fwd, s2.shape[0], tpb, xp, s2, _rows(p),
                lse.reshape(-1) if with_lse else s2[:, 0], np.float32(scale), bool(causal),
                int(q0), int(k0), int(s.shape[-2]), bool(with_lse))
    return (p, lse) if with_lse else p


def softmax_backward(dp, p, xp, scale=1.0, delta=None, out=None, threads=None):
    """dS = p * (dp - rowsum(dp * p)) * scale of (..., Tq, Tk) tiles, float32 (or `out`'s dtype;
    `out` may be `dp`): `kernels.attention_backward`'s ds. `delta` (..., Tq): the rows' sums
    given (flash attention's rowsum(dO * O), equal to rowsum(dP * P))."""
    _check(xp, dp, p)
    tpb = _threads(threads)
    ds = _out(out, p.shape, F32, xp)
    p2 = _rows(p)
    if p2.shape[0] and p.shape[-1]:
        _launch(_kernels(tpb).softmax_bwd, p2.shape[0], tpb, xp, _rows(dp), p2, _rows(ds),
                np.float32(scale), p2[:, 0] if delta is None else delta.reshape(-1),
                delta is not None)
    return ds


# --------------------------------------------------------------------------------------------
# Casts
# --------------------------------------------------------------------------------------------


def cast(src, dtype, xp, scale=1.0, out=None, threads=None):
    """src (float32 or float16) -> a C-contiguous `dtype` array (or into `out`) of src * scale,
    the product in fp32, rounded once to nearest even (scale 1: `fused.cast_into`, bitwise).
    The fp32 masters' fp16 views and fp16 activations' fp32 copies."""
    _check(xp, src)
    dtype = np.dtype(dtype)
    if dtype not in (F32, F16):
        raise TypeError(f"cast: to float32 or float16, not {dtype}")
    tpb = _threads(threads)
    dst = _out(out, src.shape, dtype, xp)
    if dst.dtype != dtype:
        raise ValueError(f"out: {dst.dtype}, expected {dtype}")
    if src.size:
        _launch(_kernels(tpb).cast, _grid(src.size, tpb), tpb, xp, src.reshape(-1),
                dst.reshape(-1), np.float32(scale), scale != 1.0)
    return dst


__all__ = ["cast", "cross_entropy_backward", "cross_entropy_forward", "cross_entropy_fused",
           "softmax_backward", "softmax_forward"]
