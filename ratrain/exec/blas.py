"""The host's BLAS libraries: numpy's own (OpenBLAS, the reference) and oneMKL through ctypes.

numpy's BLAS needs nothing here: `exec.gemm.matmul` calls it through `np.matmul`. oneMKL comes
from the `mkl` wheel on PyPI (the `mkl` extra: `pip install 'ratrain[mkl]'`), which ships
`libmkl_rt` and no Python module, so `load_mkl()` finds the library in the wheel's file list
(else a system one on the loader's path) and opens it once. It gives three GEMMs, each with
fp32 accumulation into an fp32 C: `cblas_sgemm`, `cblas_gemm_bf16bf16f32` (AMX on CPUs that
have it, AVX512-BF16 else) and `cblas_gemm_f16f16f32` (AMX-FP16 where present).

Threads. The library is set to its sequential layer before its first call (no OpenMP, no TBB:
the wheel's intel-openmp and tbb are not needed), so each call runs on the calling thread.
The compute threads of `exec.context` give it fixed tiles, as they give numpy's BLAS, so a
result never depends on the thread count. MKL's conditional numerical reproducibility (CNR)
is left off. It would also pin results across alignment, but its effect on the AMX paths is not
documented, and on this project's hosts the GEMMs are bitwise the same at any alignment
(`tests/test_blas.py` checks it on every host that runs the suite).

The rule of `run.blas: auto` lives with the kernel table (`exec.backends.choose_blas`); it reads
the CPU's flags from /proc/cpuinfo (`cpu_flags`), never a timing.

    lib = load_mkl()                      # or BlasUnavailable with the reason
    lib.gemm(a, b, c, beta=1.0)           # c += a @ b (2-D, any strides), fp32 accumulation
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import re

import numpy as np

from ratrain.exec.kernels import BF16

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS_LAYOUT, CBLAS_TRANSPOSE
SEQUENTIAL = 1  # MKL_THREADING_SEQUENTIAL
LP64 = 0  # MKL_INTERFACE_LP64: 32-bit integers
F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
# the CBLAS GEMM of each operand dtype, and whether a library may lack it
GEMMS = {F32: ("cblas_sgemm", True), BF16: ("cblas_gemm_bf16bf16f32", True),
         F16: ("cblas_gemm_f16f16f32", False)}
INT_MAX = 2**31 - 1  # LP64's bound on a dimension or leading dimension


class BlasUnavailable(RuntimeError):
    """oneMKL cannot be used here; the message says why in a few words."""


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
    """The CPU's feature flags (`amx_bf16`, `avx512_bf16`, ...), read once; empty where the
    file has none (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _library_path() -> str:
    """libmkl_rt from the `mkl` wheel's files, else the loader's own (a system oneMKL)."""
    try:
        dist = importlib.metadata.distribution("mkl")
        for f in dist.files or ():
            if f.name.startswith("libmkl_rt.so"):
                return str(dist.locate_file(f).resolve())
    except importlib.metadata.PackageNotFoundError:
        pass
    found = ctypes.util.find_library("mkl_rt")
    if not found:
        raise BlasUnavailable("oneMKL is not installed (the mkl wheel: pip install "
                              "'ratrain[mkl]')")
    return found


def _layout(x):
    """(transpose flag, leading dimension, array) of a 2-D operand for row-major CBLAS: its
    rows unit-strided (as is), its columns unit-strided (its transpose), else a C copy."""
    r, c = x.shape
    s0, s1 = x.strides
    it = x.itemsize
    if (c == 1 or s1 == it) and (r == 1 or (s0 % it == 0 and c * it <= s0 <= INT_MAX * it)):
        return NO_TRANS, (s0 // it if r > 1 else max(c, 1)), x
    if (r == 1 or s0 == it) and (c == 1 or (s1 % it == 0 and r * it <= s1 <= INT_MAX * it)):
        return TRANS, (s1 // it if c > 1 else max(r, 1)), x
    x = np.ascontiguousarray(x)
    return NO_TRANS, max(c, 1), x


def writable_c(c) -> bool:
    """Whether `c` can be a GEMM's C as it is: 2-D float32, its columns unit-strided."""
    if c.dtype != F32 or c.ndim != 2:
        return False
    m, n = c.shape
    return (n == 1 or c.strides[1] == 4) and (m == 1 or (c.strides[0] % 4 == 0
                                                         and n * 4 <= c.strides[0]))


class Mkl:
    """oneMKL's GEMMs (see the module): `gemm`, and what the library is (`version`)."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self._fns = {}
        for dtype, (name, required) in GEMMS.items():
            fn = getattr(lib, name, None)
            if fn is None:
                if required:
                    raise BlasUnavailable(f"{path} has no {name} (oneMKL 2023 or later has it)")
                continue
            fn.restype = None
            fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                                ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                                ctypes.c_void_p, ctypes.c_int]
            self._fns[dtype] = fn
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, len(buf))
        m = re.search(r"Version (\d+(?:\.\d+)*)", buf.value.decode(errors="replace"))
        self.version = m.group(1) if m else "unknown"

    def takes(self, dtype) -> bool:
        """Whether the library has a GEMM of operands of `dtype`."""
        return np.dtype(dtype) in self._fns

    def gemm(self, a, b, c, alpha: float = 1.0, beta: float = 0.0) -> None:
        """c = alpha a @ b + beta c: a (M, K) and b (K, N) of one dtype (float32, bfloat16 or
        float16), any strides (an operand with neither axis unit-strided is copied); c (M, N)
        with `writable_c`. Accumulates in fp32; runs on the calling thread."""
        (M, K), N = a.shape, b.shape[1]
        if M == 0 or N == 0:
            return
        if max(M, N, K) > INT_MAX:
            raise ValueError(f"GEMM of ({M}, {K}) @ ({K}, {N}): a dimension over 2**31 - 1")
        ta, lda, a = _layout(a)
        tb, ldb, b = _layout(b)
        ldc = c.strides[0] // 4 if M > 1 else max(N, 1)
        self._fns[a.dtype](ROW_MAJOR, ta, tb, M, N, K, alpha, a.ctypes.data, lda,
                           b.ctypes.data, ldb, beta, c.ctypes.data, ldc)


@functools.cache
def _load() -> Mkl | BlasUnavailable:
    try:
        path = _library_path()
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise BlasUnavailable(f"{path} does not load ({e})") from None
        for name in ("MKL_Set_Threading_Layer", "MKL_Set_Interface_Layer",
                     "MKL_Get_Version_String"):
            if getattr(lib, name, None) is None:
                raise BlasUnavailable(f"{path} is not oneMKL's runtime library (no {name})")
        # before any other call: the layer can be set only once, by the library's first user
        if lib.MKL_Set_Interface_Layer(LP64) != LP64:
            raise BlasUnavailable(f"{path} was loaded with the ILP64 interface by another "
                                  "library of this process")
        if lib.MKL_Set_Threading_Layer(SEQUENTIAL) != SEQUENTIAL:
            raise BlasUnavailable(f"{path} was loaded with a threaded layer by another library "
                                  "of this process (ratrain needs its sequential layer)")
        return Mkl(lib, path)
    except BlasUnavailable as e:
        return e


def load_mkl() -> Mkl:
    """The process's oneMKL, opened once and set to its sequential layer; BlasUnavailable
    (the reason in a few words) where it cannot be used."""
    got = _load()
    if isinstance(got, BlasUnavailable):
        raise got
    return got


def why_no_mkl() -> str:
    """Why oneMKL cannot be used here ("" when it can)."""
    got = _load()
    return str(got) if isinstance(got, BlasUnavailable) else ""


__all__ = ["BlasUnavailable", "Mkl", "cpu_flags", "load_mkl", "why_no_mkl", "writable_c"]
