"""MPI's own collectives, as operations of the same shape as ours (`algos`' signatures): the
reference of the tests and the benchmark (`algo="mpi"`) only; the runtime never uses them, and
they cannot run through the link throttle."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .arrays import as_ufunc, flat, segments

_MPI_OPS = {np.add: MPI.SUM, np.maximum: MPI.MAX, np.minimum: MPI.MIN}


def _no_link(link) -> None:
    if link is not None:
        raise ValueError("algo='mpi' cannot run through the link throttle; use ring or tree")


def mpi_allreduce_op(buf, comm, op="sum", tag=None, link=None, ledger=None, group=None):
    _no_link(link)  # raised when the operation is driven
    x = flat(buf)
    w = x.astype(np.float32) if x.dtype == np.float16 else x
    comm.Allreduce(MPI.IN_PLACE, w, _MPI_OPS[as_ufunc(op)])
    if w is not x:
        x[:] = w
    return buf
    yield  # a generator, like the others


def mpi_reduce_scatter_op(buf, comm, op="sum", tag=None, link=None, ledger=None, group=None):
    _no_link(link)  # raised when the operation is driven
    x = flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    b = segments(x.size, p)
    w = x.astype(np.float32) if x.dtype == np.float16 else x
    out = np.empty(b[r + 1] - b[r], w.dtype)
    comm.Reduce_scatter(w, out, [b[q + 1] - b[q] for q in range(p)], _MPI_OPS[as_ufunc(op)])
    x[b[r]:b[r + 1]] = out
    return x[b[r]:b[r + 1]]
    yield


def mpi_allgather_op(buf, comm, tag=None, link=None, group=None):
    _no_link(link)  # raised when the operation is driven
    x = flat(buf)
    p = comm.Get_size()
    b = segments(x.size, p)
    xb = x.view(np.uint8)
    isz = x.itemsize
    counts = [(b[q + 1] - b[q]) * isz for q in range(p)]
    comm.Allgatherv(MPI.IN_PLACE, [xb, counts, [v * isz for v in b[:-1]], MPI.BYTE])
    return buf
    yield


def mpi_bcast_op(buf, comm, root=0):
    comm.Bcast([flat(buf).view(np.uint8), MPI.BYTE], root)
    return buf
    yield


__all__ = ["mpi_allgather_op", "mpi_allreduce_op", "mpi_bcast_op", "mpi_reduce_scatter_op"]
