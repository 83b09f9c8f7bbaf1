"""Collectives written on point-to-point and shared memory only: all-reduce, reduce-scatter,
all-gather and broadcast by any algorithm of the registry (`algos`: ring, tree, hier, and MPI's
own as the `algo="mpi"` reference for tests and the benchmark; the runtime never uses it).

All operate in place on C-contiguous numpy arrays of any shape and length, on any number of
ranks. float16 payloads are reduced in float32 (the partial sums travel as float32) and rounded
to float16 once, at the end. Each algorithm's reduction order is fixed and documented (`algos`),
so every rank ends with bitwise the same result and a rerun gives bitwise the same result
again; `reference_allreduce(arrays, algo)` computes it in one process, and the tests compare
the MPI runs with it bitwise.

`algo="auto"` is the registry's rule (`algos.choose`, shared with the planner), through
`choose_algo`: `hier` for a communicator with a NodeGroup (the topology's world and
data-parallel communicators: the runtime's, so its results never depend on how ranks are packed
into nodes), else the cheapest algorithm under the latency-bandwidth model of the link (or of
the host's MPI without one); the runtime's engine adds the configured `comm.allreduce`.

    allreduce(grad, dp_comm)                        # in place, algo="auto"
    seg = reduce_scatter(buf, comm)                 # view of this rank's reduced segment
    allgather(buf, comm)                            # every rank's segment to every rank
    bcast(buf, comm, root=0)
"""

from __future__ import annotations

from . import algos
from .algos import reference as reference_allreduce
from .arrays import as_ufunc, segments, work_dtype
from .hier import hier_allgather_op, hier_reduce_op
from .mpiref import mpi_bcast_op
from .progress import run as _run
from .ring import COLL_TAG
from .tree import bcast_op

LINK_POLL_S = 2e-5  # with the throttle on, test requests this often instead of spinning in MPI


def run(op, link=None):
    """Drive a collective in this thread; with a link, poll instead of spinning in MPI."""
    return _run(op, LINK_POLL_S if link is not None else None)


def choose_algo(nbytes: int, p: int, link=None, group=None, configured: str = "auto",
                op: str = "allreduce") -> str:
    """The runtime's side of `algos.choose`: `group` (the communicator's NodeGroup, or None)
    says whether its members are grouped by node; the model's link is `link`'s platform rates
    (or the host's MPI when there is none); `configured`: `comm.allreduce`."""
    if link is None:
        return algos.choose(op, nbytes, p, grouped=group is not None, configured=configured)
    return algos.choose(op, nbytes, p, grouped=group is not None, configured=configured,
                        latency=link.latency * link.time_scale,
                        bandwidth=link.bandwidth / link.time_scale)


def allreduce_op(buf, comm, algo="auto", op="sum", tag=COLL_TAG, link=None, ledger=None,
                 group=None):
    """The all-reduce operation (a generator) for `algo`; `auto` resolved here."""
    as_ufunc(op)  # a bad op fails here, on every rank count
    if algo == "auto":
        algo = choose_algo(buf.nbytes, comm.Get_size(), link, group)
    return algos.get(algo).op("allreduce")(buf, comm, op, tag, link, ledger, group)


def allreduce(buf, comm, algo="auto", op="sum", *, link=None, ledger=None, tag=COLL_TAG,
              group=None):
    """All-reduce `buf` in place over `comm`; returns `buf`. Without a link or a ledger, an
    algorithm with a blocking path (the tree's) takes it."""
    as_ufunc(op)
    if algo == "auto":
        algo = choose_algo(buf.nbytes, comm.Get_size(), link, group)
    a = algos.get(algo)
    if link is None and ledger is None and a.blocking is not None:
        return a.op("blocking")(buf, comm, op, tag)
    return run(a.op("allreduce")(buf, comm, op, tag, link, ledger, group), link)


def reduce_scatter_op(buf, comm, op="sum", tag=COLL_TAG, link=None, ledger=None, algo="ring",
                      group=None):
    """The reduce-scatter operation for `algo` (`auto`: the rule, hier with a group)."""
    if algo == "auto":
        algo = choose_algo(buf.nbytes, comm.Get_size(), link, group, op="reduce_scatter")
    return algos.get(algo).op("reduce_scatter")(buf, comm, op, tag, link, ledger, group)


def allgather_op(buf, comm, tag=COLL_TAG, link=None, algo="ring", group=None):
    """The all-gather operation for `algo` (`auto`: the rule, hier with a group)."""
    if algo == "auto":
        algo = choose_algo(buf.nbytes, comm.Get_size(), link, group, op="allgather")
    return algos.get(algo).op("allgather")(buf, comm, tag, link, group)


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


__all__ = [
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
