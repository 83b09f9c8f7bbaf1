"""The search: which pp x dp layout, micro-batch size and recomputation train a model fastest on
a given number of clusters without any rank going over its DDR cap.

For each candidate layout (pp, dp = clusters // pp, micro_batch, num_micro_batches chosen to keep
the global batch, and placement: which grid axis stays inside a node), each policy's action lists give each stage's peak memory
(`ratrain.plan.memory`); the recomputation is the cheapest that fits: none, else `selective`
(all layers) and `auto` (the fewest layers fully recomputed, per stage) are both tried. The
fitting candidates are simulated (`ratrain.plan.simulate`) and ranked by tokens/s.

The search plays hundreds of layouts, so their `PipelinePlan`s are made unvalidated: the
validator (`lifecycle.validate`) checks the order of actions, which the sizes only touch
through Megatron's buckets; the tests validate every policy, and each run validates its own
plan at start-up.

    plans = search(cfg, clusters=1024)                   # {policy: [Plan, ...] best first}
    rows = scaling(cfg, plans["ratrain"][0].layout, "ratrain", [64, 128, 256, 512, 1024])
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ratrain.config import Config, global_batch
from ratrain.exec.params import STATE_BYTES_PER_PARAM, shard_size
from ratrain.exec.spec import block_params, block_role
from ratrain.lifecycle.pipeline import PipelinePlan, resolve_policy
from ratrain.plan.cost import CostModel
from ratrain.plan.memory import fit_recompute, stage_peaks
from ratrain.plan.simulate import SimResult, simulate
from ratrain.plan.steps import recompute_for
from ratrain.shim.platform import resolve_platform

POLICY_NAMES = ("baseline-1f1b", "megatron-1f1b", "ratrain")
SCALING_CLUSTERS = (64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Layout:
    """One way to lay a model out: pipeline x data parallel, batch split, recomputation."""

    pp: int
    dp: int
    micro_batch: int
    num_micro_batches: int
    recompute: str = "none"  # none | selective | full | auto
    recompute_layers: tuple[int, ...] | None = None  # auto: fully recomputed layers per stage
    placement: str = "pp"  # parallel.placement: pp | dp (which axis stays inside a node)
    offload: str = "off"  # offload.activations (the memory tier: `plan.tierplan`)
    offload_layers: tuple[int, ...] | None = None  # ... offloaded layers per stage
    offload_state: str = "off"  # offload.optimizer

    @property
    def clusters(self) -> int:
        return self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return global_batch(self.micro_batch, self.num_micro_batches, self.dp)

    def describe(self, layers: int) -> str:
        if self.offload_layers is not None:
            full = sum(self.recompute_layers or ())
            return f"{full} full, {sum(self.offload_layers)} offload /{layers}"
        if self.recompute == "auto" and self.recompute_layers is not None:
            return f"auto: {sum(self.recompute_layers)}/{layers} full"
        if self.recompute in ("selective", "full"):
            return f"{self.recompute}: {layers}/{layers}"
        return f"none: 0/{layers}"


@dataclass
class Plan:
    """A layout under one policy: the simulated step and the memory against the cap."""

    layout: Layout
    policy: str
    result: SimResult | None
    peaks: tuple[int, ...]  # per stage
    cap: int | None
    tier_peaks: tuple[int, ...] = ()  # per stage: bytes in the memory tier (`plan.tierplan`)

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks)

    @property
    def fits(self) -> bool:
        return self.cap is None or self.peak_bytes <= self.cap

    @property
    def step_s(self) -> float:
        return self.result.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.result.tokens_per_s


def cap_bytes(cfg: Config) -> int | None:
    """The DDR cap of `cfg`'s platform (config override, else the profile's)."""
    return resolve_platform(cfg.platform).ddr_bytes


def candidate_pps(layers: int, clusters: int, extra=()) -> list[int]:
    """Pipeline depths worth trying: divisors of the cluster count and of the layer count (so
    stages split evenly or no cluster idles), and any given, up to one layer per stage."""
    pps = {d for d in range(1, layers + 1) if clusters % d == 0 or layers % d == 0}
    pps |= {p for p in extra if 1 <= p <= min(layers, clusters)}
    return sorted(p for p in pps if p <= clusters)


def candidate_layouts(cfg: Config, clusters: int, global_batch: int | None = None,
                      micro_batches=(1, 2), pps=None, placements=None) -> list[Layout]:
    """(pp, dp, micro_batch, num_micro_batches, placement) keeping the global batch (sequences;
    default the config's) as nearly as the layout allows; recomputation is decided later.
    `placements`: default the config's."""
    g = global_batch or cfg.parallel.global_batch
    out = []
    for pp in pps or candidate_pps(cfg.model.layers, clusters, (cfg.parallel.pp,)):
        dp = clusters // pp
        if dp < 1:
            continue
        for mb in micro_batches:
            m = max(1, round(g / (mb * dp)))
            for pl in placements or (cfg.parallel.placement,):
                out.append(Layout(pp, dp, mb, m, placement=pl))
    return out


def _static_lower_bound(cfg: Config, blocks, shards: int = 1) -> int:
    """The bytes a stage holds whatever the schedule (masters and moments, this replica's
    segment of them when sharded): a quick reject."""
    return max(sum(STATE_BYTES_PER_PARAM * shard_size(block_params(cfg.model, block_role(b)),
                                                      shards) for b in names)
               for names in blocks)


def plan_layout(cfg: Config, layout: Layout, policy: str, cost: CostModel | None = None,
                cap: int | None = None, recompute=("none", "selective", "auto"), steps: int = 2,
                send_mode: str = "eager") -> list[Plan]:
    """The plans of one layout under one policy, one per recompute mode that fits (the first
    that fits only, when it is `none`); a single non-fitting plan (result None, its least
    peak) when none fits."""
    m = cfg.model
    cost = cost or CostModel.from_config(cfg)
    cost = replace(cost, micro_batch=layout.micro_batch, precision=cfg.precision,
                   placement=layout.placement)
    pol = resolve_policy(cfg.schedule, policy)  # the preset with the config's component keys
    plan = PipelinePlan.from_config(cfg, pol, pp=layout.pp, dp=layout.dp,
                                    m=layout.num_micro_batches, layers_per_stage=None,
                                    validate=False)  # see the module: unchecked in the search
    blocks = plan.blocks
    low = _static_lower_bound(cfg, blocks, plan.shards)
    if cap is not None and low > cap:
        return [Plan(layout, policy, None, (low,), cap)]
    tokens = layout.global_batch * m.seq_len

    def run(lay: Layout, recompute, peaks) -> Plan:
        res = simulate(plan, cost, recompute, tokens, send_mode, steps=steps)
        for st, pk in zip(res.ranks, peaks):
            st.peak_bytes = pk
        return Plan(lay, policy, res, peaks, cap)

    out: list[Plan] = []
    least: tuple[int, ...] | None = None
    for mode in recompute:
        if mode == "auto":
            counts, peaks, fits = fit_recompute(plan, m, layout.micro_batch, cap, steps)
            choice = recompute_for(blocks, "auto", counts)
            peaks = tuple(peaks)
            lay = replace(layout, recompute="auto", recompute_layers=tuple(counts))
        else:
            choice = recompute_for(blocks, mode)
            peaks = stage_peaks(plan, m, layout.micro_batch, choice, steps)
            fits = cap is None or max(peaks) <= cap
            lay = replace(layout, recompute=mode)
        if least is None or max(peaks) < max(least):
            least = peaks
        if fits:
            out.append(run(lay, choice, peaks))
            if mode == "none":
                break
    if not out:
        return [Plan(layout, policy, None, least or (0,), cap)]
    return out


def search(cfg: Config, clusters: int, policies=POLICY_NAMES, cost: CostModel | None = None,
           cap: int | None = -1, global_batch: int | None = None, micro_batches=(1, 2),
           recompute=("none", "selective", "auto"), pps=None, steps: int = 2,
           send_mode: str = "eager", placements=None) -> dict[str, list[Plan]]:
    """Every fitting plan per policy, fastest first. `cap=-1`: the platform's DDR cap."""
    cost = cost or CostModel.from_config(cfg)
    cap = cap_bytes(cfg) if cap == -1 else cap
    layouts = candidate_layouts(cfg, clusters, global_batch, micro_batches, pps, placements)
    out = {}
    for pol in policies:
        plans = []
        for lay in layouts:
            plans += [p for p in plan_layout(cfg, lay, pol, cost, cap, recompute, steps,
                                             send_mode) if p.result is not None]
        out[pol] = sorted(plans, key=lambda p: -p.tokens_per_s)
    return out


@dataclass
class ScalingRow:
    clusters: int
    plan: Plan
    efficiency: float  # tokens/s per cluster relative to the first row


def scaling(cfg: Config, layout: Layout, policy: str, clusters=SCALING_CLUSTERS,
            cost: CostModel | None = None, cap: int | None = -1, steps: int = 2,
            send_mode: str = "eager") -> list[ScalingRow]:
    """Weak scaling of one layout: the same pipeline, micro-batches and recomputation per
    replica, dp = clusters // pp. Efficiency = (tokens/s per cluster) / that of the smallest."""
    cost = cost or CostModel.from_config(cfg)
    cap = cap_bytes(cfg) if cap == -1 else cap
    pol = resolve_policy(cfg.schedule, policy)
    rows: list[ScalingRow] = []
    for n in clusters:
        dp = n // layout.pp
        if dp < 1:
            continue
        lay = replace(layout, dp=dp)
        plan = PipelinePlan.from_config(cfg, pol, pp=lay.pp, dp=dp, m=lay.num_micro_batches,
                                        layers_per_stage=None, validate=False)
        choice = recompute_for(plan.blocks, lay.recompute, list(lay.recompute_layers)
                               if lay.recompute_layers is not None else None)
        c = replace(cost, micro_batch=lay.micro_batch, precision=cfg.precision,
                    placement=lay.placement)
        res = simulate(plan, c, choice, lay.global_batch * cfg.model.seq_len, send_mode,
                       steps=steps)
        peaks = stage_peaks(plan, cfg.model, lay.micro_batch, choice, steps)
        plan = Plan(lay, policy, res, peaks, cap)
        per = plan.tokens_per_s / lay.clusters
        base = rows[0].plan.tokens_per_s / rows[0].plan.layout.clusters if rows else per
        rows.append(ScalingRow(n, plan, per / base))
    return rows


@dataclass
class MemoryRow:
    pp: int
    peak_none: int  # the largest stage's peak without recomputation
    peak_selective: int
    peak_full: int  # every layer fully recomputed
    recomputed: int | None  # fewest layers (one replica) recomputed under the cap; None: no fit


def memory_table(cfg: Config, pps, policy: str = "ratrain", cap: int | None = -1,
                 micro_batch: int = 1, steps: int = 2,
                 clusters: int | None = None) -> list[MemoryRow]:
    """Which pipeline depths fit the cap: per pp, the peak DDR of the fullest stage with no,
    selective and full recomputation, and the fewest layers `auto` recomputes (m >= pp, so
    every stage has its full warm-up in flight). With `clusters`, dp = clusters // pp and
    `ratrain` shards its optimizer state over it (as the runtime does); else dp = 1."""
    cap = cap_bytes(cfg) if cap == -1 else cap
    m = cfg.model
    pol = resolve_policy(cfg.schedule, policy)
    rows = []
    for pp in pps:
        if pp > m.layers:
            continue
        plan = PipelinePlan.from_config(cfg, pol, pp=pp, m=max(pp, 1), layers_per_stage=None,
                                        dp=max(1, clusters // pp) if clusters else 1,
                                        validate=False)
        peaks = {}
        for mode in ("none", "selective", "full"):
            peaks[mode] = max(stage_peaks(plan, m, micro_batch,
                                          recompute_for(plan.blocks, mode), steps))
        if cap is not None and peaks["full"] > cap:
            rec = None
        else:
            counts, _, fits = fit_recompute(plan, m, micro_batch, cap, steps)
            rec = sum(counts) if fits else None
        rows.append(MemoryRow(pp, peaks["none"], peaks["selective"], peaks["full"], rec))
    return rows


__all__ = [
    "Layout",
    "MemoryRow",
    "POLICY_NAMES",
    "Plan",
    "SCALING_CLUSTERS",
    "ScalingRow",
    "candidate_layouts",
    "candidate_pps",
    "cap_bytes",
    "memory_table",
    "plan_layout",
    "scaling",
    "search",
]
