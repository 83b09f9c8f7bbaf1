"""Fused device kernels (numba-cuda): one launch where the cupy composition of `kernels` makes
several, for the GPU path's elementwise and row work.

Each public function takes the array module `xp` (cupy on a GPU; numpy or the stand-in under
numba-cuda's simulator, in the tests) and launches through `exec.devlaunch`, which loads
numba-cuda, checks the arguments and says how a launch goes on a GPU and in the simulator.

    kernel                    matches                                     launch
    rmsnorm_forward/backward  kernels.rmsnorm_* (fused._rmsnorm_*)         a block per row; dw:
                                                                            per-block partials,
                                                                            then a column sum
    rmsnorm_recompute         kernels.rmsnorm_recompute                   grid-stride
    swiglu_forward/backward   kernels.swiglu_* (fused._swiglu_*)           grid-stride
    rope_forward/backward     kernels.rope_* (fused._rope)                 grid-stride
    adamw                     fused.adamw (optim._adam_core's arithmetic)  grid-stride
    sum_squares               kernels.block_sq_norm (fp64 accumulation)      per-block partials,
                                                                            then one block

The kernel table (`exec.backends`) puts them in the references' place on a GPU rank (and on the
stand-in under the simulator, `run.devkernels: sim`).

Numerics: inputs are float32, float16 or bfloat16 (float64 stays on `kernels`, the
reference); every value is loaded into fp32 (`devlaunch.ld`: a bfloat16 through its bits,
exactly) and computed in fp32 in the reference's operator order, and results are rounded once
on store into the output's dtype (`devlaunch.st`; fp32 by default, as the reference returns;
an `out` of 16 bits fuses the cast, the same bits as a cast of the fp32 result). Row reductions are shared-memory trees (another order
than numpy's pairwise sums: a few ulps); the gradient norm accumulates in fp64 as the
reference does. Under the simulator the arithmetic is numpy's fp32 (exp, log, sqrt rounded from
double); on a GPU libdevice's expf/logf (within 2 ulps) and the compiler's fused
multiply-adds may change the last bit, so the tests compare with tolerances, not bitwise.
Caches keep the inputs as given (a 16-bit x stays 16-bit; it holds exactly the values the
reference's fp32 copy holds). Block size: `threads` per block, a power of two (on a GPU 256;
32 under the simulator, one Python thread per CUDA thread); each kernel set is compiled once
per block size. The head's cross-entropy has kernels of its own (`exec.devloss`).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

from ratrain.exec import devlaunch as dl
from ratrain.exec import fused
from ratrain.exec.devlaunch import F32, ld, st

# numba.cuda and its scalar types, set by `_kernels` from `load()`: module globals, as the
# simulator swaps the `cuda` global of a kernel's module for its per-thread stand-in
cuda = float32 = float64 = None

# device operations one call on non-empty arrays queues: its launches (an empty array's
# sum_squares: one, its zeroed result); what `exec.devcount` counts for a call on the
# stand-in (tested in the simulator)
LAUNCHES = {"rmsnorm_forward": 1, "rmsnorm_backward": 2, "rmsnorm_recompute": 1,
            "swiglu_forward": 1, "swiglu_backward": 1, "rope_forward": 1, "rope_backward": 1,
            "adamw": 1, "sum_squares": 2}
ROW_GROUPS = 1024  # RMSNorm backward: blocks (hence dw partials), each over every 1024th row


@functools.cache
def _kernels(TPB: int) -> SimpleNamespace:
    global cuda, float32, float64
    cuda = dl.load()
    float32, float64 = cuda.float32, cuda.float64
    f = dl.device_functions(TPB)
    fexp, block_reduce = f.fexp, f.block_reduce
    rope_pair = cuda.jit(device=True)(fused.rope_pair)
    adam_moments = cuda.jit(device=True)(fused.adam_moments)

    # -- RMSNorm --------------------------------------------------------------------------

    @cuda.jit
    def rmsnorm_fwd(x, w, eps, y, rstd, xc, with_copy):  # x, y, xc (R, C); w (C,); rstd (R,)
        sh = cuda.shared.array(TPB, float32)  # a block per row; with_copy: x into xc too
        r, t = cuda.blockIdx.x, cuda.threadIdx.x
        C = x.shape[1]
        acc = float32(0.0)
        for c in range(t, C, TPB):
            v = ld(x[r, c])
            acc += v * v
            if with_copy:
                st(xc, (r, c), v)
        ms = block_reduce(sh, t, acc, False) / float32(C)
        s = float32(1.0) / float32(math.sqrt(ms + eps))
        if t == 0:
            rstd[r] = s
        for c in range(t, C, TPB):
            st(y, (r, c), ld(x[r, c]) * s * ld(w[c]))

    @cuda.jit
    def rmsnorm_bwd(dy, x, rstd, w, res, dx, dx2, dwp, with_res, with_copy):
        # dwp (blocks, C): this block's rows' dw; with_res: res added to dx; with_copy: dx
        # also into dx2
        sh = cuda.shared.array(TPB, float32)
        b, t, nb = cuda.blockIdx.x, cuda.threadIdx.x, cuda.gridDim.x
        R, C = x.shape
        for r in range(b, R, nb):
            s = ld(rstd[r])
            acc = float32(0.0)
            for c in range(t, C, TPB):
                acc += ld(dy[r, c]) * ld(w[c]) * (ld(x[r, c]) * s)
            m = block_reduce(sh, t, acc, False) / float32(C)
            for c in range(t, C, TPB):
                xhat = ld(x[r, c]) * s
                d = (ld(dy[r, c]) * ld(w[c]) - xhat * m) * s
                if with_res:
                    d += ld(res[r, c])
                st(dx, (r, c), d)
                if with_copy:
                    st(dx2, (r, c), d)
        for c in range(t, C, TPB):  # each thread its columns, the block's rows in order
            acc = float32(0.0)
            for r in range(b, R, nb):
                acc += ld(dy[r, c]) * (ld(x[r, c]) * ld(rstd[r]))
            dwp[b, c] = acc

    @cuda.jit
    def rmsnorm_rec(x, rstd, w, y):  # x, y (R, C); rstd (R,); w (C,): grid-stride
        C = x.shape[1]
        i, step = cuda.grid(1), cuda.gridsize(1)
        while i < x.shape[0] * C:
            r = i // C
            c = i - r * C
            st(y, (r, c), ld(x[r, c]) * ld(rstd[r]) * ld(w[c]))
            i += step

    @cuda.jit
    def column_sum(parts, out):  # parts (P, C) -> out (C,): each column summed in row order
        c, step = cuda.grid(1), cuda.gridsize(1)
        while c < parts.shape[1]:
            acc = float32(0.0)
            for p in range(parts.shape[0]):
                acc += parts[p, c]
            out[c] = acc
            c += step

    # -- SwiGLU ---------------------------------------------------------------------------

    @cuda.jit
    def swiglu_fwd(gate, up, out):  # (N, F) each, any strides
        F = gate.shape[1]
        i, step = cuda.grid(1), cuda.gridsize(1)
        while i < gate.shape[0] * F:
            r = i // F
            c = i - r * F
            g = ld(gate[r, c])
            st(out, (r, c), g / (float32(1.0) + fexp(-g)) * ld(up[r, c]))
            i += step

    @cuda.jit
    def swiglu_bwd(dact, gate, up, dgate, dup, act, with_act):
        F = gate.shape[1]
        one = float32(1.0)
        i, step = cuda.grid(1), cuda.gridsize(1)
        while i < gate.shape[0] * F:
            r = i // F
            c = i - r * F
            g, u, da = ld(gate[r, c]), ld(up[r, c]), ld(dact[r, c])
            s = one / (one + fexp(-g))  # sigmoid(g)
            silu = g * s
            if with_act:
                st(act, (r, c), silu * u)
            st(dup, (r, c), da * silu)
            d = silu - silu * s + s  # d silu / dg, the reference's order
            st(dgate, (r, c), (da * u) * d)
            i += step

    # -- RoPE -----------------------------------------------------------------------------

    @cuda.jit
    def rope(x, cos, sin, out, sign):  # x, out (B, T, H, D) any strides; cos, sin (T, >= D/2)
        B, T, H, D = x.shape
        d = D // 2
        i, step = cuda.grid(1), cuda.gridsize(1)
        while i < B * T * H * d:
            k = i % d
            j = i // d
            h = j % H
            j //= H
            tt = j % T
            b = j // T
            y1, y2 = rope_pair(ld(x[b, tt, h, k]), ld(x[b, tt, h, k + d]),
                               ld(cos[tt, k]), ld(sin[tt, k]), sign)
            st(out, (b, tt, h, k), y1)
            st(out, (b, tt, h, k + d), y2)
            i += step

    # -- AdamW, the gradient norm -----------------------------------------------------------

    @cuda.jit
    def adamw(p, m, v, g, gscale, keep, b2, omb2, w, omw, lerp_low, step_size, bc2, eps):
        i, step = cuda.grid(1), cuda.gridsize(1)
        while i < p.shape[0]:
            mi, vi = adam_moments(m[i], v[i], g[i] * gscale, b2, omb2, w, omw, lerp_low)
            p[i] = p[i] * keep + (mi * (-step_size)) / (float32(math.sqrt(vi)) / bc2 + eps)
            m[i] = mi
            v[i] = vi
            i += step

    @cuda.jit
    def sum_squares(a, parts):  # parts (blocks,) float64: each block's sum of squares
        sh = cuda.shared.array(TPB, float64)
        t = cuda.threadIdx.x
        i, step = cuda.grid(1), cuda.gridsize(1)
        acc = float64(0.0)
        while i < a.shape[0]:
            v = float64(a[i])
            acc += v * v
            i += step
        total = block_reduce(sh, t, acc, False)
        if t == 0:
            parts[cuda.blockIdx.x] = total

    @cuda.jit
    def sum_parts(parts, out):  # one block: out[0] = the sum of parts (float64)
        sh = cuda.shared.array(TPB, float64)
        t = cuda.threadIdx.x
        acc = float64(0.0)
        for i in range(t, parts.shape[0], TPB):
            acc += parts[i]
        total = block_reduce(sh, t, acc, False)
        if t == 0:
            out[0] = total

    return SimpleNamespace(**{k: v for k, v in locals().items() if hasattr(v, "py_func")})


# --------------------------------------------------------------------------------------------
# RMSNorm: y = x / sqrt(mean(x^2) + eps) * w
# --------------------------------------------------------------------------------------------


def rmsnorm_forward(x, w, eps, xp, out=None, x_copy=None, threads=None):
    """x (..., C), w (C,) -> y (..., C) (float32, or `out`'s dtype), cache (x, rstd (..., 1)
    float32, w), and x written into `x_copy` in its dtype when given: `kernels.rmsnorm_forward`."""
    dl.check(xp, x, w)
    tpb = dl.block_threads(threads)
    y = dl.out_array(out, x.shape, F32, xp)
    xc = None if x_copy is None else dl.out_array(x_copy, x.shape, F32, xp)
    rstd = xp.empty((*x.shape[:-1], 1), F32)
    if x.size:
        x2 = dl.rows(x)
        dl.launch(_kernels(tpb).rmsnorm_fwd, x2.shape[0], tpb, xp, x2, w, np.float32(eps),
                  dl.rows(y), rstd.reshape(-1), dl.rows(y if xc is None else xc),
                  xc is not None)
    return y, (x, rstd, w)


def rmsnorm_recompute(x, rstd, w, xp, out=None, threads=None):
    """y = x * rstd * w (..., C) from the forward's kept rstd (..., 1) (float32, or `out`'s
    dtype): `kernels.rmsnorm_recompute`."""
    dl.check(xp, x, rstd, w)
    tpb = dl.block_threads(threads)
    y = dl.out_array(out, x.shape, F32, xp)
    if x.size:
        dl.launch(_kernels(tpb).rmsnorm_rec, dl.grid(x.size, tpb), tpb, xp, dl.rows(x),
                  rstd.reshape(-1), w, dl.rows(y))
    return y


def rmsnorm_backward(dy, cache, xp, residual=None, out=None, copy_out=None, threads=None):
    """-> (dx (..., C) float32 (or `out`'s dtype), dw (C,) float32), `residual` added to dx and
    dx also written into `copy_out` when given: `kernels.rmsnorm_backward`. dw: each of at most
    ROW_GROUPS blocks sums its rows (every ROW_GROUPS-th) per column, then the partials are
    summed in block order."""
    x, rstd, w = cache
    dl.check(xp, dy, x, rstd, w, *(a for a in (residual,) if a is not None))
    tpb = dl.block_threads(threads)
    dx = dl.out_array(out, x.shape, F32, xp)
    dx2 = None if copy_out is None else dl.out_array(copy_out, x.shape, F32, xp)
    if residual is not None and (tuple(residual.shape) != tuple(x.shape)
                                 or not residual.flags.c_contiguous):
        raise ValueError(f"residual: a C-contiguous {tuple(x.shape)} array, got "
                         f"{tuple(residual.shape)}")
    C = x.shape[-1]
    x2 = dl.rows(x)
    R = x2.shape[0]
    dw = xp.empty(C, F32)
    if R == 0:
        dw[...] = 0
        return dx, dw
    k = _kernels(tpb)
    blocks = min(R, ROW_GROUPS)
    parts = xp.empty((blocks, C), F32)
    dl.launch(k.rmsnorm_bwd, blocks, tpb, xp, dl.rows(dy), x2, rstd.reshape(-1), w,
              dl.rows(dx if residual is None else residual), dl.rows(dx),
              dl.rows(dx if dx2 is None else dx2), parts, residual is not None, dx2 is not None)
    dl.launch(k.column_sum, dl.grid(C, tpb), tpb, xp, parts, dw)
    return dx, dw


# --------------------------------------------------------------------------------------------
# SwiGLU: act = silu(gate) * up
# --------------------------------------------------------------------------------------------


def swiglu_forward(gate, up, xp, out=None, threads=None):
    """act = gate * sigmoid(gate) * up of (N, F) arrays (views welcome) -> (act, (gate, up)):
    `kernels.swiglu_forward`."""
    dl.check(xp, gate, up)
    tpb = dl.block_threads(threads)
    act = dl.out_array(out, dl.two_d("gate", gate).shape, F32, xp, True)
    if gate.size:
        dl.launch(_kernels(tpb).swiglu_fwd, dl.grid(gate.size, tpb), tpb, xp, gate,
                  dl.two_d("up", up), act)
    return act, (gate, up)


def swiglu_backward(dact, cache, xp, out=None, with_act=False, threads=None):
    """-> (dgate, dup) float32 (or `out` = (dgate, dup)'s dtypes, views welcome), and act with
    `with_act` (float32, or `out`'s third array when it has one): `kernels.swiglu_backward`."""
    gate, up = cache
    dl.check(xp, dact, gate, up)
    tpb = dl.block_threads(threads)
    shape = dl.two_d("gate", gate).shape
    outs = tuple(out or ()) + (None,) * (3 - len(out or ()))
    dgate, dup = (dl.out_array(o, shape, F32, xp, True) for o in outs[:2])
    act = dl.out_array(outs[2], shape, F32, xp, True) if with_act else None
    if gate.size:
        dl.launch(_kernels(tpb).swiglu_bwd, dl.grid(gate.size, tpb), tpb, xp,
                  dl.two_d("dact", dact), gate, dl.two_d("up", up), dgate, dup,
                  act if with_act else dgate, with_act)
    return (dgate, dup, act) if with_act else (dgate, dup)


# --------------------------------------------------------------------------------------------
# RoPE (Hugging Face's rotate_half), the reference's tables
# --------------------------------------------------------------------------------------------


def _rope(x, cos, sin, xp, out, sign, threads):
    """x (B, T, H, D) with tables (T, 1, D), or x (B, H, T, D) with tables (T, D) (as
    `kernels.rope_forward` broadcasts them); out any strides (a new float32 array if None)."""
    dl.check(xp, x, cos, sin)
    tpb = dl.block_threads(threads)
    if x.ndim != 4 or cos.ndim not in (2, 3) or x.shape[-1] % 2:
        raise ValueError(f"rope: x (B, T, H, D) with tables (T, 1, D) or x (B, H, T, D) with "
                         f"tables (T, D), D even; got x {tuple(x.shape)}, tables "
                         f"{tuple(cos.shape)}")
    out = dl.out_array(out, x.shape, F32, xp, True)
    if cos.ndim == 3:  # (T, 1, D): x token-major
        c2, s2, xv, ov = cos[:, 0], sin[:, 0], x, out
    else:  # (T, D): x head-major, seen token-major
        c2, s2 = cos, sin
        xv, ov = x.transpose(0, 2, 1, 3), out.transpose(0, 2, 1, 3)
    n = x.size // 2
    if n:
        dl.launch(_kernels(tpb).rope, dl.grid(n, tpb), tpb, xp, xv, c2, s2, ov, sign)
    return out


def rope_forward(x, cos, sin, xp, out=None, threads=None):
    """y = x * cos + rotate_half(x) * sin -> (y, (cos, sin)): `kernels.rope_forward`."""
    return _rope(x, cos, sin, xp, out, 1, threads), (cos, sin)


def rope_backward(dy, cache, xp, out=None, threads=None):
    """dx = dy * cos + rotate_half^T(dy * sin): `kernels.rope_backward`."""
    cos, sin = cache
    return _rope(dy, cos, sin, xp, out, -1, threads)


# --------------------------------------------------------------------------------------------
# AdamW, the gradient norm
# --------------------------------------------------------------------------------------------


def adamw(p, m, v, g, grad_scale, keep, b1, b2, step_size, bc2_sqrt, eps, xp, threads=None):
    """One AdamW update of flat fp32 arrays in place (`fused.adamw`'s arguments and arithmetic:
    `optim._adam_core` with the gradient scale and the decay factor `keep` = 1 - lr * wd folded
    in; the caller splits a block into decayed and undecayed ranges as `AdamW._update_fused`
    does). g is left as it was."""
    dl.check(xp, p, m, v, g)
    if not all(a.dtype == F32 and a.ndim == 1 for a in (p, m, v, g)):
        raise TypeError("adamw: p, m, v, g are flat float32 arrays")
    tpb = dl.block_threads(threads)
    if p.size:
        dl.launch(_kernels(tpb).adamw, dl.grid(p.size, tpb), tpb, xp, p, m, v, g,
                  *fused.adam_scalars(grad_scale, keep, b1, b2, step_size, bc2_sqrt, eps))


def sum_squares(a, xp, threads=None):
    """Sum of squares of a flat array, accumulated in float64, as a 0-d float64 array on the
    device (`float(...)` of it is the one host sync): `kernels.block_sq_norm` (a non-finite
    element makes it non-finite, the fp16 overflow signal). Per-block partials of a grid-stride
    pass, then one block sums them: the order is fixed by len(a) and `threads` alone."""
    dl.check(xp, a)
    if a.ndim != 1:
        raise ValueError(f"sum_squares: a flat array, got shape {tuple(a.shape)}")
    tpb = dl.block_threads(threads)
    if not a.size:
        return xp.zeros((), np.float64)
    k = _kernels(tpb)
    blocks = dl.grid(a.size, tpb)
    parts, out = xp.empty(blocks, np.float64), xp.empty(1, np.float64)
    dl.launch(k.sum_squares, blocks, tpb, xp, a, parts)
    dl.launch(k.sum_parts, 1, tpb, xp, parts, out)  # writes out[0] whatever the sum
    return out.reshape(())


__all__ = [
    "LAUNCHES",
    "adamw",
    "rmsnorm_backward",
    "rmsnorm_forward",
    "rmsnorm_recompute",
    "rope_backward",
    "rope_forward",
    "sum_squares",
    "swiglu_backward",
    "swiglu_forward",
]
