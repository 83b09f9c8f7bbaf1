"""The GEMM entry point: fp32 GEMMs, and 16-bit operands (fp16, bf16) with fp32 accumulation.

- float32 (or float64) operands: `xp.matmul`, BLAS handles transposed views.
- 16-bit operands on numpy: numpy's own float16 matmul is hundreds of times slower than sgemm
  (about 0.5 vs 200 GFLOP/s here; ml_dtypes' bfloat16 promotes to a whole fp32 copy), so 16-bit
  operands are converted *by tiles* into a bounded fp32 scratch (at most `SCRATCH_BYTES`,
  accounted in the DDR ledger as `scratch.gemm` while the call runs) and each tile product is
  an sgemm. This is our analogue of the platform's explicit
  DDR -> on-chip data movement. The result is float32.
- on a device (cupy, the stand-in), a 16-bit operand, or `half` (a 16-bit dtype: the layers'
  GEMMs in fp16 or bf16 mode, `ExecContext.device_half`), makes both operands that dtype: one
  GEMM on the tensor cores (cuBLAS, fp32 accumulation; cupy's bfloat16 is ml_dtypes', 2-D GEMMs
  only), its 16-bit result handed back as float32 (or written into `out`), as PyTorch's autocast
  does; never an fp32 GEMM that upcasts a 16-bit weight every call.

The layers avoid needless casts: they convert each 16-bit weight view to fp32 once per layer
call (`layers._gemm_weights`) and pass fp32 operands here, so the tiled path only runs for
operands that are needed in 16 bits alone.
"""

from __future__ import annotations

import numpy as np

from ratrain.device import is_host
from ratrain.exec.kernels import HALF_DTYPES
from ratrain.exec.profile import add_flops, timed

SCRATCH_BYTES = 8 << 20  # fp32 conversion scratch of one fp16 GEMM on the CPU
SCRATCH_TAG = "scratch.gemm"


@timed("gemm")
def matmul(a, b, out=None, *, xp=np, ledger=None, scratch_bytes: int = SCRATCH_BYTES,
           half=None):
    """a @ b with fp32 (or better) accumulation.

    a (..., M, K), b (K, N) or (..., K, N); transposed views welcome. With a 16-bit operand the
    result is float32 (or written into `out`, any float dtype). 16-bit operands on numpy must
    be 2-D for `b` (the tiled path flattens the leading dimensions of `a`). `half` (float16 or
    bfloat16; None: off): on a device, a GEMM in that dtype even for fp32 operands (ignored on
    numpy)."""
    add_flops(2.0 * a.size * b.shape[-1])  # 2 M N K (a: (..., M, K), b: (K, N))
    h = a.dtype if a.dtype in HALF_DTYPES else b.dtype if b.dtype in HALF_DTYPES else None
    if not is_host(xp) and half is not None:
        h = np.dtype(half)
    if h is None:
        return xp.matmul(a, b, out=out)
    if not is_host(xp):
        # cuBLAS 16-bit GEMM with fp32 accumulation (cupy's default compute type for halves)
        r = xp.matmul(a if a.dtype == h else a.astype(h), b if b.dtype == h else b.astype(h))
        if out is None:
            return r.astype(xp.float32)
        out[...] = r
        return out
    return _matmul_fp16_tiled(a, b, out, ledger, scratch_bytes)


def _matmul_fp16_tiled(a, b, out, ledger, scratch_bytes):
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
                if direct:
                    np.matmul(at, bt, out=o2[m0:m1, n0:n1])
                else:
                    o2[m0:m1, n0:n1] = np.matmul(at, bt)
    finally:
        if ledger is not None:
            ledger.unreserve(SCRATCH_TAG, nbytes)
    return out


__all__ = ["SCRATCH_BYTES", "SCRATCH_TAG", "matmul"]
