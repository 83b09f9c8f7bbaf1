"""Tree collectives on point-to-point: the all-reduce by recursive doubling (log2(p) exchanges,
the latency-optimal path for small messages) and the binomial-tree broadcast. With m the
largest power of two <= p, rank i < p - m first adds rank i + m's data, the m ranks then sum
pairwise over rank order, and ranks >= m receive the result from rank i - m (see `algos` for
the documented order). Without a link throttle the messages are typed MPI buffers, one request
list per step (`tree_allreduce_op`), or one Sendrecv per step in the caller's thread
(`tree_allreduce_blocking`, the latency path of small arrays); with `wire.log_messages` on,
every path logs its messages.
"""

from __future__ import annotations

import numpy as np

from .arrays import as_ufunc, flat, scratch, work_dtype
from .progress import run
from .ring import COLL_TAG
from .wire import LOG, exchange_op, log_exchange, recv_op, send_op

TYPED = "fdilq"  # work dtypes MPI sends as typed buffers (the paths without a link)


def tree_allreduce_op(buf, comm, op="sum", tag=COLL_TAG, link=None, ledger=None, group=None):
    x = flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1 or x.size == 0:
        return buf
    ufunc, wd = as_ufunc(op), work_dtype(x.dtype)
    m = 1 << (p.bit_length() - 1)  # largest power of two <= p
    extra = p - m
    with scratch(ledger, "comm.tree", x.size, wd) as tmp, \
            scratch(ledger if wd != x.dtype else None, "comm.tree.fp32", x.size if wd != x.dtype else 0, wd) as w:
        if wd != x.dtype:
            np.copyto(w, x)
        else:
            w = x
        if link is None and w.dtype.char in TYPED:
            # Fast path for small messages (the same messages, minus per-message overhead):
            # typed buffers, one request list per step.
            nb = w.nbytes if LOG.on else None
            if r >= m:
                if nb:
                    log_exchange("tree.fold", comm, r - m, nb, None, None, tag)
                yield [comm.Isend(w, r - m, tag)]
                if nb:
                    log_exchange("tree.result", comm, None, None, r - m, nb, tag)
                yield [comm.Irecv(w, r - m, tag)]
            else:
                if r < extra:
                    if nb:
                        log_exchange("tree.fold", comm, None, None, r + m, nb, tag)
                    yield [comm.Irecv(tmp, r + m, tag)]
                    ufunc(w, tmp, out=w)
                d = 1
                while d < m:
                    if nb:
                        log_exchange("tree.step", comm, r ^ d, nb, r ^ d, nb, tag)
                    yield [comm.Irecv(tmp, r ^ d, tag), comm.Isend(w, r ^ d, tag)]
                    ufunc(w, tmp, out=w)
                    d <<= 1
                if r < extra:
                    if nb:
                        log_exchange("tree.result", comm, r + m, nb, None, None, tag)
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
    `tree_allreduce_op`, with one Sendrecv per step (the latency path for small messages)."""
    x = flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1 or x.size == 0:
        return buf
    ufunc, wd = as_ufunc(op), work_dtype(x.dtype)
    if wd.char not in TYPED:  # no typed MPI buffer: the operation's messages
        return run(tree_allreduce_op(buf, comm, op, tag))
    w = x if wd == x.dtype else x.astype(wd)
    tmp = np.empty_like(w)
    m = 1 << (p.bit_length() - 1)
    nb = w.nbytes if LOG.on else None
    if r >= m:
        if nb:
            log_exchange("tree.fold", comm, r - m, nb, None, None, tag)
            log_exchange("tree.result", comm, None, None, r - m, nb, tag)
        comm.Send(w, r - m, tag)
        comm.Recv(w, r - m, tag)
    else:
        if r < p - m:
            if nb:
                log_exchange("tree.fold", comm, None, None, r + m, nb, tag)
            comm.Recv(tmp, r + m, tag)
            ufunc(w, tmp, out=w)
        d = 1
        while d < m:
            if nb:
                log_exchange("tree.step", comm, r ^ d, nb, r ^ d, nb, tag)
            comm.Sendrecv(w, r ^ d, tag, tmp, r ^ d, tag)
            ufunc(w, tmp, out=w)
            d <<= 1
        if r < p - m:
            if nb:
                log_exchange("tree.result", comm, r + m, nb, None, None, tag)
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


__all__ = ["TYPED", "bcast_op", "tree_allreduce_blocking", "tree_allreduce_op"]
