"""What ratrain's collectives cost: the latency-bandwidth model of each algorithm, written once.

Pure arithmetic, no MPI: each algorithm's entry in the registry (`comm.algos`) points at its
terms here, and through it the runtime's choice, the benchmark's model column and the planner's
simulator (`ratrain.plan.cost`) price what `ratrain.comm` runs. A message of n bytes costs
a + n / B (latency a, bandwidth B: the shim's link model) on the link level it crosses: inside
a node (`Links.node_*`) or through the node's network interface (`Links.net_*`); one level is
`Links.flat(a, B)` with every rank a node of its own.

Every algorithm's terms have one signature, `(op, nbytes, nodes, local, links, chunk_bytes)`
for a group of `nodes` nodes of `local` consecutive ranks, and give (fixed seconds, bytes
through each rank's intra-node link, bytes through the busiest node interface) on the
critical path: a simulator may share the two links with other flows; alone on them the
collective takes `alone(terms, links)` = fixed + max(intra / node bandwidth, interface bytes /
net bandwidth). On one level (p nodes of 1 rank), with a = net latency and B its bandwidth:

- ring all-reduce (reduce-scatter, then all-gather): 2(p-1) messages of n/p bytes,
  `2(p-1)(a + n/(pB))`; ring reduce-scatter, all-gather: `(p-1)(a + n/(pB))`;
- tree all-reduce (recursive doubling, with a fold for p not a power of two, as
  `tree.tree_allreduce_op` runs it): with m the largest power of two <= p, log2(m) exchanges
  of n bytes, plus 2 messages of n bytes (fold in, result out) when p > m:
  `(log2(m) + 2 [p > m]) (a + n/B)`.

On two levels the ring's steps each cross an interface once per node boundary (one message of
n/p per node per step), and the tree's exchange with rank r ^ d stays inside a node when the
node holds whole blocks of 2d ranks.

The hierarchical collectives (`comm.hier`) are built for the two link levels: `hier_terms`
gives, for R nodes of L ranks each, the bytes each rank moves through its intra-node link (the
fold of its lane and the copy of the other lanes: (L-1)/L n each, less for what it does not
copy), the bytes the busiest node's interface sends (all its lanes together):

    op              interface bytes
    allreduce       n (R = 2), 2n (R > 2: forward and back)
    reduce_scatter  n (forward; results straight back)
    allgather       n/2 (R = 2), (R+1)/R n (R > 2)

(0 for R = 1), and the fixed part: the data moves in rounds (one chunk per lane), each round a
pipeline of stages (a fold on each node, a hop per interface it crosses, each paying its
latency, the copy out), so alone it takes one round through every stage + (rounds - 1) x the
busiest resource's share of a round (measured through the shim's throttle, 2 nodes x 2 ranks:
0.090 s for 192 KiB against 0.097 modelled, 0.193 s for 1 MiB against 0.194).
"""

from __future__ import annotations

from dataclasses import dataclass

OPS = ("allreduce", "reduce_scatter", "allgather")
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


@dataclass(frozen=True)
class Links:
    """The two link levels' rates: a message inside a node costs node_latency + n / node_bandwidth
    (each rank its own link), one between nodes net_latency + n / net_bandwidth (the node's
    interface, shared by its ranks)."""

    node_latency: float
    node_bandwidth: float
    net_latency: float
    net_bandwidth: float

    @classmethod
    def flat(cls, latency: float, bandwidth: float) -> Links:
        """One level (every rank a node of its own: give `nodes` = p, `local` = 1)."""
        return cls(latency, bandwidth, latency, bandwidth)


HOST = Links.flat(HOST_LATENCY, HOST_BANDWIDTH)


def alone(terms: tuple[float, float, float], links: Links) -> float:
    """Seconds of a collective with these terms alone on its links."""
    fixed, intra, nic = terms
    return fixed + max(intra / links.node_bandwidth, nic / links.net_bandwidth)


def _check(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"collective {op!r} is not one of {', '.join(OPS)}")


def ring_terms(op: str, nbytes: float, nodes: int, local: int, links: Links,
               chunk_bytes: int | None = None) -> tuple[float, float, float]:
    """The ring over `nodes` nodes of `local` consecutive ranks: 2(p-1) steps for an
    all-reduce, p-1 for a reduce-scatter or an all-gather, each a message of n/p bytes from
    every rank to the next, crossing an interface at each node boundary (a step waits for the
    slower level)."""
    _check(op)
    p = nodes * local
    if p <= 1:
        return 0.0, 0.0, 0.0
    steps = (2 if op == "allreduce" else 1) * (p - 1)
    seg = 1.0 / p * nbytes
    latency = links.net_latency if nodes > 1 else links.node_latency
    return (steps * latency, steps * seg if local > 1 else 0.0,
            steps * seg if nodes > 1 else 0.0)


def tree_terms(op: str, nbytes: float, nodes: int, local: int, links: Links,
               chunk_bytes: int | None = None) -> tuple[float, float, float]:
    """Recursive doubling over `nodes` nodes of `local` consecutive ranks (all-reduce only):
    with m the largest power of two <= p, exchange d (d = 1, 2, ..., m/2) pairs rank r with
    r ^ d, messages of n bytes; for p > m a fold in and the result out (2 messages of n).
    A step crosses the interface when some rank's partner is on another node; the interface
    bytes are the first node's crossing messages."""
    _check(op)
    if op != "allreduce":
        raise ValueError(f"there is no tree {op}: the tree is an all-reduce only")
    p = nodes * local
    if p <= 1:
        return 0.0, 0.0, 0.0
    m = 1 << (p.bit_length() - 1)
    fixed = intra = nic = 0.0
    d = 1
    while d < m:
        out = sum(1 for r in range(min(local, m)) if (r ^ d) // local != r // local)
        fixed += links.net_latency if out else links.node_latency
        intra += nbytes if out < min(local, m) else 0.0
        nic += out * nbytes
        d <<= 1
    if p > m:
        out = sum(1 for r in range(min(local, p - m)) if (r + m) // local != r // local)
        fixed += 2 * (links.net_latency if out else links.node_latency)
        intra += 2 * nbytes if not out else 0.0
        nic += 2 * out * nbytes
    return fixed, intra, nic


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


def hier_terms(op: str, nbytes: float, nodes: int, local: int, links: Links,
               chunk_bytes: int | None = None) -> tuple[float, float, float]:
    """(fixed seconds, bytes each rank moves through its intra-node link, bytes the busiest node
    interface sends) of one hierarchical collective over `nodes` nodes of `local` ranks, in
    rounds of `local` chunks of `chunk_bytes` (default: `hier_chunk_bytes(nbytes, ...)`).

    A round passes through a pipeline of stages (fold on each node, a hop per interface
    crossed, the copy out); rounds overlap, so alone the collective takes the stages of one
    round plus (rounds - 1) of the busiest resource's share of a round. The fixed part is that
    pipeline's fill (one round's stages less its bottleneck: latencies included); the rest is
    bytes on the two links, which a simulator may share with other flows. Alone:
    fixed + max(intra / node_bandwidth, interface / net_bandwidth) (`alone`)."""
    _check(op)
    R, L, n = nodes, local, float(nbytes)
    if R * L <= 1 or n <= 0:
        return 0.0, 0.0, 0.0
    lanes = min(L, max(1, int(n)))
    chunk = chunk_bytes or hier_chunk_bytes(int(n), lanes, R)
    rho = min(n, lanes * chunk)
    stages, intra, nic = _hier_round(op, rho, R, L, links.node_latency, links.node_bandwidth,
                                     links.net_latency, links.net_bandwidth)
    bottleneck = max(intra / links.node_bandwidth, nic / links.net_bandwidth)
    scale = n / rho  # rounds
    return max(0.0, stages - bottleneck), intra * scale, nic * scale


__all__ = ["HIER_DEPTH", "HIER_DEPTH_NET", "HIER_MAX_CHUNK", "HIER_MAX_CHUNK_NET", "HOST",
           "HOST_BANDWIDTH", "HOST_LATENCY", "Links", "OPS", "alone", "hier_chunk_bytes",
           "hier_depth", "hier_terms", "ring_terms", "runs_of", "tree_terms"]
