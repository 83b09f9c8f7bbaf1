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

The hierarchical collectives (`comm.hier`) cross two tiers: `hier_terms` gives, for R nodes of
L ranks each, the bytes each rank moves through its intra-node link (the fold of its lane and
the copy of the other lanes: (L-1)/L n each, less for what it does not copy), the bytes the
busiest node's interface sends (all its lanes together):

    op              interface bytes
    allreduce       n (R = 2), 2n (R > 2: forward and back)
    reduce_scatter  n (forward; results straight back)
    allgather       n/2 (R = 2), (R+1)/R n (R > 2)

(0 for R = 1), and the fixed part: the data moves in rounds (one chunk per lane), each round a
pipeline of stages (a fold on each node, a hop per interface it crosses, each paying its
latency, the copy out), so alone `hier_seconds` = one round through every stage + (rounds - 1)
x the busiest resource's share of a round (measured through the shim's throttle, 2 nodes x 2
ranks: 0.090 s for 192 KiB against 0.097 modelled, 0.193 s for 1 MiB against 0.194).
"""

from __future__ import annotations

OPS = ("allreduce", "reduce_scatter", "allgather")
ALGOS = ("ring", "tree")
# A lane's chunk of one round of the hierarchical collectives: at most 4 MiB inside one node
# (fewer rounds, fewer hand-overs between ranks: measured here, 64 MiB on 4 ranks, 4 MiB chunks
# 1.43 GB/s bus bandwidth, 1 MiB 1.33, 256 KiB 1.26), at most 256 KiB across nodes (a round of
# every lane crosses the interface before the pipeline is full: the fill, 1 MiB for 4 lanes,
# 8 ms at 1 Gbit/s).
HIER_MAX_CHUNK = 4 << 20
HIER_MAX_CHUNK_NET = 256 << 10
HIER_MIN_CHUNK = 4096
HIER_DEPTH = 3  # rounds in flight inside one node
HIER_DEPTH_NET = 6  # across nodes: more rounds in flight keep the network busy while a rank
# waits for its core (measured here, 2 nodes x 4 ranks on 2 cores, 16 MiB: depth 6 102 MB/s
# through the 1 Gbit/s interface, depth 3 89 MB/s)


def hier_depth(nodes: int) -> int:
    """Rounds in flight of the hierarchical collectives of a group on `nodes` nodes."""
    return HIER_DEPTH if nodes <= 1 else HIER_DEPTH_NET

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


def runs_of(nodes) -> list[tuple[int, int]]:
    """The runs of a group whose member q is on node `nodes[q]`: the maximal ranges [a, b) of
    consecutive members on one node (`hier.NodeGroup`; R runs of L members above)."""
    runs, a = [], 0
    for q in range(1, len(nodes) + 1):
        if q == len(nodes) or nodes[q] != nodes[a]:
            runs.append((a, q))
            a = q
    return runs


def hier_chunk_bytes(nbytes: int, lanes: int, nodes: int = 1) -> int:
    """The chunk of one lane and round for buffers of up to `nbytes` on `nodes` nodes: a power
    of two, so that a buffer of that size takes about `hier_depth` rounds, between 4 KiB and
    4 MiB (256 KiB when the group spans nodes)."""
    want = max(1, -(-int(nbytes) // (lanes * hier_depth(nodes))))
    cap = HIER_MAX_CHUNK if nodes <= 1 else HIER_MAX_CHUNK_NET
    return max(HIER_MIN_CHUNK, min(cap, 1 << (want - 1).bit_length()))


def _hier_round(op: str, rho: float, R: int, L: int, a_i: float, b_i: float, a_n: float,
                b_n: float) -> tuple[float, float, float]:
    """One round of `rho` bytes (every lane's chunk of a node): (seconds it takes through every
    stage alone, bytes it puts on a rank's intra-node link, bytes through the busiest
    interface)."""
    share = (L - 1) / L
    t_i = (lambda nb: a_i + nb / b_i) if L > 1 else (lambda nb: 0.0)  # noqa: E731
    hop = a_n + rho / b_n  # a round crosses an interface (every lane of the node at once)
    own = share * rho / (R * L)  # this member's segment of a round (reduce-scatter's copy out)
    if op == "allreduce":  # fold on every node, forward and back, copy out
        return (R * t_i(share * rho) + 2 * (R - 1) * hop + t_i(share * rho), 2 * share * rho,
                (0, 0, 1, 2)[min(R, 3)] * rho)
    if op == "reduce_scatter":  # fold forward, results straight back, own segment out
        back = a_n + rho * (R - 1) / R / b_n if R > 1 else 0.0
        return (R * t_i(share * rho) + (R - 1) * hop + back + t_i(own), share * rho + own,
                rho if R > 1 else 0.0)
    nic = 0.0 if R == 1 else rho / 2 if R == 2 else (R + 1) / R * rho
    return t_i(own) + (R - 1) * hop + t_i(share * rho), share * rho + own, nic


def hier_terms(op: str, nbytes: float, nodes: int, local: int, node_latency: float,
               node_bandwidth: float, net_latency: float, net_bandwidth: float,
               chunk_bytes: int | None = None) -> tuple[float, float, float]:
    """(fixed seconds, bytes each rank moves through its intra-node link, bytes the busiest node
    interface sends) of one hierarchical collective over `nodes` nodes of `local` ranks, in
    rounds of `local` chunks of `chunk_bytes` (default: `hier_chunk_bytes(nbytes, ...)`).

    A round passes through a pipeline of stages (fold on each node, a hop per interface
    crossed, the copy out); rounds overlap, so alone the collective takes the stages of one
    round plus (rounds - 1) of the busiest resource's share of a round. The fixed part is that
    pipeline's fill (one round's stages less its bottleneck: latencies included); the rest is
    bytes on the two links, which a simulator may share with other flows. Alone:
    fixed + max(intra / node_bandwidth, interface / net_bandwidth) (`hier_seconds`)."""
    if op not in OPS:
        raise ValueError(f"collective {op!r} is not one of {', '.join(OPS)}")
    R, L, n = nodes, local, float(nbytes)
    if R * L <= 1 or n <= 0:
        return 0.0, 0.0, 0.0
    lanes = min(L, max(1, int(n)))
    chunk = chunk_bytes or hier_chunk_bytes(int(n), lanes, R)
    rho = min(n, lanes * chunk)
    stages, intra, nic = _hier_round(op, rho, R, L, node_latency, node_bandwidth, net_latency,
                                     net_bandwidth)
    bottleneck = max(intra / node_bandwidth, nic / net_bandwidth)
    scale = n / rho  # rounds
    return max(0.0, stages - bottleneck), intra * scale, nic * scale


def hier_seconds(op: str, nbytes: float, nodes: int, local: int, node_latency: float,
                 node_bandwidth: float, net_latency: float, net_bandwidth: float,
                 chunk_bytes: int | None = None) -> float:
    """Seconds of one hierarchical collective alone on its links (`hier_terms`)."""
    fixed, intra, nic = hier_terms(op, nbytes, nodes, local, node_latency, node_bandwidth,
                                   net_latency, net_bandwidth, chunk_bytes)
    return fixed + max(intra / node_bandwidth, nic / net_bandwidth)


__all__ = ["ALGOS", "HIER_DEPTH", "HIER_DEPTH_NET", "HIER_MAX_CHUNK", "HIER_MAX_CHUNK_NET",
           "HOST_BANDWIDTH", "HOST_LATENCY", "OPS", "cheapest", "hier_chunk_bytes", "hier_depth",
           "hier_seconds", "hier_terms", "messages", "runs_of", "seconds", "terms"]
