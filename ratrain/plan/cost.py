"""The cost model: what each action of a step costs on the platform, in seconds.

Everything here is a closed-form function of the model shape, the layout and a few platform
rates (`Rates`), each carrying its source:

- compute: a block's forward / backward time is its flops (`exec.spec.block_flops`: forward a
  third of the block's training flops, backward two thirds plus what its recompute choice
  re-runs; the same figure the shim's pacing uses) over `compute_flops` (one rank's sustained
  rate on this model's kernels);
- nodes: `ranks_per_node` consecutive ranks share a node (the platform's packing) and its
  network interface (`link_bandwidth`, shared); ranks of one node talk over their intra-node
  links (`intra_bandwidth`, each rank its own); `placement` (pp | dp) lays the grid on the
  ranks as the runtime does (`comm.topology.grid`), and `NodeLayout` says, for one replica's
  stages, which node each sits on, how many of the node's ranks are the same stage (copies
  whose traffic shares the interface), and how many nodes and ranks per node each stage's
  data-parallel group spans;
- point-to-point: one message of n bytes costs `latency + n / bandwidth` on the link level it
  crosses (the shim's link model);
- collectives across the data-parallel replicas: the algorithm the runtime runs, chosen by the
  registry's rule (`comm.algos.choose`, with `comm.allreduce`: `hier` unless another is
  configured), priced by its terms (`comm.model`: fixed seconds, bytes through each rank's
  intra-node link, bytes through the busiest interface); the flat formulas (`allreduce_terms`,
  one rank per node) stay for comparisons;
- memory-bound lifecycle work: an AdamW update moves `exec.optim.ADAMW_BYTES_PER_PARAM` bytes
  per parameter, a view cast `exec.params.view_cast_bytes_per_param`, both at `mem_bandwidth`
  (the shim paces them the same way under emulation, at the profile's DDR bandwidth).

`ratrain.plan.calibrate` fits the compute rate to a measured run, so that the simulator then
predicts other layouts and scales from it.

    cost = CostModel.from_config(cfg)            # profile from cfg.platform (mt3000, host, ...)
    cost.forward_time("layer"), cost.allreduce_time(4 * n, 64), cost.p2p_time(cost.activation_bytes)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ratrain.comm import algos
from ratrain.comm import model as comm_model
from ratrain.comm.topology import grid
from ratrain.config import Config, ModelConfig, act_itemsize
from ratrain.exec.optim import ADAMW_BYTES_PER_PARAM
from ratrain.lifecycle.passes.partial import AVERAGE_BYTES_PER_PARAM
from ratrain.exec.params import shard_size, view_cast_bytes_per_param
from ratrain.exec.spec import block_flops, block_params, block_role
from ratrain.exec.layers import layer_cache_nbytes
from ratrain.shim.platform import resolve_platform

# The DDR bandwidth when the profile has no `ddr_bandwidth` fact (mt3000 has; this is its value).
DEFAULT_MEM_BANDWIDTH = 25.6e9


@dataclass(frozen=True)
class Rates:
    """One rank's platform rates (per cluster) with their sources."""

    compute_flops: float  # sustained flop/s on model kernels
    link_bandwidth: float  # bytes/s of a node's network interface (shared by its ranks)
    link_latency: float  # s per message across nodes
    mem_bandwidth: float = DEFAULT_MEM_BANDWIDTH  # bytes/s, DDR
    sources: tuple[tuple[str, str], ...] = ()
    intra_bandwidth: float = math.inf  # bytes/s between two ranks of one node
    intra_latency: float = 0.0  # s per message inside a node
    ranks_per_node: int = 1  # ranks (clusters) per node, sharing its interface
    tier_bandwidth: float = math.inf  # bytes/s of a node's memory tier (offload), shared
    tier_latency: float = 0.0  # s per transfer to or from it
    tier_bytes: float | None = None  # its capacity per node (None: not capped)

    def __post_init__(self):
        for k in ("compute_flops", "link_bandwidth", "mem_bandwidth", "intra_bandwidth",
                  "tier_bandwidth"):
            if not getattr(self, k) or getattr(self, k) <= 0:
                raise ValueError(f"Rates.{k}={getattr(self, k)!r} must be > 0")
        for k in ("link_latency", "intra_latency", "tier_latency"):
            if getattr(self, k) < 0:
                raise ValueError(f"Rates.{k}={getattr(self, k)!r} must be >= 0")
        if self.ranks_per_node != int(self.ranks_per_node) or self.ranks_per_node < 1:
            raise ValueError(f"Rates.ranks_per_node={self.ranks_per_node!r} must be a positive "
                             "integer")

    def source(self, key: str) -> str:
        return dict(self.sources).get(key, "")

    def with_(self, key: str, value: float, source: str) -> Rates:
        """A copy with one rate replaced and its source recorded."""
        src = dict(self.sources)
        src[key] = source
        value = int(value) if key == "ranks_per_node" else float(value)
        return replace(self, **{key: value}, sources=tuple(src.items()))

    @classmethod
    def from_profile(cls, profile, mem_bandwidth: float | None = None) -> Rates:
        """From a `ratrain.shim.platform.Profile`; a value it does not model is an error (the
        planner needs every rate: use the `mt3000` profile or set platform.* in the config)."""
        missing = [
            k
            for k in ("compute_flops", "link_bandwidth", "link_latency")
            if getattr(profile, k) is None
        ]
        if missing:
            raise ValueError(
                f"platform profile {profile.name!r} does not model {', '.join(missing)}: the "
                "planner needs them; use platform.profile=mt3000 or set platform.<key>"
            )
        fact = profile.fact("ddr_bandwidth")
        if mem_bandwidth:
            mb, mb_source = mem_bandwidth, "given"
        elif fact is not None and fact.value:
            mb, mb_source = fact.value, f"profile {profile.name}: {fact.source}"
        else:
            mb, mb_source = DEFAULT_MEM_BANDWIDTH, "assumed: one DDR4-3200 channel, 25.6e9 B/s"
        intra, tier = profile.intra_bandwidth, profile.tier
        tier_sources = (tuple((f"tier_{k}", f"tier {tier.name}: {tier.source(k)}")
                              for k in ("bandwidth", "latency", "bytes"))
                        if tier is not None else ())
        return cls(
            compute_flops=float(profile.compute_flops),
            link_bandwidth=float(profile.link_bandwidth),
            link_latency=float(profile.link_latency),
            mem_bandwidth=float(mb),
            sources=(
                ("compute_flops", profile.source("compute_flops")),
                ("link_bandwidth", profile.source("link_bandwidth")),
                ("link_latency", profile.source("link_latency")),
                ("mem_bandwidth", mb_source),
                ("intra_bandwidth", profile.source("intra_bandwidth")),
                ("intra_latency", profile.source("intra_latency")),
                ("ranks_per_node", profile.source("ranks_per_node")),
            ) + tier_sources,
            intra_bandwidth=float(intra) if intra else math.inf,
            intra_latency=float(profile.intra_latency or 0.0),
            ranks_per_node=int(profile.ranks_per_node or 1),
            tier_bandwidth=float(tier.bandwidth) if tier is not None and tier.bandwidth
            else math.inf,
            tier_latency=float(tier.latency or 0.0) if tier is not None else 0.0,
            tier_bytes=float(tier.bytes) if tier is not None and tier.bytes else None,
        )

    @classmethod
    def from_config(cls, cfg: Config, mem_bandwidth: float | None = None) -> Rates:
        """The profile named by `cfg.platform`, with the config's overrides."""
        return cls.from_profile(resolve_platform(cfg.platform), mem_bandwidth)


# --------------------------------------------------------------------------------------------
# Messages and collectives
# --------------------------------------------------------------------------------------------


def p2p_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """One message: latency + n / B."""
    return latency + nbytes / bandwidth


def allreduce_terms(nbytes: float, p: int, algo: str, bandwidth: float, latency: float,
                    op: str = "allreduce"):
    """(latency part in s, bytes this rank puts on its link) of one all-reduce (or `op`) over p
    ranks of one node each, for a simulator that shares a link between flows: time alone =
    latency part + wire bytes / B. `auto`: the registry's rule for a bare communicator (the
    cheapest; `comm.algos.choose`)."""
    name = algos.choose(op, nbytes, p, grouped=False, configured=algo, latency=latency,
                        bandwidth=bandwidth)
    fixed, _, wire = algos.get(name).terms(op, nbytes, p, 1,
                                           comm_model.Links.flat(latency, bandwidth))
    return fixed, wire


@dataclass(frozen=True)
class NodeLayout:
    """Where the stages of replica 0 sit when `ranks_per_node` consecutive world ranks share a
    node (the grid laid out by `placement`, as `comm.topology.grid` lays it). Replicas are
    alike, so the simulator plays replica 0 and scales the interface's traffic by `copies`."""

    pp: int
    dp: int
    placement: str = "pp"
    ranks_per_node: int = 1
    node: tuple[int, ...] = field(init=False)  # per stage: its node
    copies: tuple[int, ...] = field(init=False)  # per stage: ranks of that stage on its node
    runs: tuple[tuple[int, int], ...] = field(init=False)  # per stage: (nodes, ranks per node)

    def __post_init__(self):
        g, k = grid(self.pp, self.dp, self.placement), self.ranks_per_node
        node = tuple(int(g[0, s]) // k for s in range(self.pp))
        copies, runs = [], []
        for s in range(self.pp):
            members = [int(g[r, s]) // k for r in range(self.dp)]
            copies.append(members.count(node[s]))
            rs = comm_model.runs_of(members)
            runs.append((len(rs), min(b - a for a, b in rs)))
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "copies", tuple(copies))
        object.__setattr__(self, "runs", tuple(runs))

    @property
    def world_runs(self) -> tuple[int, int]:
        """(nodes, ranks per node) of the whole world (the step's global facts)."""
        world, k = self.pp * self.dp, self.ranks_per_node
        return -(-world // k), min(k, world)

    def same_node(self, s: int, t: int) -> bool:
        return self.node[s] == self.node[t]

    def groups(self, groups) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(node, copies) of the simulator's ranks when replicas come in `groups` (tuples of
        replicas alike, each played by its first): for rank `g * pp + s`, the node of group g's
        first replica's stage s, and how many of the group's stage-s ranks share that node. One
        group of every replica gives `node` and `copies`."""
        g, k = grid(self.pp, self.dp, self.placement), self.ranks_per_node
        node, copies = [], []
        for reps in groups:
            for s in range(self.pp):
                mine = int(g[reps[0], s]) // k
                node.append(mine)
                copies.append(sum(1 for q in reps if int(g[q, s]) // k == mine))
        return tuple(node), tuple(copies)


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Times of one rank's actions for one model, micro-batch size and precision.

    All compute figures are per micro-batch (`micro_batch * seq_len` tokens).
    """

    model: ModelConfig
    rates: Rates
    micro_batch: int = 1
    precision: str = "fp16"
    algo: str = "auto"  # the all-reduce algorithm: comm.allreduce (auto: the registry's rule)
    placement: str = "pp"  # parallel.placement

    @classmethod
    def from_config(cls, cfg: Config, rates: Rates | None = None,
                    algo: str | None = None) -> CostModel:
        algos.check_choice(algo or cfg.comm.allreduce)  # one the runtime could run
        return cls(
            cfg.model,
            rates or Rates.from_config(cfg),
            cfg.parallel.micro_batch,
            cfg.precision,
            algo or cfg.comm.allreduce,
            cfg.parallel.placement,
        )

    def nodes(self, pp: int, dp: int) -> NodeLayout:
        """The node layout of a pp x dp grid under this model's placement and ranks per node."""
        return NodeLayout(pp, dp, self.placement, self.rates.ranks_per_node)

    def with_rates(self, rates: Rates) -> CostModel:
        return replace(self, rates=rates)

    # -- sizes --------------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.micro_batch * self.model.seq_len

    @property
    def act_dtype_bytes(self) -> int:
        return act_itemsize(self.precision)

    @property
    def activation_bytes(self) -> int:
        """Bytes of one micro-batch's activation (or its gradient) crossing a stage boundary."""
        return self.tokens * self.model.hidden * self.act_dtype_bytes

    def block_params(self, role: str) -> int:
        """Parameters of one block of `role` ("embed" | "layer" | "head")."""
        return block_params(self.model, role)

    def grad_bytes(self, role: str) -> int:
        """fp32 gradient bytes of one block (what its all-reduce moves)."""
        return 4 * self.block_params(role)

    def offload_bytes(self, role: str) -> int:
        """Bytes a layer's saved activations of one micro-batch move to and from the memory
        tier: its cache as the kernels keep it without recomputation
        (`exec.layers.layer_cache_nbytes`; the memory model's estimate of what a layer keeps,
        `lifecycle.memory.layer_activation_bytes`, counts a few more, conservatively); 0 for
        the other blocks."""
        if role != "layer":
            return 0
        return layer_cache_nbytes(self.model, self.micro_batch, self.precision, "none")

    # -- compute --------------------------------------------------------------------------------

    def _compute_time(self, role: str, phase: str, recompute: str = "none") -> float:
        if role == "embed":  # a gather: memory-bound
            return self.tokens * self.model.hidden * self.act_dtype_bytes / self.rates.mem_bandwidth
        flops = block_flops(self.model, role, self.tokens, phase, recompute)
        return flops / self.rates.compute_flops

    def forward_time(self, role: str) -> float:
        return self._compute_time(role, "forward")

    def backward_time(self, role: str, recompute: str = "none") -> float:
        """Backward of one block, including the recomputation `recompute` implies."""
        return self._compute_time(role, "backward", recompute)

    # -- communication ----------------------------------------------------------------------------

    def p2p_time(self, nbytes: float | None = None, same_node: bool = False) -> float:
        """One activation (default) or any message between neighbouring stages, alone on the
        link level it crosses (inside a node, or through the interface)."""
        n = self.activation_bytes if nbytes is None else nbytes
        r = self.rates
        if same_node:
            return p2p_time(n, r.intra_bandwidth, r.intra_latency)
        return p2p_time(n, r.link_bandwidth, r.link_latency)

    @property
    def links(self) -> comm_model.Links:
        """The two link levels' rates (inside a node, through the node's interface)."""
        r = self.rates
        return comm_model.Links(r.intra_latency, r.intra_bandwidth, r.link_latency,
                                r.link_bandwidth)

    def collective_terms(self, op: str, nbytes: float, nodes: int, local: int,
                         chunk_bytes: int | None = None):
        """(fixed s, bytes through each rank's intra-node link, bytes through the busiest
        interface) of the runtime's `op` over a data-parallel group of `nodes` nodes of `local`
        ranks: the algorithm the runtime chooses for it (`comm.algos.choose` for a group by
        node: hier, unless `algo` names another all-reduce), in rounds of `chunk_bytes` per
        lane (hier's)."""
        name = algos.choose(op, nbytes, nodes * local, grouped=True, configured=self.algo)
        return algos.get(name).terms(op, nbytes, nodes, local, self.links, chunk_bytes)

    def collective_time(self, op: str, nbytes: float, nodes: int, local: int,
                        chunk_bytes: int | None = None) -> float:
        """The runtime's `op` alone on its links (`collective_terms`, `comm.model.alone`)."""
        return comm_model.alone(self.collective_terms(op, nbytes, nodes, local, chunk_bytes),
                                self.links)

    def staging_chunk(self, blocks, nodes: int, local: int) -> int:
        """The chunk the runtime's data-parallel group uses for a stage of `blocks`: sized for
        its largest gradient (`runtime.rank` sizes the topology's window so)."""
        largest = max((self.grad_bytes(block_role(b)) for b in blocks), default=0)
        return comm_model.hier_chunk_bytes(int(largest), min(local, max(1, int(largest))),
                                           nodes)

    def allreduce_time(self, nbytes: float, p: int, algo: str | None = None) -> float:
        """One all-reduce of `nbytes` across `p` ranks, alone on the link."""
        lat, wire = self.allreduce_terms(nbytes, p, algo)
        return lat + wire / self.rates.link_bandwidth

    def allreduce_terms(self, nbytes: float, p: int, algo: str | None = None):
        return allreduce_terms(
            nbytes, p, algo or self.algo, self.rates.link_bandwidth, self.rates.link_latency
        )

    def ring_half_terms(self, nbytes: float, p: int):
        """(latency part, wire bytes) of one ring reduce-scatter or all-gather of `nbytes`
        across `p` ranks: (p-1) a and (p-1) n / p (half a ring all-reduce)."""
        return allreduce_terms(nbytes, p, "ring", self.rates.link_bandwidth,
                               self.rates.link_latency, op="reduce_scatter")

    # -- memory-bound lifecycle work ---------------------------------------------------------------

    def update_time(self, role: str, shards: int = 1) -> float:
        """AdamW of one block (fp32 masters and moments), or of this replica's segment of it
        (the largest, ceil(n / shards)) when the optimizer state is sharded."""
        n = shard_size(self.block_params(role), shards)
        return ADAMW_BYTES_PER_PARAM * n / self.rates.mem_bandwidth

    def average_time(self, role: str) -> float:
        """Partial synchronization: divide one block's summed fp32 master by dp (its
        `WaitAverage`)."""
        return AVERAGE_BYTES_PER_PARAM * self.block_params(role) / self.rates.mem_bandwidth

    def view_time(self, role: str, shards: int = 1) -> float:
        """Materialise one block's working view (0 when the view is the master), or cast this
        replica's segment of it when sharded (the rest arrives by all-gather)."""
        n = shard_size(self.block_params(role), shards)
        return view_cast_bytes_per_param(self.precision, shards) * n / self.rates.mem_bandwidth

    def view_bytes(self, role: str) -> int:
        """Bytes of one block's working view (16-bit, or the fp32 copy when sharded in fp32):
        what the sharded view all-gather assembles."""
        return act_itemsize(self.precision) * self.block_params(role)


__all__ = [
    "CostModel",
    "DEFAULT_MEM_BANDWIDTH",
    "NodeLayout",
    "Rates",
    "allreduce_terms",
    "p2p_time",
]
