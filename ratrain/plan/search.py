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

Three things keep it within a minute with the same answers. A layout's plan and memory do not
depend on its placement, so both placements share them (`fit_layout`), and each stage's
lists are compiled once for every recompute choice (`plan.memory.Walks`). A mode stops at
the first stage over the cap, since what does not fit is dropped. With `top` (the command's
`--top`), a candidate is simulated only while the bound of its step (`plan.prune`) says it
can still be among the `top` fastest or the fastest of its placement: what the command prints.

    plans = search(cfg, clusters=1024)                   # {policy: [Plan, ...] best first}
    rows = scaling(cfg, plans["ratrain"][0].layout, "ratrain", [64, 128, 256, 512, 1024])
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import groupby

from ratrain.config import Config, global_batch
from ratrain.exec.params import STATE_BYTES_PER_PARAM, shard_size
from ratrain.exec.spec import block_params, block_role
from ratrain.lifecycle.pipeline import PipelinePlan, resolve_policy, stage_block_names
from ratrain.plan.cost import CostModel
from ratrain.plan.memory import Walks, fit_recompute, stage_peaks
from ratrain.plan.prune import Bounds, TopPlayed
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


@dataclass
class Fitted:
    """What a layout's plans share whatever its placement: the plan, and per recompute mode
    tried its choice, peaks and whether it fits (`low`: the static bound, when over the cap)."""

    plan: PipelinePlan | None  # None when `low` is over the cap
    low: int | None
    modes: list  # [(layout fields, recompute choice, peaks, fits)]
    least: tuple[int, ...] | None


def layout_plan(cfg: Config, layout: Layout, policy: str, cap: int | None = None,
                blocks=None):
    """The unchecked plan of `layout` under `policy`, or None when its optimizer state alone
    goes over `cap` (`_static_lower_bound`; `blocks`: its stages' block names, when known)."""
    pol = resolve_policy(cfg.schedule, policy)  # the preset with the config's component keys
    low = _static_lower_bound(cfg, blocks or stage_block_names(cfg.model, layout.pp),
                              pol.shards(layout.dp))
    if cap is not None and low > cap:
        return None
    return PipelinePlan.from_config(cfg, pol, pp=layout.pp, dp=layout.dp,
                                    m=layout.num_micro_batches, layers_per_stage=None,
                                    validate=False)  # see the module: unchecked in the search


def fit_layout(cfg: Config, layout: Layout, policy: str, cap: int | None = None,
               recompute=("none", "selective", "auto"), steps: int = 2,
               least: bool = True, plan=None) -> Fitted:
    """The memory side of `plan_layout`: the same for either placement of a layout.
    `least=False`: a mode stops at its first stage over the cap (its peaks cut short), and
    `Fitted.least` is not known: enough for a search, which drops what does not fit.
    `plan`: `layout_plan`'s, when made already (so under the static bound)."""
    m = cfg.model
    if plan is None:
        pol = resolve_policy(cfg.schedule, policy)
        low = _static_lower_bound(cfg, stage_block_names(m, layout.pp), pol.shards(layout.dp))
        if cap is not None and low > cap:
            return Fitted(None, low, [], None)
        plan = layout_plan(cfg, layout, policy)
    blocks = plan.blocks
    walks = Walks(plan, m, layout.micro_batch, steps)
    stop = None if least else cap
    modes, low_peaks = [], None
    for mode in recompute:
        if mode == "auto":
            counts, peaks, fits = fit_recompute(plan, m, layout.micro_batch, cap, steps, walks,
                                                stop=not least)
            choice = recompute_for(blocks, "auto", counts + [0] * (len(blocks) - len(counts)))
            peaks = tuple(peaks)
            fields = {"recompute": "auto", "recompute_layers": tuple(counts)}
        else:
            choice = recompute_for(blocks, mode)
            peaks = stage_peaks(plan, m, layout.micro_batch, choice, steps, walks, stop)
            fits = len(peaks) == len(blocks) and (cap is None or max(peaks) <= cap)
            fields = {"recompute": mode}
        if low_peaks is None or max(peaks) < max(low_peaks):
            low_peaks = peaks
        modes.append((fields, choice, peaks, fits))
        if fits and mode == "none":
            break
    return Fitted(plan, None, modes, low_peaks if least else None)


def plan_layout(cfg: Config, layout: Layout, policy: str, cost: CostModel | None = None,
                cap: int | None = None, recompute=("none", "selective", "auto"), steps: int = 2,
                send_mode: str = "eager", fitted: Fitted | None = None) -> list[Plan]:
    """The plans of one layout under one policy, one per recompute mode that fits (the first
    that fits only, when it is `none`); a single non-fitting plan (result None, its least
    peak) when none fits. `fitted`: `fit_layout`'s answer for it, when known."""
    m = cfg.model
    cost = cost or CostModel.from_config(cfg)
    cost = replace(cost, micro_batch=layout.micro_batch, precision=cfg.precision,
                   placement=layout.placement)
    fitted = fitted or fit_layout(cfg, layout, policy, cap, recompute, steps)
    if fitted.low is not None:
        return [Plan(layout, policy, None, (fitted.low,), cap)]
    tokens = layout.global_batch * m.seq_len
    out: list[Plan] = []
    for fields, choice, peaks, fits in fitted.modes:
        if fits:
            res = simulate(fitted.plan, cost, choice, tokens, send_mode, steps=steps)
            for st, pk in zip(res.ranks, peaks):
                st.peak_bytes = pk
            out.append(Plan(replace(layout, **fields), policy, res, peaks, cap))
    if not out:
        return [Plan(layout, policy, None, fitted.least or (0,), cap)]
    return out


def unplaced(layout: Layout) -> Layout:
    """`layout` without its placement: what its memory and action lists depend on."""
    return replace(layout, placement="pp")


def search(cfg: Config, clusters: int, policies=POLICY_NAMES, cost: CostModel | None = None,
           cap: int | None = -1, global_batch: int | None = None, micro_batches=(1, 2),
           recompute=("none", "selective", "auto"), pps=None, steps: int = 2,
           send_mode: str = "eager", placements=None, top: int | None = None
           ) -> dict[str, list[Plan]]:
    """Every fitting plan per policy, fastest first. `cap=-1`: the platform's DDR cap. The
    placements of a layout share its `fit_layout`. `top`: a plan is simulated only while it
    can be among the `top` fastest, or the fastest of its placement (`plan.prune`), so the
    list holds those at least; None: every plan."""
    cost = cost or CostModel.from_config(cfg)
    cap = cap_bytes(cfg) if cap == -1 else cap
    layouts = candidate_layouts(cfg, clusters, global_batch, micro_batches, pps, placements)
    out, blocks = {}, {}  # blocks: each depth's stages' block names
    for pol in policies:
        # kept: the `top` fastest, and each placement's fastest (what the command prints)
        kept = TopPlayed(None if top is None else {
            None: top, **dict.fromkeys((lay.placement for lay in layouts), 1)})
        plans = []
        for key, placed in groupby(layouts, key=unplaced):
            group, tokens = list(placed), key.global_batch * cfg.model.seq_len
            groups = (None, *{lay.placement for lay in group})
            if key.pp not in blocks:
                blocks[key.pp] = stage_block_names(cfg.model, key.pp)
            plan = layout_plan(cfg, key, pol, cap, blocks[key.pp])
            bounds = plan and Bounds(plan, placed_cost(cost, cfg, key), tokens, steps)
            if plan is None or kept.prunes(groups, bounds, recompute_for(plan.blocks, "none")):
                continue  # over the cap whatever it does; or slower, even recomputing nothing
            fitted = fit_layout(cfg, key, pol, cap, recompute, steps, least=False, plan=plan)
            for lay in group:
                for fields, choice, peaks, fits in fitted.modes:
                    if not fits or kept.prunes((None, lay.placement), bounds, choice):
                        continue
                    res = simulate(plan, placed_cost(cost, cfg, lay), choice, tokens, send_mode,
                                   steps=steps)
                    for st, pk in zip(res.ranks, peaks):
                        st.peak_bytes = pk
                    plans.append(Plan(replace(lay, **fields), pol, res, peaks, cap))
                    kept.add((None, lay.placement), plans[-1].tokens_per_s)
        out[pol] = sorted(plans, key=lambda p: -p.tokens_per_s)
    return out


def placed_cost(cost: CostModel, cfg: Config, layout: Layout) -> CostModel:
    """`cost` for `layout`: its micro-batch and placement, the config's precision."""
    return replace(cost, micro_batch=layout.micro_batch, precision=cfg.precision,
                   placement=layout.placement)


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
    "Fitted",
    "Layout",
    "MemoryRow",
    "POLICY_NAMES",
    "Plan",
    "SCALING_CLUSTERS",
    "ScalingRow",
    "candidate_layouts",
    "candidate_pps",
    "cap_bytes",
    "fit_layout",
    "layout_plan",
    "memory_table",
    "placed_cost",
    "plan_layout",
    "scaling",
    "search",
    "unplaced",
]
