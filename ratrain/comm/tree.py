"""Tree collectives on point-to-point: the all-reduce by recursive doubling (log2(p) exchanges,
the latency-optimal path for small messages) and the binomial-tree broadcast. With m the
largest power of two <= p, rank i < p - m first adds rank i + m's data, the m ranks then sum
pairwise over rank order, and ranks >= m receive the result from rank i - m (see `collectives`
for the documented order).

On one node, without a link throttle or message logging, arrays of up to `board.BOARD_BYTES`
go through the communicator's shared-memory board instead (`board`: one compiled call per rank,
the same order, the same bits): the blocking call makes the board on first use, an operation
uses one made before (`board.attach`, which `Topology` does for its world and data-parallel
communicators).
"""

from __future__ import annotations

import numpy as np

from . import board
from .arrays import as_ufunc, flat, scratch, work_dtype
from .ring import COLL_TAG
from .wire import LOG_MESSAGES, exchange_op, recv_op, send_op


def tree_allreduce_op(buf, comm, op="sum", tag=COLL_TAG, link=None, ledger=None):
    x = flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1 or x.size == 0:
        return buf
    ufunc, wd = as_ufunc(op), work_dtype(x.dtype)
    if link is None and not LOG_MESSAGES:
        code = board.fits(x, ufunc)
        b = board.board_of(comm) if code is not None else None
        if board.usable(b):
            yield from b.allreduce_op(x, code)
            return buf
    m = 1 << (p.bit_length() - 1)  # largest power of two <= p
    extra = p - m
    with scratch(ledger, "comm.tree", x.size, wd) as tmp, \
            scratch(ledger if wd != x.dtype else None, "comm.tree.fp32", x.size if wd != x.dtype else 0, wd) as w:
        if wd != x.dtype:
            np.copyto(w, x)
        else:
            w = x
        if link is None and not LOG_MESSAGES and w.dtype.char in "fdilq":
            # Fast path for small messages (the same messages, minus per-message overhead):
            # typed buffers, one request list per step.
            if r >= m:
                yield [comm.Isend(w, r - m, tag)]
                yield [comm.Irecv(w, r - m, tag)]
            else:
                if r < extra:
                    yield [comm.Irecv(tmp, r + m, tag)]
                    ufunc(w, tmp, out=w)
                d = 1
                while d < m:
                    yield [comm.Irecv(tmp, r ^ d, tag), comm.Isend(w, r ^ d, tag)]
                    ufunc(w, tmp, out=w)
                    d <<= 1
                if r < extra:
                    yield [comm.Isend(w, r + m, tag)]
        elif r >= m:  # fold in, then wait for the result
            yield from send_op(w, r - m, tag, comm, link, verb="tree.fold")
            yield from recv_op(w, r - m, tag, comm, link, verb="tree.result")
        else:
            if r < extra:
                yield from recv_op(tmp, r + m, tag, comm, link, verb="tree.fold")
                ufunc(w, tmp, out=w)  # y[r] = x[r] + x[r+m]
            d = 1
            while d < m:
                yield from exchange_op(w, r ^ d, tmp, r ^ d, tag, comm, link, verb="tree.step")
                ufunc(w, tmp, out=w)  # same value on both partners: + is commutative
                d <<= 1
            if r < extra:
                yield from send_op(w, r + m, tag, comm, link, verb="tree.result")
        if w is not x:
            np.copyto(x, w, casting="same_kind")
    return buf


def tree_allreduce_blocking(buf, comm, op="sum", tag=COLL_TAG):
    """The tree all-reduce without a link, blocking: same messages and order as
    `tree_allreduce_op`, with one Sendrecv per step (the latency path for small messages), or
    on one node the board (made here on first use: every rank is in this call)."""
    x = flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1 or x.size == 0:
        return buf
    ufunc, wd = as_ufunc(op), work_dtype(x.dtype)
    code = board.fits(x, ufunc)
    if code is not None:
        b = board.attach(comm)
        if board.usable(b):
            b.allreduce(x, code)
            return buf
    w = x if wd == x.dtype else x.astype(wd)
    tmp = np.empty_like(w)
    m = 1 << (p.bit_length() - 1)
    if r >= m:
        comm.Send(w, r - m, tag)
        comm.Recv(w, r - m, tag)
    else:
        if r < p - m:
            comm.Recv(tmp, r + m, tag)
            ufunc(w, tmp, out=w)
        d = 1
        while d < m:
            comm.Sendrecv(w, r ^ d, tag, tmp, r ^ d, tag)
            ufunc(w, tmp, out=w)
            d <<= 1
        if r < p - m:
            comm.Send(w, r + m, tag)
    if w is not x:
        np.copyto(x, w, casting="same_kind")
    return buf


def bcast_op(buf, comm, root=0, tag=COLL_TAG, link=None):
    """Binomial-tree broadcast from `root`."""
    x = flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    v = (r - root) % p  # rank relative to the root
    mask = 1
    while mask < p:
        if v & mask:
            yield from recv_op(x, (v - mask + root) % p, tag, comm, link, verb="bcast")
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            yield from send_op(x, (v + mask + root) % p, tag, comm, link, verb="bcast")
        mask >>= 1
    return buf



__all__ = ["bcast_op", "tree_allreduce_blocking", "tree_allreduce_op"]
