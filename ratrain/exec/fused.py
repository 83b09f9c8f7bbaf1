"""Fused elementwise kernels: one pass over memory where numpy makes several.

On the CPU most of a step that is not GEMM is elementwise work (SwiGLU, RMSNorm, RoPE, AdamW,
casts), and numpy runs each operator as a separate pass over arrays far larger than the
caches, with a temporary for each intermediate. The kernels here compute the same formulas, in
the same operator order, in one loop each, compiled by numba (an optional dependency: the
`fast` extra). Each public function has the signature of its plain reference in `kernels`
(`optim` for AdamW) and calls that reference for what it does not take (float64, float16,
layouts it does not handle); the kernel table (`exec.backends`) puts them in the references'
place on a host rank where `run.fused` allows and numba imports, and the tests check each
against its reference.

Numerics: operator for operator the same fp32 arithmetic (no fast-math, no contraction into
fused multiply-adds), so AdamW, RoPE and the elementwise parts are bitwise those of the
reference, exponentials included (they are numpy's own); only RMSNorm's row means are summed in
row order where numpy sums pairwise: a few ulps, within the tests' tolerance. Every kernel is
serial and deterministic; the caller's threads split the work as they split the numpy path.
"""

from __future__ import annotations

import functools

import numpy as np

from ratrain.exec import kernels
from ratrain.exec.kernels import BF16, as_dtype, compute_dtype
from ratrain.exec.profile import timed
from ratrain.fastpath import jit, load_numba

F32 = np.dtype(np.float32)


def available() -> bool:
    """Whether numba imports, so that these kernels compile (numba imported here, once)."""
    return load_numba()[0] is not None


def why_off() -> str:
    """Why they cannot run here ("" when numba imports)."""
    return load_numba()[1]


def _inline_helpers(numba) -> None:
    """The formulas the kernels inline (`rope_pair`, `adam_moments`, which `devkernels` compiles
    for a GPU too) compiled for the host, before the first kernel that calls them compiles."""
    global _rope_pair, _adam_moments
    _rope_pair = numba.njit(inline="always")(rope_pair)
    _adam_moments = numba.njit(inline="always")(adam_moments)


def _f32(*arrays) -> bool:
    return all(a.dtype == F32 for a in arrays)


# compiled on first call (the plain function without numba), the inlined formulas first
_jit = jit(nogil=True, cache=True, prepare=_inline_helpers)


# -- SwiGLU: act = silu(g) * u ---------------------------------------------------------------
# numpy's exp is vectorised (SIMD) where numba's is the C library's, one element at a time: the
# exponentials come from numpy (into a scratch array), the rest of the formula is fused.


@_jit
def _swiglu_fwd(gate, up, e, out):  # (N, F) each, any strides; e = exp(-gate)
    one = np.float32(1.0)
    for i in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            out[i, j] = gate[i, j] / (one + e[i, j]) * up[i, j]


@_jit
def _swiglu_bwd(dact, gate, up, e, dgate, dup, act, with_act):  # e = exp(-gate)
    one = np.float32(1.0)
    for i in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            g, u, da = gate[i, j], up[i, j], dact[i, j]
            s = one / (one + e[i, j])  # sigmoid(g)
            silu = g * s
            if with_act:
                act[i, j] = silu * u
            dup[i, j] = da * silu
            t = silu * s
            t = silu - t
            t = t + s  # d silu / dg
            dgate[i, j] = (da * u) * t


def _exp_neg(gate):
    e = np.negative(gate)  # (N, F) scratch
    return np.exp(e, out=e)


@timed("swiglu")
def swiglu_forward(gate, up, xp, out=None):
    """`kernels.swiglu_forward` of float32 (N, F) arrays (any strides)."""
    if not (gate.ndim == 2 and _f32(gate, up)):
        return kernels.swiglu_forward(gate, up, xp, out)
    a = np.empty(gate.shape, F32) if out is None else out
    _swiglu_fwd(gate, up, _exp_neg(gate), a)
    return a, (gate, up)


@timed("swiglu")
def swiglu_backward(dact, cache, xp, out=None, with_act=False):
    """`kernels.swiglu_backward` of float32 (N, F) arrays (any strides)."""
    gate, up = cache
    if not (gate.ndim == 2 and _f32(gate, up, dact, *(out or ()))):
        return kernels.swiglu_backward(dact, cache, xp, out, with_act)
    dgate, dup, *act_out = out if out is not None else (None, None)
    dgate = np.empty(gate.shape, F32) if dgate is None else dgate
    dup = np.empty(gate.shape, F32) if dup is None else dup
    act = (act_out[0] if act_out else np.empty(gate.shape, F32)) if with_act else None
    _swiglu_bwd(dact, gate, up, _exp_neg(gate), dgate, dup, act if with_act else dgate, with_act)
    return (dgate, dup, act) if with_act else (dgate, dup)


# -- RMSNorm: y = x / sqrt(mean(x^2) + eps) * w ----------------------------------------------


@_jit
def _rmsnorm_fwd(x, w, eps, y, rstd):  # x, y (R, C); w (C,); rstd (R,)
    for r in range(x.shape[0]):
        acc = np.float32(0.0)
        for c in range(x.shape[1]):
            acc += x[r, c] * x[r, c]
        s = np.float32(1.0) / np.sqrt(acc / np.float32(x.shape[1]) + eps)
        rstd[r] = s
        for c in range(x.shape[1]):
            y[r, c] = x[r, c] * s * w[c]


@_jit
def _rmsnorm_bwd(dy, x, rstd, w, dx, dw):  # dy, x, dx (R, C); rstd (R,); w, dw (C,)
    n = np.float32(x.shape[1])
    for r in range(x.shape[0]):
        s = rstd[r]
        acc = np.float32(0.0)
        for c in range(x.shape[1]):
            xhat = x[r, c] * s
            dw[c] += dy[r, c] * xhat
            acc += dy[r, c] * w[c] * xhat
        m = acc / n
        for c in range(x.shape[1]):
            xhat = x[r, c] * s
            dx[r, c] = (dy[r, c] * w[c] - xhat * m) * s


@timed("rmsnorm")
def rmsnorm_forward(x, w, eps, xp, out=None, x_copy=None):
    """`kernels.rmsnorm_forward` of a C-contiguous float32 x (..., C) and float32 w (with
    `x_copy`, a device layout's: the reference)."""
    if x_copy is not None:
        return kernels.rmsnorm_forward(x, w, eps, xp, out, x_copy)
    x = as_dtype(x, compute_dtype(x, w))
    if not (_f32(x, w) and x.flags.c_contiguous):
        return kernels.rmsnorm_forward(x, w, eps, xp, out)
    C = x.shape[-1]
    y = np.empty(x.shape, F32) if out is None else out
    rstd = np.empty((*x.shape[:-1], 1), F32)
    _rmsnorm_fwd(x.reshape(-1, C), w, np.float32(eps), y.reshape(-1, C), rstd.reshape(-1))
    return y, (x, rstd, w)


@timed("rmsnorm")
def rmsnorm_backward(dy, cache, xp, residual=None, out=None, copy_out=None):
    """`kernels.rmsnorm_backward` of C-contiguous float32 dy and x, and a float32 w (with a
    residual or outputs, a device layout's: the reference)."""
    if residual is not None or out is not None or copy_out is not None:
        return kernels.rmsnorm_backward(dy, cache, xp, residual, out, copy_out)
    x, rstd, w = cache
    dy = as_dtype(dy, x.dtype)
    if not (_f32(x, dy, w) and x.flags.c_contiguous and dy.flags.c_contiguous):
        return kernels.rmsnorm_backward(dy, cache, xp)
    C = x.shape[-1]
    dx = np.empty(x.shape, F32)
    dw = np.zeros(C, F32)
    _rmsnorm_bwd(dy.reshape(-1, C), x.reshape(-1, C), rstd.reshape(-1), w, dx.reshape(-1, C), dw)
    return dx, dw


# -- RoPE: y = x * cos + rotate_half(x) * sin ------------------------------------------------


def rope_pair(x1, x2, c, s, sign):
    """One rotated pair of RoPE, (x1 c - x2 s, x2 c + x1 s), or for sign -1 (the backward) the
    transpose's (x1 c + x2 s, x2 c - x1 s): the formula this module's and `devkernels`' RoPE
    kernels compile."""
    if sign > 0:
        return x1 * c - x2 * s, x2 * c + x1 * s
    return x1 * c + x2 * s, x2 * c - x1 * s


_rope_pair = rope_pair  # numba's inlined version once a kernel compiles (`_inline_helpers`)


@_jit
def _rope(x, cos, sin, out, sign):  # x, out (B, T, H, D); cos, sin (T, D); sign -1: backward
    d = x.shape[3] // 2
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for h in range(x.shape[2]):
                for i in range(d):
                    y1, y2 = _rope_pair(x[b, t, h, i], x[b, t, h, i + d], cos[t, i], sin[t, i],
                                        sign)
                    out[b, t, h, i] = y1
                    out[b, t, h, i + d] = y2


@timed("rope")
def rope_forward(x, cos, sin, xp, out=None):
    """`kernels.rope_forward` of float32 x (B, T, H, D) (views welcome) with (T, 1, D) tables."""
    if out is None:
        out = np.empty(x.shape, compute_dtype(x, cos))
    if not (x.ndim == 4 and cos.ndim == 3 and _f32(x, cos, sin, out)):
        return kernels.rope_forward(x, cos, sin, xp, out)
    _rope(x, cos[:, 0], sin[:, 0], out, 1)
    return out, (cos, sin)


@timed("rope")
def rope_backward(dy, cache, xp, out=None):
    """`kernels.rope_backward` of float32 dy (B, T, H, D) with (T, 1, D) tables."""
    cos, sin = cache
    if out is None:
        out = np.empty(dy.shape, compute_dtype(dy, cos))
    if not (dy.ndim == 4 and cos.ndim == 3 and _f32(dy, cos, sin, out)):
        return kernels.rope_backward(dy, cache, xp, out)
    _rope(dy, cos[:, 0], sin[:, 0], out, -1)
    return out


# -- AdamW ---------------------------------------------------------------------------------


def adam_moments(m, v, g, b2, omb2, w, omw, lerp_low):
    """One element's new AdamW moments in torch's arithmetic: m = lerp(m, g, w) by torch's two
    formulas on either side of w = 0.5 (omw = 1 - w), v = v b2 + ((1 - b2) g) g; the formula
    this module's and `devkernels`' AdamW kernels compile."""
    t = g - m
    m = m + t * w if lerp_low else g - t * omw
    return m, v * b2 + g * omb2 * g


def adam_scalars(grad_scale, keep, b1, b2, step_size, bc2_sqrt, eps):
    """The AdamW kernels' scalar arguments, rounded to fp32: grad_scale, keep, b2, 1 - b2,
    w = 1 - b1, 1 - w, w < 0.5, step_size, bc2_sqrt, eps."""
    f = np.float32
    w = f(1 - b1)
    return (f(grad_scale), f(keep), f(b2), f(1 - b2), w, f(1) - w, bool(w < 0.5), f(step_size),
            f(bc2_sqrt), f(eps))


_adam_moments = adam_moments  # numba's inlined version once a kernel compiles


@_jit
def _adamw(p, m, v, g, gscale, keep, b2, omb2, w, omw, lerp_low, step, bc2, eps):
    one = np.float32(1.0)
    for i in range(p.shape[0]):
        gi = g[i] * gscale if gscale != one else g[i]
        pi = p[i] * keep if keep != one else p[i]
        mi, vi = _adam_moments(m[i], v[i], gi, b2, omb2, w, omw, lerp_low)
        p[i] = pi + (mi * (-step)) / (np.sqrt(vi) / bc2 + eps)
        m[i] = mi
        v[i] = vi


def adamw(p, m, v, g, grad_scale, keep, b1, b2, step_size, bc2_sqrt, eps, xp=None):
    """One AdamW update of flat fp32 ranges in place, `optim._adam_core`'s arithmetic with the
    gradient scaling and the decay factor (`keep`, 1 for no decay) folded in (`xp`: numpy)."""
    _adamw(p, m, v, g, *adam_scalars(grad_scale, keep, b1, b2, step_size, bc2_sqrt, eps))


# --------------------------------------------------------------------------------------------
# float32 <-> float16 conversions (numpy's own run at ~0.6 G elements/s one way, ~1 G the other
# here, well below memory speed). Bitwise numpy's: round to nearest even, subnormals, overflow
# to inf, NaN payloads kept (checked against numpy's cast for all 2**32 float32 bit patterns).
# --------------------------------------------------------------------------------------------

_F16 = np.dtype(np.float16)
_U32 = np.uint32


@_jit
def _f32_to_f16(src, dst):  # src (n,) uint32 bits of float32; dst (n,) uint16 bits of float16
    for i in range(src.size):
        f = src[i]
        sign = (f >> _U32(16)) & _U32(0x8000)
        a = f & _U32(0x7FFFFFFF)
        if a >= _U32(0x47800000):  # |x| >= 65536, inf or NaN
            h = _U32(0x7C00)
            if a > _U32(0x7F800000):  # NaN: the top mantissa bits, never 0 (which would be inf)
                h |= (a >> _U32(13)) & _U32(0x3FF)
                if (h & _U32(0x3FF)) == 0:
                    h += _U32(1)
        elif a >= _U32(0x38800000):  # a normal half after rounding (or 65504 -> inf by carry)
            m = a + _U32(0xC8000000)  # exponent rebiased: -(127 - 15) << 23
            h = (m + _U32(0xFFF) + ((m >> _U32(13)) & _U32(1))) >> _U32(13)  # nearest even
        else:  # a subnormal half, or zero
            e = a >> _U32(23)
            if e < _U32(102):  # below half the smallest subnormal: zero
                h = _U32(0)
            else:
                mant = (a & _U32(0x7FFFFF)) | _U32(0x800000)
                sh = _U32(126) - e
                h = mant >> sh
                rem = mant & ((_U32(1) << sh) - _U32(1))
                mid = _U32(1) << (sh - _U32(1))
                if rem > mid or (rem == mid and (h & _U32(1)) != 0):
                    h += _U32(1)
        dst[i] = h | sign


@_jit
def _f16_to_f32(src, dst, table):  # src (n,) uint16 bits; dst (n,) float32; table (65536,)
    for i in range(src.size):
        dst[i] = table[src[i]]


@functools.cache
def _table():
    """Every float16's float32 value (numpy's conversion), made on first use."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(_F16).astype(np.float32)


# float32 <-> bfloat16 (ml_dtypes' casts run at 4-7 GB/s here, these at 20-35 GB/s read + write:
# AMD EPYC, 2 cores, load 3, a 2**25-element array): bfloat16 is float32's top 16
# bits, so a bfloat16's float32 is its bits shifted up, and float32 rounds to nearest even on
# the low 16 bits; NaN becomes ml_dtypes' quiet NaN of its sign (0x7FC0 / 0xFFC0). Bitwise
# ml_dtypes' casts (checked for all 2**32 float32 bit patterns).


@_jit
def _f32_to_bf16(src, dst):  # src (n,) uint32 bits of float32; dst (n,) uint16 bits of bfloat16
    for i in range(src.size):
        f = src[i]
        if (f & _U32(0x7FFFFFFF)) > _U32(0x7F800000):  # NaN
            dst[i] = ((f >> _U32(16)) & _U32(0x8000)) | _U32(0x7FC0)
        else:
            dst[i] = (f + _U32(0x7FFF) + ((f >> _U32(16)) & _U32(1))) >> _U32(16)


@_jit
def _bf16_to_f32(src, dst):  # src (n,) uint16 bits of bfloat16; dst (n,) uint32 bits of float32
    for i in range(src.size):
        dst[i] = _U32(src[i]) << _U32(16)


def cast_into(dst, src) -> bool:
    """dst[...] = src for a float32 <-> float16 or float32 <-> bfloat16 pair of C-contiguous
    numpy arrays of one shape, bitwise as numpy (ml_dtypes for bfloat16); False (nothing done)
    when it does not apply (`assign` then casts)."""
    if not (isinstance(dst, np.ndarray) and isinstance(src, np.ndarray)
            and dst.shape == src.shape and dst.flags.c_contiguous and src.flags.c_contiguous):
        return False
    if src.dtype == F32 and dst.dtype == _F16:
        _f32_to_f16(src.reshape(-1).view(np.uint32), dst.reshape(-1).view(np.uint16))
    elif src.dtype == _F16 and dst.dtype == F32:
        _f16_to_f32(src.reshape(-1).view(np.uint16), dst.reshape(-1), _table())
    elif src.dtype == F32 and dst.dtype == BF16:
        _f32_to_bf16(src.reshape(-1).view(np.uint32), dst.reshape(-1).view(np.uint16))
    elif src.dtype == BF16 and dst.dtype == F32:
        _bf16_to_f32(src.reshape(-1).view(np.uint16), dst.reshape(-1).view(np.uint32))
    else:
        return False
    return True


def cast(a, dtype):
    """`a.astype(dtype)` (a copy, or `a` itself when it has the dtype), through `cast_into`
    when it applies."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    if isinstance(a, np.ndarray) and a.flags.c_contiguous:
        out = np.empty(a.shape, dtype)
        if cast_into(out, a):
            return out
    return a.astype(dtype)


def assign(dst, src) -> None:
    """dst[...] = src (any array module), through `cast_into` when it applies."""
    if not cast_into(dst, src):
        dst[...] = src


__all__ = ["adamw", "assign", "available", "cast", "cast_into", "rmsnorm_backward",
           "rmsnorm_forward", "rope_backward", "rope_forward", "swiglu_backward", "swiglu_forward",
           "why_off"]
