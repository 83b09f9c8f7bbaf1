"""What ratrain's collectives cost: the latency-bandwidth model of each algorithm, written once.

Pure arithmetic, no MPI: the runtime's `auto` choice (`collectives.choose_algo`), the benchmark's
model column and the planner's simulator (`ratrain.plan.cost`) all price the algorithms that
`ratrain.comm.collectives` runs, with these formulas. A message of n bytes costs a + n / B
(latency a, bandwidth B: the shim's link model); p ranks take part.

- ring all-reduce (reduce-scatter, then all-gather): 2(p-1) messages of n/p bytes each,
  `2(p-1)(a + n/(pB))`;
- ring reduce-scatter, ring all-gather: (p-1) messages of n/p bytes, `(p-1)(a + n/(pB))`;
- tree all-reduce (recursive doubling, with a fold for p not a power of two, as
  `collectives.tree_allreduce_op` runs it): with m the largest power of two <= p, log2(m)
  exchanges of n bytes, plus 2 messages of n bytes (fold in, result out) when p > m:
  `(log2(m) + 2 [p > m]) (a + n/B)`.

`terms` splits a collective into (latency seconds, bytes this rank puts on its link), for a
simulator that shares a link between flows; alone on the link the time is
latency + bytes / B.
"""

from __future__ import annotations

OPS = ("allreduce", "reduce_scatter", "allgather")
ALGOS = ("ring", "tree")

# The host's MPI when no link is modelled (measured here: 2 cores, Open MPI 5 shared memory,
# 4 ranks): ~20 us per message, ~2 GB/s per stream. Only `auto`'s choice uses them.
HOST_LATENCY = 20e-6
HOST_BANDWIDTH = 2e9


def messages(op: str, algo: str, p: int) -> tuple[int, float]:
    """(messages on the critical path, bytes of each as a fraction of the buffer's n)."""
    if op not in OPS:
        raise ValueError(f"collective {op!r} is not one of {', '.join(OPS)}")
    if algo not in ALGOS:
        raise ValueError(f"algorithm {algo!r} is not one of {', '.join(ALGOS)}")
    if p <= 1:
        return 0, 0.0
    if algo == "ring":
        return (2 if op == "allreduce" else 1) * (p - 1), 1.0 / p
    if op != "allreduce":
        raise ValueError(f"there is no tree {op}: ratrain's reduce-scatter and all-gather are rings")
    m = 1 << (p.bit_length() - 1)
    return (m.bit_length() - 1) + (2 if p > m else 0), 1.0


def terms(op: str, algo: str, nbytes: float, p: int, latency: float) -> tuple[float, float]:
    """(latency part in s, bytes this rank puts on its link) of one collective."""
    n, frac = messages(op, algo, p)
    return n * latency, n * frac * nbytes


def seconds(op: str, algo: str, nbytes: float, p: int, latency: float, bandwidth: float) -> float:
    """Seconds of one collective alone on the link."""
    lat, wire = terms(op, algo, nbytes, p, latency)
    return lat + wire / bandwidth


def cheapest(nbytes: float, p: int, latency: float = HOST_LATENCY,
             bandwidth: float = HOST_BANDWIDTH) -> str:
    """`ring` or `tree`, whichever all-reduce the model says is faster (ties: tree). Depends only
    on its arguments, so every rank and every run choose the same."""
    ring = seconds("allreduce", "ring", nbytes, p, latency, bandwidth)
    tree = seconds("allreduce", "tree", nbytes, p, latency, bandwidth)
    return "tree" if tree <= ring else "ring"


__all__ = ["ALGOS", "HOST_BANDWIDTH", "HOST_LATENCY", "OPS", "cheapest", "messages", "seconds",
           "terms"]
