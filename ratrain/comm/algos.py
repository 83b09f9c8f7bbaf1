"""The collective algorithms, in one registry, and the one rule that chooses among them.

An entry (`Algorithm`) holds everything about one algorithm: its operations (all-reduce, and
reduce-scatter and all-gather where it has them), the reduction order it documents (its
reference: what every rank ends with, computed in one process; the bitwise tests compare the
MPI runs with it) and its cost terms (`comm.model`). The collectives (`collectives`), the
engine, the benchmark (`python -m ratrain.comm.bench`) and the planner (`ratrain.plan.cost`)
all read this registry; adding an algorithm is one `register(Algorithm(...))` and its
reference test. Importing this module loads no MPI (the planner reads it): operations are
named as "module:function" (relative to `ratrain.comm`) and imported on first use, or given
as functions by a caller that has them.

Operations take one signature each (`Op`):

    allreduce, reduce_scatter  (buf, comm, op, tag, link, ledger, group) -> an operation
    allgather                  (buf, comm, tag, link, group) -> an operation
    blocking                   (buf, comm, op, tag) -> buf   (an all-reduce without a link or
                               a ledger, in this thread: the latency path of small arrays)

where an operation is a generator of `progress` (the engine drives several at once), `group`
the communicator's `hier.NodeGroup` or None. A reference takes every rank's flat array in the
work dtype (`arrays.work_dtype`) and the ufunc, and returns the flat result in the work dtype.

The built-in entries:

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
    It needs the communicator's NodeGroup (`group=`; `Topology.group(comm)`).
mpi   MPI's own collectives: the reference of the tests and the benchmark only (no documented
    order, no cost terms); the runtime never runs it (`runtime=False`).

`choose` is the rule, the same for the runtime (`collectives.choose_algo`, the engine) and the
planner (`plan.cost.CostModel`); it depends only on its arguments, so every rank and every run
choose the same:

1. an all-reduce takes the configured algorithm (`comm.allreduce`) when one is named;
2. else a communicator whose members are grouped by node (`grouped`: the topology's world and
   data-parallel communicators, the runtime's) takes `hier`: a run is bitwise the same however
   its ranks are packed into nodes, so the choice there must not depend on the packing, and
   every algorithm's cost does; `hier` is the one built for two link levels, and its rank-order fold
   ignores the packing. The planner prices the runtime's groups so, with hier's terms;
3. else (a bare communicator: tests, the benchmark) the cheapest, alone on a link of
   (`latency`, `bandwidth`), of the runtime's algorithms that have `op` and need no group
   (ties: the first registered).

    algos.get("ring").op("allreduce")(buf, comm, "sum", tag, None, None, None)
    algos.choose("allreduce", 8, 4, grouped=False)                    # "tree"
    algos.reference(xs, "tree")                                       # what every rank ends with
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ratrain.config import ConfigError

from . import model
from .arrays import as_ufunc, segments, work_dtype

Op = Callable | str  # a function, or "module:function" (relative to ratrain.comm: ".ring:...")
KINDS = ("allreduce", "reduce_scatter", "allgather", "blocking")


@dataclass(frozen=True)
class Algorithm:
    """One collective algorithm (see the module): `name`, its operations, `reference` (its
    order in one process), `terms` (`comm.model`'s signature), whether it `needs_group` (a
    NodeGroup), and whether the runtime may run it (`runtime`; False: a reference only)."""

    name: str
    allreduce: Op
    reference: Callable | None
    terms: Callable | None
    reduce_scatter: Op | None = None
    allgather: Op | None = None
    blocking: Op | None = None
    needs_group: bool = False
    runtime: bool = True
    _loaded: dict = field(default_factory=dict, compare=False, repr=False)

    def has(self, kind: str) -> bool:
        return getattr(self, kind) is not None

    def op(self, kind: str):
        """The function of `kind` (KINDS), imported on first use."""
        f = self._loaded.get(kind)
        if f is None:
            f = getattr(self, kind)
            if f is None:
                raise ValueError(f"algo={self.name!r} has no {kind}: "
                                 f"use one of {', '.join(names(kind))}")
            if isinstance(f, str):
                module, _, attr = f.partition(":")
                f = getattr(importlib.import_module(module, __package__), attr)
            self._loaded[kind] = f
        return f


_REGISTRY: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    """Add `algo` to the registry (its name unused, not `auto`); a runtime algorithm needs a
    reference and cost terms, so that it is tested and priced like the others."""
    if algo.name in _REGISTRY or algo.name == "auto":
        raise ValueError(f"collective algorithm {algo.name!r} is registered already")
    if algo.runtime and (algo.reference is None or algo.terms is None):
        raise ValueError(f"collective algorithm {algo.name!r}: a runtime algorithm needs its "
                         "reference order and its cost terms")
    _REGISTRY[algo.name] = algo
    return algo


def unregister(name: str) -> None:
    """Remove an algorithm (tests that registered one)."""
    del _REGISTRY[name]


def names(kind: str | None = None, runtime: bool | None = None) -> tuple[str, ...]:
    """The registered names, in registration order: those with `kind`, those the runtime may
    run (`runtime=True`) or may not."""
    return tuple(n for n, a in _REGISTRY.items()
                 if (kind is None or a.has(kind)) and (runtime is None or a.runtime == runtime))


def get(name: str) -> Algorithm:
    a = _REGISTRY.get(name)
    if a is None:
        raise ValueError(f"algo={name!r} is not one of auto, {', '.join(_REGISTRY)}")
    return a


def check_choice(name: str, key: str = "comm.allreduce") -> None:
    """Refuse a config's all-reduce algorithm the runtime cannot run (ConfigError, one line)."""
    a = _REGISTRY.get(name)
    if name != "auto" and (a is None or not a.runtime):
        raise ConfigError(f"{key}={name!r} is not one of: auto, "
                          f"{', '.join(names('allreduce', runtime=True))} (registered in "
                          "ratrain.comm.algos)")


def choose(op: str, nbytes: float, p: int, *, grouped: bool, configured: str = "auto",
           latency: float = model.HOST_LATENCY, bandwidth: float = model.HOST_BANDWIDTH) -> str:
    """The algorithm of one collective `op` of `nbytes` over `p` ranks: the rule (module)."""
    if configured != "auto" and op == "allreduce":
        return configured
    if grouped:
        return "hier"
    links = model.Links.flat(latency, bandwidth)
    best, best_s = "", 0.0
    for name, a in _REGISTRY.items():
        if a.runtime and not a.needs_group and a.has(op):
            s = model.alone(a.terms(op, nbytes, p, 1, links), links)
            if not best or s < best_s:
                best, best_s = name, s
    return best


def seconds(name: str, op: str, nbytes: float, p: int, latency: float,
            bandwidth: float) -> float:
    """Seconds of `op` by algorithm `name` over p ranks, alone on one link (flat)."""
    links = model.Links.flat(latency, bandwidth)
    return model.alone(get(name).terms(op, nbytes, p, 1, links), links)


def reference(arrays, name: str = "ring", op: str = "sum") -> np.ndarray:
    """What an all-reduce by `name` leaves on every rank when rank i holds `arrays[i]` (same
    order, same rounding: float16 reduced in float32, rounded once)."""
    ufunc = as_ufunc(op)
    a = get(name)
    if a.reference is None:
        raise ValueError(f"no reference order for algo={name!r}")
    if len(arrays) == 1:
        return np.asarray(arrays[0]).copy()
    dtype = arrays[0].dtype
    xs = [np.asarray(x).reshape(-1).astype(work_dtype(dtype)) for x in arrays]
    return a.reference(xs, ufunc).astype(dtype).reshape(np.shape(arrays[0]))


# --------------------------------------------------------------------------------------------
# The built-in algorithms' orders (the module's table) and entries
# --------------------------------------------------------------------------------------------


def ring_order(xs, ufunc):
    p, n = len(xs), xs[0].size
    out = np.empty(n, xs[0].dtype)
    b = segments(n, p)
    for q in range(p):
        sl = slice(b[q], b[q + 1])
        acc = xs[(q + 1) % p][sl].copy()
        for j in range(2, p + 1):
            acc = ufunc(acc, xs[(q + j) % p][sl])
        out[sl] = acc
    return out


def tree_order(xs, ufunc):
    p = len(xs)
    m = 1 << (p.bit_length() - 1)
    ys = [ufunc(xs[i], xs[i + m]) if i < p - m else xs[i] for i in range(m)]
    while len(ys) > 1:
        ys = [ufunc(ys[i], ys[i + 1]) for i in range(0, len(ys), 2)]
    return ys[0]


def rank_order(xs, ufunc):
    """A left fold in rank order, whatever the nodes."""
    out = xs[0].copy()
    for x in xs[1:]:
        out = ufunc(out, x)
    return out


register(Algorithm("ring", ".ring:ring_allreduce_op", ring_order, model.ring_terms,
                   reduce_scatter=".ring:reduce_scatter_op", allgather=".ring:allgather_op"))
register(Algorithm("tree", ".tree:tree_allreduce_op", tree_order, model.tree_terms,
                   blocking=".tree:tree_allreduce_blocking"))
register(Algorithm("hier", ".hier:allreduce_op", rank_order, model.hier_terms,
                   reduce_scatter=".hier:reduce_scatter_op", allgather=".hier:allgather_op",
                   needs_group=True))
register(Algorithm("mpi", ".mpiref:mpi_allreduce_op", None, None,
                   reduce_scatter=".mpiref:mpi_reduce_scatter_op",
                   allgather=".mpiref:mpi_allgather_op", runtime=False))


__all__ = ["Algorithm", "KINDS", "check_choice", "choose", "get", "names", "rank_order",
           "reference", "register", "ring_order", "seconds", "tree_order", "unregister"]
