"""The GEMM entry point: fp32 GEMMs, and 16-bit operands (fp16, bf16) with fp32 accumulation.

- float32 (or float64) operands: `xp.matmul`, BLAS handles transposed views.
- 16-bit operands on numpy: numpy's own float16 matmul is hundreds of times slower than sgemm
  (about 0.5 vs 200 GFLOP/s here; ml_dtypes' bfloat16 promotes to a whole fp32 copy), so 16-bit
  operands are converted *by tiles* into a bounded fp32 scratch (at most `SCRATCH_BYTES`,
  accounted in the DDR ledger as `scratch.gemm` while the call runs) and each tile product is
  an sgemm. This is our analogue of the platform's explicit
  DDR -> on-chip data movement. The result is float32.
- on a device (cupy, the stand-in), a 16-bit operand, or `half` (a 16-bit dtype: the layers'
  GEMMs in fp16 or bf16 mode, `ExecContext.gemm_half`), makes both operands that dtype: one
  GEMM on the tensor cores (cuBLAS, fp32 accumulation; cupy's bfloat16 is ml_dtypes', 2-D GEMMs
  only), its 16-bit result handed back as float32 (or written into `out`), as PyTorch's autocast
  does; never an fp32 GEMM that upcasts a 16-bit weight every call.

The layers avoid needless casts: on numpy's BLAS they convert each 16-bit weight view to fp32
once per layer call (`layers._gemm_weights`) and pass fp32 operands here, so the tiled path
only runs for operands that are needed in 16 bits alone.

`accumulate=True` adds the product into `out` (fp32) instead of writing it: here a product and
an add, on oneMKL the GEMM's own beta = 1 (the layers' weight gradients in the 16-bit layout).

oneMKL (`run.blas: mkl`, `exec.blas`) has an entry of the same signature, made for the rank by
`mkl_entry`. It runs fp32 operands on oneMKL's sgemm. A 16-bit dtype it computes natively (bf16
always, fp16 with AMX-FP16) runs as one GEMM with fp32 accumulation on both operands in that
dtype (an fp32 one cast once, as on a device), never on an fp32 copy of a 16-bit operand. Other
16-bit operands take the tiled conversion above on oneMKL's sgemm, and anything else (float64,
a batched right operand) the reference. Its result is fp32; a 16-bit `out` is filled a row
panel at a time from a core-sized fp32 scratch (`OUT_PANEL_BYTES`, fixed by the shape alone).
"""

from __future__ import annotations

import math

import numpy as np

from ratrain.device import is_host
from ratrain.exec import devgemm
from ratrain.exec.blas import writable_c
from ratrain.exec.kernels import HALF_DTYPES
from ratrain.exec.profile import add_flops, timed

SCRATCH_BYTES = 8 << 20  # fp32 conversion scratch of one fp16 GEMM on the CPU
SCRATCH_TAG = "scratch.gemm"
OUT_PANEL_BYTES = 1 << 20  # oneMKL: the fp32 panel a 16-bit or strided result goes through
F32 = np.dtype(np.float32)


@timed("gemm")
def matmul(a, b, out=None, *, xp=np, ledger=None, scratch_bytes: int = SCRATCH_BYTES,
           half=None, accumulate: bool = False, alpha: float = 1.0):
    """a @ b with fp32 (or better) accumulation.

    a (..., M, K), b (K, N) or (..., K, N); transposed views welcome. With a 16-bit operand the
    result is float32 (or written into `out`, any float dtype). 16-bit operands on numpy must
    be 2-D for `b` (the tiled path flattens the leading dimensions of `a`). `half` (float16 or
    bfloat16; None: off): on a device, a GEMM in that dtype even for fp32 operands (ignored on
    numpy). `accumulate`: out += a @ b (out given, fp32). `alpha`: the product times alpha, in
    fp32 before it is added or written (a device's 16-bit GEMM scales inside, cuBLAS's alpha)."""
    h = a.dtype if a.dtype in HALF_DTYPES else b.dtype if b.dtype in HALF_DTYPES else None
    if not is_host(xp) and half is not None:
        h = np.dtype(half)
    if h is not None and not is_host(xp):
        return _device_half(a, b, out, xp, h, accumulate, alpha)
    if alpha != 1.0:
        return _scaled(matmul(a, b, xp=xp, ledger=ledger, scratch_bytes=scratch_bytes,
                              half=half), alpha, out, accumulate)
    if accumulate:
        out += matmul(a, b, xp=xp, ledger=ledger, scratch_bytes=scratch_bytes, half=half)
        return out
    add_flops(2.0 * a.size * b.shape[-1])  # 2 M N K (a: (..., M, K), b: (K, N))
    if h is None:
        return xp.matmul(a, b, out=out)
    return _matmul_fp16_tiled(a, b, out, ledger, scratch_bytes)


def _scaled(r, alpha, out, accumulate):
    """A product `r` (fp32, new) times `alpha`, added into `out` or written there (or r)."""
    r *= r.dtype.type(alpha)
    if accumulate:
        out += r
        return out
    if out is None:
        return r
    out[...] = r
    return out


def _device_half(a, b, out, xp, h, accumulate, alpha=1.0):
    """A device's GEMM in the 16-bit dtype `h` (both operands cast to it where they are not),
    fp32 accumulation (cuBLAS's compute type for halves): a 2-D product into an fp32 `out`, or
    a new fp32 array, by cuBLAS's GemmEx, adding when `accumulate` (`exec.devgemm`: one
    launch, the fp32 sum not rounded to 16 bits, as the host's oneMKL entry gives it); into a
    16-bit `out` by GemmEx too (the sum rounded once, as `cupy.matmul` rounds it); a batched
    one, or an operand GemmEx does not take, as `cupy.matmul`'s 16-bit result, handed back as
    float32."""
    add_flops(2.0 * a.size * b.shape[-1])
    a16 = a if a.dtype == h else a.astype(h)
    b16 = b if b.dtype == h else b.astype(h)
    if a16.ndim == 2 and b16.ndim == 2 and (out is None or out.dtype == F32
                                            or (out.dtype == h and not accumulate)):
        dst = xp.empty((a16.shape[0], b16.shape[1]), F32) if out is None else out
        if devgemm.takes(a16, b16, dst):  # else (an operand without a unit stride) cupy's
            return devgemm.gemm_ex(a16, b16, dst, xp, beta=1.0 if accumulate else 0.0,
                                   alpha=alpha)
    if alpha != 1.0:
        return _scaled(xp.matmul(a16, b16).astype(F32), alpha, out, accumulate)
    if accumulate:
        if out is None or out.dtype != F32:
            raise ValueError("matmul: accumulate=True adds into an fp32 out")
        out += xp.matmul(a16, b16)
        return out
    if out is not None and out.dtype == h and out.flags.c_contiguous:
        return xp.matmul(a16, b16, out=out)
    r = xp.matmul(a16, b16)
    if out is None:
        return r.astype(xp.float32)
    out[...] = r
    return out


def _matmul_fp16_tiled(a, b, out, ledger, scratch_bytes, sgemm=None):
    """The 16-bit operands' product by fp32 tiles; `sgemm(x, y, out)` (None: numpy's) writes
    each tile's product into an fp32 `out`."""
    if b.ndim != 2:
        raise ValueError(f"fp16 matmul on the CPU needs a 2-D right operand, got {b.shape}")
    K, N = b.shape
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1])  # (M, K)
    M = a2.shape[0]
    if a2.shape[1] != K:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    if out is None:
        out = np.empty((*lead, N), np.float32)
    o2 = out.reshape(M, N)  # (M, N)
    budget = max(scratch_bytes // 4, 2 * K)  # fp32 elements
    a16, b16 = a2.dtype in HALF_DTYPES, b.dtype in HALF_DTYPES
    # Column panels of b (converted once each), row panels of a (converted per b panel).
    tn = N if not b16 else max(1, min(N, (budget // 2 if a16 else budget) // K))
    tm = M if not a16 else max(1, min(M, (budget - (K * tn if b16 else 0)) // K))
    nbytes = 4 * ((tm * K if a16 else 0) + (K * tn if b16 else 0))
    if ledger is not None:
        ledger.reserve(SCRATCH_TAG, nbytes)
    try:
        sa = np.empty((tm, K), np.float32) if a16 else None  # scratch
        sb = np.empty((K, tn), np.float32) if b16 else None  # scratch
        direct = o2.dtype == np.float32
        for n0 in range(0, N, tn):
            n1 = min(n0 + tn, N)
            if b16:
                bt = sb[:, : n1 - n0]
                np.copyto(bt, b[:, n0:n1])
            else:
                bt = b[:, n0:n1]
            for m0 in range(0, M, tm):
                m1 = min(m0 + tm, M)
                if a16:
                    at = sa[: m1 - m0]
                    np.copyto(at, a2[m0:m1])
                else:
                    at = a2[m0:m1]
                if sgemm is not None:
                    dst = o2[m0:m1, n0:n1]
                    if direct and writable_c(dst):
                        sgemm(at, bt, dst)
                    else:
                        tmp = np.empty((m1 - m0, n1 - n0), F32)
                        sgemm(at, bt, tmp)
                        dst[...] = tmp
                elif direct:
                    np.matmul(at, bt, out=o2[m0:m1, n0:n1])
                else:
                    o2[m0:m1, n0:n1] = np.matmul(at, bt)
    finally:
        if ledger is not None:
            ledger.unreserve(SCRATCH_TAG, nbytes)
    return out


def mkl_entry(lib, native=(), cast=None, assign=None):
    """The table's gemm entry on oneMKL `lib` (`exec.blas.Mkl`), with `matmul`'s signature:
    `native` the 16-bit dtypes it computes natively, `cast` and `assign` the table's (None:
    numpy's)."""
    native = frozenset(np.dtype(d) for d in native if lib.takes(d))
    cast = cast or (lambda x, dt: x if x.dtype == dt else x.astype(dt))

    def put(dst, src):
        if assign is None:
            dst[...] = src
        else:
            assign(dst, src)

    def sgemm(x, y, out):
        lib.gemm(x, y, out)

    @timed("gemm")
    def gemm(a, b, out=None, *, xp=np, ledger=None, scratch_bytes: int = SCRATCH_BYTES,
             half=None, accumulate: bool = False, alpha: float = 1.0):
        if alpha != 1.0:  # the head's seed on a device alone: the reference scales
            return matmul(a, b, out, xp=xp, ledger=ledger, scratch_bytes=scratch_bytes,
                          half=half, accumulate=accumulate, alpha=alpha)
        h = np.dtype(half) if half is not None else a.dtype if a.dtype in HALF_DTYPES else \
            b.dtype if b.dtype in HALF_DTYPES else None
        takes = a.dtype != np.float64 and b.dtype != np.float64 if h is not None else \
            a.dtype == F32 and b.dtype == F32
        if b.ndim != 2 or a.ndim < 2 or not takes:  # float64, batched: the reference
            return matmul(a, b, out, xp=xp, ledger=ledger, scratch_bytes=scratch_bytes,
                          accumulate=accumulate)
        if h is not None and h not in native:  # 16 bits it does not take: fp32 tiles, its sgemm
            if accumulate:
                out += gemm(a, b, ledger=ledger, scratch_bytes=scratch_bytes)
                return out
            add_flops(2.0 * a.size * b.shape[-1])
            return _matmul_fp16_tiled(a, b, out, ledger, scratch_bytes, sgemm)
        add_flops(2.0 * a.size * b.shape[-1])  # 2 M N K
        K, N = b.shape
        lead = a.shape[:-1]
        if a.shape[-1] != K or (out is not None and out.shape != (*lead, N)):
            raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align"
                             + (f" with out {out.shape}" if out is not None else ""))
        dt = F32 if h is None else h
        M = math.prod(lead)
        casts = (a.size if a.dtype != dt else 0) + (b.size if b.dtype != dt else 0)
        if out is None:
            out = np.empty((*lead, N), F32)
        if accumulate and out.dtype != F32:
            raise ValueError(f"matmul: accumulate=True adds into an fp32 out, not {out.dtype}")
        o2 = out.reshape(M, N)  # (M, N): a view, or a copy written back at the end
        copied = not np.may_share_memory(o2, out)
        direct = not copied and writable_c(o2)
        panel = 0 if direct else max(1, OUT_PANEL_BYTES // (4 * max(N, 1)))
        nbytes = casts * dt.itemsize + 4 * min(panel, M) * N
        if ledger is not None:
            ledger.reserve(SCRATCH_TAG, nbytes)
        try:
            a2 = cast(a, dt).reshape(M, K)  # a copy where `a` is not viewable so
            b2 = cast(b, dt)
            if direct:
                lib.gemm(a2, b2, o2, beta=1.0 if accumulate else 0.0)
                return out
            scratch = np.empty((min(panel, M), N), F32)
            for m0 in range(0, M, panel):  # row panels fixed by the shape alone
                m1 = min(m0 + panel, M)
                lib.gemm(a2[m0:m1], b2, scratch[: m1 - m0])
                if accumulate:
                    o2[m0:m1] += scratch[: m1 - m0]
                else:
                    put(o2[m0:m1], scratch[: m1 - m0])
            if copied:
                out[...] = o2.reshape(out.shape)
            return out
        finally:
            if ledger is not None:
                ledger.unreserve(SCRATCH_TAG, nbytes)

    gemm.native = native
    return gemm


__all__ = ["OUT_PANEL_BYTES", "SCRATCH_BYTES", "SCRATCH_TAG", "matmul", "mkl_entry"]
