"""Collectives written on point-to-point and shared memory only: ring, tree and hierarchical
all-reduce, reduce-scatter, all-gather, broadcast. MPI's own collectives appear here only as the
`algo="mpi"` reference for tests and the benchmark; the runtime never uses them.

All operate in place on C-contiguous numpy arrays of any shape and length, on any number of
ranks. float16 payloads are reduced in float32 (the partial sums travel as float32) and rounded
to float16 once, at the end. The reduction order is fixed, so every rank ends with bitwise the
same result and a rerun gives bitwise the same result again:

ring  (reduce-scatter then all-gather; bandwidth-optimal, 2(p-1) steps)
    The flat buffer of n elements is cut into p segments, segment q = [q*n//p, (q+1)*n//p).
    Segment q is reduced as a left fold over the ranks q+1, q+2, ..., p-1, 0, ..., q
    (x[q+1] + x[q+2] + ... + x[q]), ending on rank q, which then passes it round the ring.
tree  (recursive doubling, i.e. a binomial tree rooted at every rank; log2(p) steps)
    With m = the largest power of two <= p, rank i < p - m first adds rank i + m's data
    (y[i] = x[i] + x[i+m]), then the m ranks sum pairwise over rank order:
    ((y0 + y1) + (y2 + y3)) + ((y4 + y5) + (y6 + y7)) ... (both partners compute the same sum:
    IEEE addition is commutative), and ranks >= m receive the result from rank i - m.
hier  (shared memory inside a node, a chain of messages per local rank across nodes; `hier`)
    A left fold over the ranks in rank order, x[0] + x[1] + ... + x[p-1], whatever the ranks'
    grouping into nodes; reduce-scatter and all-reduce reduce every element in that order.
    It needs the communicator's `hier.NodeGroup` (`group=`; `Topology.group(comm)`).
auto  `hier` when the communicator has a NodeGroup (the topology's world and data-parallel
    communicators: the runtime's, so its results never depend on how ranks are packed into
    nodes), else the cheaper of ring and tree under the latency-bandwidth model
    (`choose_algo`); the choice depends only on (bytes, ranks, model, group), so it is the same
    on every rank and in every run.

`reference_allreduce(arrays, algo)` computes either order in one process; tests check the MPI
versions against it bitwise.

    allreduce(grad, dp_comm)                        # in place, algo="auto"
    seg = reduce_scatter(buf, comm)                 # view of this rank's reduced segment
    allgather(buf, comm)                            # every rank's segment to every rank
    bcast(buf, comm, root=0)
"""

from __future__ import annotations

import numpy as np

from . import board, model
from .arrays import as_ufunc, segments, work_dtype
from .hier import hier_allgather_op, hier_reduce_op
from .mpiref import mpi_allgather_op, mpi_allreduce_op, mpi_bcast_op, mpi_reduce_scatter_op
from .progress import run as _run
from .ring import COLL_TAG, ring_allreduce_op
from .ring import allgather_op as ring_allgather_op
from .ring import reduce_scatter_op as ring_reduce_scatter_op
from .tree import bcast_op, tree_allreduce_blocking, tree_allreduce_op
from .wire import LOG_MESSAGES

ALGOS = ("ring", "tree", "hier", "auto", "mpi")
LINK_POLL_S = 2e-5  # with the throttle on, test requests this often instead of spinning in MPI


def run(op, link=None):
    """Drive a collective in this thread; with a link, poll instead of spinning in MPI."""
    return _run(op, LINK_POLL_S if link is not None else None)


def choose_algo(nbytes: int, p: int, link=None, group=None) -> str:
    """`hier` for a communicator with a NodeGroup, else `ring` or `tree`, whichever all-reduce
    the latency-bandwidth model (`comm.model`) says is faster on `link` (or on the host's MPI
    when there is none)."""
    if group is not None:
        return "hier"
    if link is None:
        return model.cheapest(nbytes, p)
    return model.cheapest(nbytes, p, link.latency * link.time_scale,
                          link.bandwidth / link.time_scale)


def _need_group(group, what: str):
    if group is None:
        raise ValueError(f"{what} with algo='hier' needs the communicator's NodeGroup (group=; "
                         "Topology.group(comm) or hier.NodeGroup(comm, nodes))")
    return group


def allreduce_op(buf, comm, algo="auto", op="sum", tag=COLL_TAG, link=None, ledger=None,
                 group=None):
    """The all-reduce operation (a generator) for `algo`; `auto` resolved here."""
    as_ufunc(op)  # a bad op fails here, on every rank count
    if algo == "auto":
        algo = choose_algo(buf.nbytes, comm.Get_size(), link, group)
    if algo == "hier":
        return hier_reduce_op(buf, _need_group(group, "allreduce"), op, tag, link, ledger)
    if algo == "ring":
        return ring_allreduce_op(buf, comm, op, tag, link, ledger)
    if algo == "tree":
        return tree_allreduce_op(buf, comm, op, tag, link, ledger)
    if algo == "mpi":
        if link is not None:
            raise ValueError("algo='mpi' cannot run through the link throttle; use ring or tree")
        return mpi_allreduce_op(buf, comm, op)
    raise ValueError(f"algo={algo!r} is not one of {', '.join(ALGOS)}")


def allreduce(buf, comm, algo="auto", op="sum", *, link=None, ledger=None, tag=COLL_TAG,
              group=None):
    """All-reduce `buf` in place over `comm`; returns `buf`."""
    if (algo == "tree" or algo == "auto" and group is None) and link is None and \
            ledger is None and not LOG_MESSAGES and board.allreduce(buf, comm, op, algo == "auto"):
        return buf  # a small array of a one-node communicator: its board, the least work
    as_ufunc(op)
    if algo == "auto":
        algo = choose_algo(buf.nbytes, comm.Get_size(), link, group)
    if algo == "tree" and link is None and ledger is None and not LOG_MESSAGES and \
            work_dtype(buf.dtype).char in "fdilq":
        return tree_allreduce_blocking(buf, comm, op, tag)
    return run(allreduce_op(buf, comm, algo, op, tag, link, ledger, group), link)


def reduce_scatter_op(buf, comm, op="sum", tag=COLL_TAG, link=None, ledger=None, algo="ring",
                      group=None):
    """The reduce-scatter operation for `algo` (`ring`, `hier`; `auto`: hier with a group)."""
    if algo == "auto":
        algo = "hier" if group is not None else "ring"
    if algo == "hier":
        return hier_reduce_op(buf, _need_group(group, "reduce_scatter"), op, tag, link, ledger,
                              scatter=True)
    if algo == "mpi":
        return mpi_reduce_scatter_op(buf, comm, op)
    if algo != "ring":
        raise ValueError(f"reduce_scatter algo={algo!r}: use ring, hier, auto or mpi")
    return ring_reduce_scatter_op(buf, comm, op, tag, link, ledger)


def allgather_op(buf, comm, tag=COLL_TAG, link=None, algo="ring", group=None):
    """The all-gather operation for `algo` (`ring`, `hier`; `auto`: hier with a group)."""
    if algo == "auto":
        algo = "hier" if group is not None else "ring"
    if algo == "hier":
        return hier_allgather_op(buf, _need_group(group, "allgather"), tag, link)
    if algo == "mpi":
        return mpi_allgather_op(buf, comm)
    if algo != "ring":
        raise ValueError(f"allgather algo={algo!r}: use ring, hier, auto or mpi")
    return ring_allgather_op(buf, comm, tag, link)


def reduce_scatter(buf, comm, op="sum", *, algo="ring", link=None, ledger=None, tag=COLL_TAG,
                   group=None):
    """Reduce `buf` over `comm`; returns the view of this rank's segment (see `segments`) holding
    its reduced values. The rest of `buf` is scratch afterwards."""
    return run(reduce_scatter_op(buf, comm, op, tag, link, ledger, algo, group), link)


def allgather(buf, comm, *, algo="ring", link=None, tag=COLL_TAG, group=None):
    """Fill `buf` in place with every rank's segment (rank q contributes `segments(n, p)[q:q+2]`)."""
    return run(allgather_op(buf, comm, tag, link, algo, group), link)


def bcast(buf, comm, root=0, *, algo="tree", link=None, tag=COLL_TAG):
    """Broadcast `buf` from `root` in place (binomial tree)."""
    if algo == "mpi":
        return run(mpi_bcast_op(buf, comm, root))
    return run(bcast_op(buf, comm, root, tag, link), link)


# --------------------------------------------------------------------------------------------
# The documented orders, in one process (tests compare the MPI versions bitwise with these)
# --------------------------------------------------------------------------------------------


def reference_allreduce(arrays, algo="ring", op="sum"):
    """What `allreduce` returns on every rank when rank i holds `arrays[i]` (same order, same rounding)."""
    ufunc = as_ufunc(op)
    p = len(arrays)
    dtype = arrays[0].dtype
    xs = [np.asarray(a).reshape(-1).astype(work_dtype(dtype)) for a in arrays]
    n = xs[0].size
    if p == 1:
        return np.asarray(arrays[0]).copy()
    if algo == "ring":
        out = np.empty(n, xs[0].dtype)
        b = segments(n, p)
        for q in range(p):
            sl = slice(b[q], b[q + 1])
            acc = xs[(q + 1) % p][sl].copy()
            for j in range(2, p + 1):
                acc = ufunc(acc, xs[(q + j) % p][sl])
            out[sl] = acc
    elif algo == "tree":
        m = 1 << (p.bit_length() - 1)
        ys = [ufunc(xs[i], xs[i + m]) if i < p - m else xs[i] for i in range(m)]
        while len(ys) > 1:
            ys = [ufunc(ys[i], ys[i + 1]) for i in range(0, len(ys), 2)]
        out = ys[0]
    elif algo == "hier":  # a left fold in rank order, whatever the nodes
        out = xs[0].copy()
        for x in xs[1:]:
            out = ufunc(out, x)
    else:
        raise ValueError(f"no reference order for algo={algo!r}")
    return out.astype(dtype).reshape(np.shape(arrays[0]))


__all__ = [
    "ALGOS",
    "COLL_TAG",
    "LINK_POLL_S",
    "allgather",
    "allgather_op",
    "allreduce",
    "allreduce_op",
    "bcast",
    "bcast_op",
    "choose_algo",
    "hier_allgather_op",
    "hier_reduce_op",
    "reduce_scatter",
    "reduce_scatter_op",
    "reference_allreduce",
    "segments",
    "work_dtype",
]
