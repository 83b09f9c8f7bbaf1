"""Buffers and reductions shared by the collectives: segments, work dtypes, reduction ops,
scratch arrays accounted in the DDR ledger. Loads no MPI (`algos` and the planner use it)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np

_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def as_ufunc(op):
    if isinstance(op, str):
        if op not in _OPS:
            raise ValueError(f"op={op!r} is not one of {', '.join(_OPS)}")
        return _OPS[op]
    if op in _OPS.values():
        return op
    MPI = sys.modules.get("mpi4py.MPI")  # an MPI op comes from an MPI that is loaded already
    for name in _OPS if MPI is not None else ():
        if op == getattr(MPI, name.upper()):
            return _OPS[name]
    raise ValueError(f"op={op!r}: use 'sum', 'max' or 'min'")


def segments(n: int, p: int) -> list[int]:
    """Bounds of the p segments of n elements: segment q = [b[q], b[q+1]), sizes differ by <= 1."""
    return [q * n // p for q in range(p + 1)]


def work_dtype(dtype) -> np.dtype:
    """The dtype partial results are kept in: float32 for float16, else the payload's own."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def flat(buf: np.ndarray) -> np.ndarray:
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"collectives work on numpy arrays, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(f"collective buffer must be C-contiguous (shape {buf.shape}, strides {buf.strides})")
    return buf.reshape(-1)


@contextmanager
def scratch(ledger, tag: str, n: int, dtype):
    """A temporary array, accounted in the DDR ledger when one is given."""
    arr = ledger.alloc(tag, (n,), dtype, zero=False) if ledger is not None else np.empty(n, dtype)
    try:
        yield arr
    finally:
        if ledger is not None:
            ledger.free(arr)


__all__ = ["as_ufunc", "flat", "scratch", "segments", "work_dtype"]
