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
L ranks each, the latency part, the bytes each rank moves through its intra-node link (the
fold of its lane and the copy of the other lanes: (L-1)/L n each, less for what it does not
copy) and the bytes the busiest node's interface sends (all its lanes together):

    op              interface bytes                         latencies
    allreduce       n (R = 2), 2n (R > 2: forward and back)  2(R-1) a_net + 2 a_node
    reduce_scatter  n (forward; results straight back)       R a_net + 2 a_node
    allgather       n/2 (R = 2), (R+1)/R n (R > 2)           (R-1) a_net + 2 a_node

(0 interface bytes for R = 1; no a_node for L = 1). Rounds of one chunk per lane overlap the
tiers, so alone `hier_seconds` = latency + max(intra / B_node, interface / B_net) + the
pipeline's fill (the rounds a last chunk still travels once the busiest interface is done).
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


def hier_terms(op: str, nbytes: float, nodes: int, local: int, node_latency: float,
               net_latency: float) -> tuple[float, float, float]:
    """(latency part in s, bytes each rank moves through its intra-node link, bytes the busiest
    node interface sends) of one hierarchical collective over `nodes` nodes of `local` ranks."""
    if op not in OPS:
        raise ValueError(f"collective {op!r} is not one of {', '.join(OPS)}")
    R, L, n = nodes, local, float(nbytes)
    if R * L <= 1:
        return 0.0, 0.0, 0.0
    share = (L - 1) / L
    lat = 2 * node_latency if L > 1 else 0.0
    if op == "allreduce":
        intra, nic = 2 * share * n, (0.0 if R == 1 else n if R == 2 else 2 * n)
        lat += 2 * (R - 1) * net_latency
    elif op == "reduce_scatter":
        intra, nic = share * n * (1 + 1 / (R * L)), (0.0 if R == 1 else n)
        lat += (R if R > 1 else 0) * net_latency
    else:
        intra, nic = share * n * (1 + 1 / (R * L)), (0.0 if R == 1 else n / 2 if R == 2
                                                     else (R + 1) / R * n)
        lat += (R - 1) * net_latency
    return lat, intra, nic


def hier_fill_rounds(op: str, nodes: int) -> int:
    """Rounds a last chunk still travels after the busiest interface has sent its bytes."""
    if nodes <= 1:
        return 0
    return {"allreduce": 2 * nodes - 3, "reduce_scatter": nodes - 1,
            "allgather": nodes - 2}[op]


def hier_seconds(op: str, nbytes: float, nodes: int, local: int, node_latency: float,
                 node_bandwidth: float, net_latency: float, net_bandwidth: float) -> float:
    """Seconds of one hierarchical collective alone on its links (see the module)."""
    lat, intra, nic = hier_terms(op, nbytes, nodes, local, node_latency, net_latency)
    lanes = min(local, max(1, int(nbytes)))
    round_bytes = min(float(nbytes), lanes * hier_chunk_bytes(nbytes, lanes, nodes))
    fill = hier_fill_rounds(op, nodes) * round_bytes / net_bandwidth
    return lat + max(intra / node_bandwidth, nic / net_bandwidth) + fill


__all__ = ["ALGOS", "HIER_DEPTH", "HIER_DEPTH_NET", "HIER_MAX_CHUNK", "HIER_MAX_CHUNK_NET", "HOST_BANDWIDTH", "HOST_LATENCY", "OPS",
           "cheapest", "hier_chunk_bytes", "hier_depth", "hier_fill_rounds", "hier_seconds", "hier_terms",
           "messages", "runs_of", "seconds", "terms"]
