"""A device's GEMM into an fp32 result: 16-bit operands, fp32 accumulation, beta 0 or 1.

    gemm_ex(a, b, c, xp, beta=0.0, alpha=1.0)
        c = alpha * (a @ b) + beta * c     (a (M, K), b (K, N), c (M, N))

(c may also be in the operands' 16-bit dtype, beta 0: the fp32 sum rounded once, as
`cupy.matmul` gives it, so that a captured graph's GEMMs all go through this entry.)

`cupy.matmul` runs bf16 and fp16 GEMMs on the tensor cores but writes its result in the
operands' dtype; an fp32 result (the head's dxn summed over vocabulary chunks, the weight
gradients of the 16-bit layout, added by the GEMM itself) would take a 16-bit result, a cast
and an add: three launches and a rounding to 16 bits of every product. cuBLAS's `GemmEx` takes
16-bit A and B, an fp32 C and fp32 compute, and adds into C when beta = 1: one launch.

On cupy it is called on the arrays' pointers through cupy's own cuBLAS binding
(`cupy_backends.cuda.libs.cublas.gemmEx`, on cupy's handle for the current device, which the
binding puts on cupy's current stream), alpha and beta host scalars (alpha scales the fp32 sum
before it is added or rounded: the head's loss seed, `exec.head`). Row-major arrays are
column-major transposes, so c = a @ b is computed as c.T = b.T @ a.T: each operand needs a
unit stride along one of its axes (a contiguous array or a transposed view of one), c along its
rows. On the stand-in the same checks run and numpy computes the fp32 product of the 16-bit
values (exact in fp32) and adds it, counted as one device operation.
"""

from __future__ import annotations

import numpy as np

from ratrain.device import kind_of, storage_of
from ratrain.device.standin import did
from ratrain.exec.kernels import BF16

F32 = np.dtype(np.float32)
_HALVES = (np.dtype(np.float16), BF16)
# cudaDataType_t (library_types.h) and cuBLAS's enums
_CUDA_TYPE = {np.dtype(np.float16): 2, BF16: 14, F32: 0}
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0  # alpha and beta read from the host at the call


def _operand(name, x):
    """(op, ld) of a row-major 2-D operand seen column-major: N with its row stride for a
    C-ordered one, T with its column stride for a transposed view; one line otherwise."""
    s0, s1 = (s // x.dtype.itemsize for s in x.strides)
    if s1 == 1 or x.shape[1] == 1:
        return CUBLAS_OP_N, max(s0, x.shape[1], 1)
    if s0 == 1 or x.shape[0] == 1:
        return CUBLAS_OP_T, max(s1, x.shape[0], 1)
    raise ValueError(f"gemm_ex: {name} {tuple(x.shape)} with strides {tuple(x.strides)} has no "
                     "unit stride: pass a contiguous array or a transposed view of one")


def check(a, b, c) -> None:
    """One line on operands gemm_ex does not take, before any launch."""
    if a.ndim != 2 or b.ndim != 2 or c.ndim != 2:
        raise ValueError(f"gemm_ex: 2-D operands, got {a.shape}, {b.shape} and {c.shape}")
    if a.dtype not in _HALVES or b.dtype != a.dtype or c.dtype not in (F32, a.dtype):
        raise TypeError(f"gemm_ex: 16-bit a and b of one dtype and a float32 c (or c in their "
                        f"dtype), got {a.dtype}, {b.dtype} and {c.dtype}")
    (M, K), (K2, N) = a.shape, b.shape
    if K2 != K or tuple(c.shape) != (M, N):
        raise ValueError(f"gemm_ex: shapes {tuple(a.shape)} @ {tuple(b.shape)} into "
                         f"{tuple(c.shape)} do not align")
    if c.strides[1] != c.itemsize and N > 1:
        raise ValueError(f"gemm_ex: c {tuple(c.shape)} needs contiguous rows, strides "
                         f"{tuple(c.strides)}")
    _operand("a", a)
    _operand("b", b)


def takes(a, b, c) -> bool:
    """Whether `gemm_ex` takes these operands (else `check` says why in one line)."""
    try:
        check(a, b, c)
    except (TypeError, ValueError):
        return False
    return True


def gemm_ex(a, b, c, xp, beta: float = 0.0, alpha: float = 1.0):
    """c = alpha * (a @ b) + beta * c (beta 0 or 1) in fp32 from 16-bit a and b (see the
    module); returns c."""
    check(a, b, c)
    if beta not in (0.0, 1.0):
        raise ValueError(f"gemm_ex: beta={beta}: 0 (write) or 1 (add)")
    if beta and c.dtype != F32:
        raise ValueError(f"gemm_ex: beta=1 adds into a float32 c, not {c.dtype}")
    M, K = a.shape
    N = b.shape[1]
    if kind_of(xp) == "standin":
        ha, hb, hc = (storage_of(x) for x in (a, b, c))
        prod = np.matmul(ha.astype(F32), hb.astype(F32))
        if alpha != 1.0:
            prod *= F32.type(alpha)
        if beta:
            hc += prod
        else:
            hc[...] = prod  # rounded once into a 16-bit c
        did("gemm_ex", (ha, hb, hc, beta, alpha))  # one launch
        return c
    if kind_of(xp) != "gpu":
        raise TypeError("gemm_ex runs on a device (cupy, or the stand-in): the host's GEMMs "
                        "are exec.gemm's")
    if M == 0 or N == 0:
        return c
    if K == 0:
        if not beta:
            c.fill(0)
        return c
    from cupy.cuda import device as cudevice
    from cupy_backends.cuda.libs import cublas

    handle = cudevice.get_cublas_handle()
    op_b, ld_b = _operand("b", b)  # cuBLAS's A: b.T (N x K)
    op_a, ld_a = _operand("a", a)  # cuBLAS's B: a.T (K x M)
    alpha_h, beta_h = np.asarray(alpha, F32), np.asarray(beta, F32)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    cublas.gemmEx(handle, op_b, op_a, N, M, K, alpha_h.ctypes.data, b.data.ptr,
                  _CUDA_TYPE[b.dtype], ld_b, a.data.ptr, _CUDA_TYPE[a.dtype], ld_a,
                  beta_h.ctypes.data, c.data.ptr, _CUDA_TYPE[c.dtype], c.strides[0] // c.itemsize,
                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    return c


__all__ = ["check", "gemm_ex", "takes"]
