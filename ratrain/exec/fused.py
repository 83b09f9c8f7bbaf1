"""Fused elementwise kernels: one pass over memory where numpy makes several.

On the CPU most of a step that is not GEMM is elementwise work (SwiGLU, RMSNorm, RoPE, AdamW,
casts), and numpy runs each operator as a separate pass over arrays far larger than the
caches, with a temporary for each intermediate. The kernels here compute the same formulas, in
the same operator order, in one loop each, compiled by numba (an optional dependency: the
`fast` extra). `kernels.py` and `optim.py` stay the plain reference: they call these when
`usable(...)` and fall back to their numpy code otherwise (no numba, `RATRAIN_FUSED=0`, cupy,
float64, float16), and the tests check each fused kernel against the reference.

Numerics: operator for operator the same fp32 arithmetic (no fast-math, no contraction into
fused multiply-adds), so AdamW, RoPE and the elementwise parts are bitwise those of the
reference, exponentials included (they are numpy's own); only RMSNorm's row means are summed in
row order where numpy sums pairwise: a few ulps, within the tests' tolerance. Every kernel is serial and deterministic; the caller's
threads split the work as they split the numpy path.

    if fused.usable(np, x):
        fused.swiglu_forward(gate, up, out)
"""

from __future__ import annotations

import functools

import numpy as np

from ratrain.fastpath import FastPath, jit

_state = FastPath()  # numba (the `fast` extra) is imported on the first read of `_state.on`
F32 = np.dtype(np.float32)


def enabled() -> bool:
    """Whether the fused path is on (numba importable, not turned off by RATRAIN_FUSED=0)."""
    return _state.on


def why_off() -> str:
    """Why the fused path is off ("" when on)."""
    return _state.why_off


def usable(xp, *arrays) -> bool:
    """The fused path applies: on, numpy arrays, all float32."""
    return _state.on and xp is np and all(a.dtype == F32 for a in arrays)


def disabled():
    """Run the block on the numpy reference (tests compare the two)."""
    return _state.disabled()


_jit = jit(nogil=True, cache=True)  # compiled on first call; the plain function without numba


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


def swiglu_forward(gate, up, out):
    _swiglu_fwd(gate, up, _exp_neg(gate), out)
    return out


def swiglu_backward(dact, gate, up, dgate, dup, act=None):
    e = _exp_neg(gate)
    _swiglu_bwd(dact, gate, up, e, dgate, dup, act if act is not None else dgate,
                act is not None)


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


def rmsnorm_forward(x2, w, eps, y2):
    """x2, y2 (R, C) views; returns rstd (R, 1)."""
    rstd = np.empty((x2.shape[0], 1), F32)
    _rmsnorm_fwd(x2, w, np.float32(eps), y2, rstd[:, 0])
    return rstd


def rmsnorm_backward(dy2, x2, rstd, w):
    """-> (dx (R, C), dw (C,))."""
    dx = np.empty(x2.shape, F32)
    dw = np.zeros(x2.shape[1], F32)
    _rmsnorm_bwd(dy2, x2, rstd.reshape(-1), w, dx, dw)
    return dx, dw


# -- RoPE: y = x * cos + rotate_half(x) * sin ------------------------------------------------


@_jit
def _rope(x, cos, sin, out, sign):  # x, out (B, T, H, D); cos, sin (T, D); sign -1: backward
    d = x.shape[3] // 2
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for h in range(x.shape[2]):
                for i in range(d):
                    c, s = cos[t, i], sin[t, i]
                    x1, x2 = x[b, t, h, i], x[b, t, h, i + d]
                    if sign > 0:
                        out[b, t, h, i] = x1 * c - x2 * s
                        out[b, t, h, i + d] = x2 * c + x1 * s
                    else:
                        out[b, t, h, i] = x1 * c + x2 * s
                        out[b, t, h, i + d] = x2 * c - x1 * s


def rope(x, cos, sin, out, backward=False):
    """x, out (B, T, H, D) views; cos, sin (T, D) float32."""
    _rope(x, cos, sin, out, -1 if backward else 1)
    return out


# -- AdamW ---------------------------------------------------------------------------------


@_jit
def _adamw(p, m, v, g, gscale, keep, b2, omb2, w, lerp_low, step, bc2, eps):
    one = np.float32(1.0)
    for i in range(p.shape[0]):
        gi = g[i] * gscale if gscale != one else g[i]
        pi = p[i] * keep if keep != one else p[i]
        t = gi - m[i]  # m = lerp(m, g, w), torch's two formulas
        if lerp_low:
            mi = m[i] + t * w
        else:
            mi = gi - t * (one - w)
        vi = v[i] * b2 + gi * omb2 * gi
        denom = np.sqrt(vi) / bc2 + eps
        p[i] = pi + (mi * (-step)) / denom
        m[i] = mi
        v[i] = vi


def adamw(p, m, v, g, grad_scale, keep, b1, b2, step_size, bc2_sqrt, eps):
    """One AdamW update of flat fp32 ranges in place, `optim._adam_core`'s arithmetic with the
    gradient scaling and the decay factor (`keep`, 1 for no decay) folded in."""
    f = np.float32
    w = f(1 - b1)
    _adamw(p, m, v, g, f(grad_scale), f(keep), f(b2), f(1 - b2), w, bool(w < 0.5),
           f(step_size), f(bc2_sqrt), f(eps))


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


def cast_into(dst, src) -> bool:
    """dst[...] = src for a float32 <-> float16 pair of C-contiguous numpy arrays of one shape,
    bitwise as numpy; False (nothing done) when it does not apply (`assign` then casts)."""
    if not (_state.on and isinstance(dst, np.ndarray) and isinstance(src, np.ndarray)
            and dst.shape == src.shape and dst.flags.c_contiguous and src.flags.c_contiguous):
        return False
    if src.dtype == F32 and dst.dtype == _F16:
        _f32_to_f16(src.reshape(-1).view(np.uint32), dst.reshape(-1).view(np.uint16))
    elif src.dtype == _F16 and dst.dtype == F32:
        _f16_to_f32(src.reshape(-1).view(np.uint16), dst.reshape(-1), _table())
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


__all__ = ["adamw", "assign", "cast", "cast_into", "disabled", "enabled", "rmsnorm_backward",
           "rmsnorm_forward", "rope", "swiglu_backward", "swiglu_forward", "usable"]
