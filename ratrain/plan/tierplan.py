"""The planner with the memory tier: offload as a recovery choice, searched beside today's plans.

The layouts are today's search's (`plan.search.candidate_layouts`) and the shallowest
pipeline for each size of the fullest stage (`shallowest_depths`). A layout's tier plans play `schedule.recompute: auto` with each layer kept, recomputed fully or
offloaded (`plan.memory.fit_recovery`: the runtime's own rule, by `offload.activations`:
`auto` offloads what the tier hides under the stage's compute and recomputes the rest,
`prefer` offloads every layer that must leave the DDR while the tier has room), with the
optimizer state kept or in the tier (`offload.optimizer`), each against the DDR cap and the
rank's share of the tier's capacity, and simulates the fitting ones with the tier's transfers
on each node's tier (`plan.tiersim`). `python -m ratrain.plan` prints the best of them beside
today's plan when the config states a tier (`platform.tier`, `--tier`), with the tier's traffic
and whether the simulator finds it hidden.

The search keeps the plain search's answers and does less. The placements of a layout share
its plans and recoveries. A stage's lists are compiled once with every layer's transfers in
place, and every choice of `choose_recovery` is read from them (`plan.memory.stage_recovery`).
A recovery stops at its first stage that does not fit. With `top`, a layout or recovery is
played only while the bound of its step (`plan.prune`) says it can still be among the `top`
fastest.

    plans = tier_search(cfg, clusters)          # {policy: [Plan, ...] best first}
"""

from __future__ import annotations

from dataclasses import replace
from itertools import groupby

from ratrain.config import Config
from ratrain.exec.params import GRAD_BYTES_PER_PARAM, STATE_BYTES_PER_PARAM, shard_size
from ratrain.exec.params import view_bytes_per_param
from ratrain.exec.spec import block_params, block_role
from ratrain.exec.spec import OFFLOAD
from ratrain.lifecycle.passes import offload
from ratrain.lifecycle.passes.offload import STATE_TIER_BYTES, OffloadPass
from ratrain.lifecycle.recovery import TierRates
from ratrain.lifecycle.pipeline import PipelinePlan, resolve_policy, stage_block_names
from ratrain.plan.cost import CostModel
from ratrain.plan.memory import Walks, offloaded_layers, stage_fits, stage_recovery
from ratrain.plan.prune import Bounds, TopPlayed
from ratrain.plan.search import (
    POLICY_NAMES,
    Layout,
    Plan,
    candidate_layouts,
    candidate_pps,
    cap_bytes,
    placed_cost,
    unplaced,
)
from ratrain.plan.simulate import simulate
from ratrain.plan.steps import recompute_for

ACT_MODES = ("auto", "prefer")  # offload.activations tried
STATE_MODES = ("off", "moments", "masters")  # offload.optimizer tried (masters where legal)


def tier_rates(cost: CostModel) -> TierRates:
    """What `offload.activations: auto` weighs, from the cost model's rates."""
    r = cost.rates
    return TierRates(r.tier_bandwidth, r.tier_latency, r.ranks_per_node, r.compute_flops)


def tier_cap(cost: CostModel) -> int | None:
    """A rank's share of its node's tier."""
    r = cost.rates
    return int(r.tier_bytes // r.ranks_per_node) if r.tier_bytes else None


def _resident_lower_bound(cfg: Config, blocks, shards: int, state: str) -> int:
    """Bytes a stage of `blocks` holds in the DDR whatever its recovery: the resident part of
    its optimizer state (`state` in the tier), and every block's gradient and view (all held
    in the last backward)."""
    resident = STATE_BYTES_PER_PARAM - STATE_TIER_BYTES[state]
    view = view_bytes_per_param(cfg.precision, shards)
    return max(sum(resident * shard_size(n, shards) + (GRAD_BYTES_PER_PARAM + view) * n
                   for n in (block_params(cfg.model, block_role(b)) for b in names))
               for names in blocks)


def base_plan(cfg: Config, layout: Layout, policy: str, cap, state: str, blocks=None):
    """The plan of `layout` under `policy` with the optimizer state `state` in the tier and no
    activation transfers yet, or None when `state` is not legal there or its resident bytes
    alone go over `cap` (`blocks`: its stages' block names, when known)."""
    pol = resolve_policy(cfg.schedule, policy)
    blocks = blocks or stage_block_names(cfg.model, layout.pp)
    if cap is not None and _resident_lower_bound(cfg, blocks, pol.shards(layout.dp), state) > cap:
        return None
    try:
        return PipelinePlan.of_model(cfg.model, pol, layout.pp, layout.dp,
                                     layout.num_micro_batches, cfg.precision, validate=False,
                                     passes=(OffloadPass(state=state),))
    except ValueError:  # masters where the view is the master
        return None


def recovery(cfg: Config, plan, layout: Layout, cost: CostModel, cap, act_mode: str,
             steps: int = 2, walks: Walks | None = None):
    """The recovery of `plan` (`base_plan`'s) with the tier: (per-stage choices, DDR peaks,
    tier peaks), or None as soon as a stage does not fit. `walks`: the plan's compiled walks,
    shared by the modes tried."""
    c = replace(cost, micro_batch=layout.micro_batch, precision=cfg.precision)
    rates, share = tier_rates(c), tier_cap(c)
    walks = walks or Walks(plan, cfg.model, layout.micro_batch, steps)
    choices, peaks, tiers = [], [], []
    for s in range(len(plan.blocks)):
        choice, peak, tier = stage_recovery(plan, s, cfg.model, layout.micro_batch, cap,
                                            act_mode, rates, share, steps, walks)
        if not stage_fits(peak, tier, cap, share):
            return None
        choices.append(choice)
        peaks.append(peak)
        tiers.append(tier)
    return choices, peaks, tiers


def fit_layout_tier(cfg: Config, layout: Layout, policy: str, cost: CostModel, cap,
                    act_mode: str, state: str, steps: int = 2):
    """The recovery of `layout` under `policy` with the tier (`act_mode`: offload.activations,
    `state`: offload.optimizer): (plan with its transfers, per-stage choices, DDR peaks, tier
    peaks), or None when it does not fit (or `state` is not legal there)."""
    plan = base_plan(cfg, layout, policy, cap, state)
    fit = None if plan is None else recovery(cfg, plan, layout, cost, cap, act_mode, steps)
    if fit is None:
        return None
    return (offload.with_layers(plan, offloaded_layers(fit[0]), validate=False), *fit)


def _counts(choices):
    return tuple(tuple(sum(1 for c in ch.values() if c == kind) for ch in choices)
                 for kind in ("full", OFFLOAD))


def simulate_tier(cfg: Config, layout: Layout, policy: str, cost: CostModel, cap, fit,
                  act_mode: str, state: str, steps: int = 2, send_mode: str = "eager") -> Plan:
    """The simulated `Plan` of a fitting recovery (`fit_layout_tier`'s)."""
    plan, choices, peaks, tiers = fit
    cost = replace(cost, micro_batch=layout.micro_batch, precision=cfg.precision,
                   placement=layout.placement)
    tokens = layout.global_batch * cfg.model.seq_len
    res = simulate(plan, cost, choices, tokens, send_mode, steps=steps)
    for st, pk in zip(res.ranks, peaks):
        st.peak_bytes = pk
    full, off = _counts(choices)
    lay = replace(layout, recompute="auto", recompute_layers=full, offload=act_mode,
                  offload_layers=off, offload_state=state)
    return Plan(lay, policy, res, tuple(peaks), cap, tuple(tiers))


def plan_layout_tier(cfg: Config, layout: Layout, policy: str, cost: CostModel, cap,
                     act_mode: str, state: str, steps: int = 2, send_mode: str = "eager"):
    """The simulated plan of `layout` under `policy` with the tier, or None when it does not
    fit (see `fit_layout_tier`)."""
    fit = fit_layout_tier(cfg, layout, policy, cost, cap, act_mode, state, steps)
    return None if fit is None else simulate_tier(cfg, layout, policy, cost, cap, fit,
                                                  act_mode, state, steps, send_mode)


def shallowest_depths(layers: int) -> list[int]:
    """For each size of the fullest stage, the fewest stages that hold the layers
    (ceil(layers / k)): 80 layers -> ..., 27 (3 a stage), 40 (2), 80. Today's search tries the
    depths that divide the layers or the clusters; with the tier the fullest stage's size is
    what sets the step (each layer's compute without recomputation), so the tier's search adds
    these: at most a few clusters idle (960 clusters at pp 27: dp 35, 15 idle)."""
    return sorted({-(-layers // k) for k in range(1, layers + 1)})


def tier_search(cfg: Config, clusters: int, policies=POLICY_NAMES, cost: CostModel | None = None,
                cap: int | None = -1, global_batch: int | None = None, micro_batches=(1, 2),
                placements=None, steps: int = 2, send_mode: str = "eager",
                act_modes=ACT_MODES, states=STATE_MODES, top: int | None = None
                ) -> dict[str, list[Plan]]:
    """Every fitting plan with the tier per policy, fastest first (`cap=-1`: the platform's).
    The placements of a layout share its plans and recoveries (`fit_layout_tier`'s parts).
    `top`: a plan is simulated only while it can be among the `top` fastest (`plan.prune`), so
    the list holds those at least; None: every plan."""
    cost = cost or CostModel.from_config(cfg)
    cap = cap_bytes(cfg) if cap == -1 else cap
    pps = candidate_pps(cfg.model.layers, clusters, (cfg.parallel.pp,
                                                     *shallowest_depths(cfg.model.layers)))
    layouts = candidate_layouts(cfg, clusters, global_batch, micro_batches, pps, placements)
    blocks = {pp: stage_block_names(cfg.model, pp) for pp in pps}
    out = {}
    for pol in policies:
        plans, kept = [], TopPlayed(None if top is None else {None: top})
        for key, placed in groupby(layouts, key=unplaced):
            unit = _Layout(cfg, key, pol, placed_cost(cost, cfg, key), cap, blocks[key.pp],
                           steps)
            first = next((s for s in states if unit.plan(s) is not None), None)
            if first is None:
                continue  # over the cap in every state
            # slower in every state, even recomputing nothing? The chains alone (`weak`) bound
            # every state's plans (their lists differ only in the tier's actions, which the
            # bound skips), so one plan may answer for all
            none = recompute_for(unit.plan(first).blocks, "none")
            if kept.prunes((None,), unit.bounds(first), none, weak=True) or all(
                    unit.plan(s) is None or kept.prunes((None,), unit.bounds(s), none)
                    for s in states):
                continue
            fits, tiered = {}, {}  # the same for every placement of the layout
            for lay in placed:
                # a recovery already simulated with less in the tier is not played again: more
                # state in the tier only adds transfers
                seen = set()
                for state in states:
                    for mode in act_modes:
                        if (state, mode) not in fits:
                            fits[state, mode] = unit.plan(state) and recovery(
                                cfg, unit.plan(state), lay, cost, cap, mode, steps,
                                unit.walks(state))
                        fit = fits[state, mode]
                        counts = fit and _counts(fit[0])
                        if not fit or counts in seen:
                            continue
                        seen.add(counts)
                        if kept.prunes((None,), unit.bounds(state), fit[0]):
                            continue  # its bound counts no transfer: the plan without them
                        off = tuple(offloaded_layers(fit[0]))
                        if (state, off) not in tiered:
                            tiered[state, off] = offload.with_layers(unit.plan(state), off,
                                                                     validate=False)
                        plans.append(simulate_tier(cfg, lay, pol, cost, cap,
                                                   (tiered[state, off], *fit), mode, state,
                                                   steps, send_mode))
                        kept.add((None,), plans[-1].tokens_per_s)
        out[pol] = sorted(plans, key=lambda p: -p.tokens_per_s)
    return out


class _Layout:
    """One layout's plan, bounds and compiled walks per optimizer state, each made when first
    asked: the same for every placement (`tier_search`)."""

    def __init__(self, cfg, layout, policy, cost, cap, blocks, steps):
        self.cfg, self.layout, self.policy, self.cost = cfg, layout, policy, cost
        self.cap, self.blocks, self.steps = cap, blocks, steps
        self.plans, self._bounds, self._walks = {}, {}, {}

    def plan(self, state: str):
        if state not in self.plans:
            self.plans[state] = base_plan(self.cfg, self.layout, self.policy, self.cap, state,
                                          self.blocks)
        return self.plans[state]

    def bounds(self, state: str) -> Bounds:
        if state not in self._bounds:
            tokens = self.layout.global_batch * self.cfg.model.seq_len
            self._bounds[state] = Bounds(self.plan(state), self.cost, tokens, self.steps)
        return self._bounds[state]

    def walks(self, state: str) -> Walks:
        if state not in self._walks:
            self._walks[state] = Walks(self.plan(state), self.cfg.model,
                                       self.layout.micro_batch, self.steps)
        return self._walks[state]


__all__ = ["ACT_MODES", "STATE_MODES", "base_plan", "fit_layout_tier", "plan_layout_tier",
           "recovery", "report", "shallowest_depths", "simulate_tier", "tier_cap", "tier_rates",
           "tier_search"]


def _gib(n) -> str:
    return f"{n / 2**30:.2f}"


def _breakdown(plan: Plan) -> str:
    """The busiest rank's step, from the simulator: compute (recompute), bubble, waits."""
    r = max(plan.result.ranks, key=lambda x: x.busy_s)
    out = (f"compute {r.compute_s:.1f} s (recompute {r.recompute_s:.1f}), bubble "
           f"{plan.result.bubble_s:.1f} s, exposed communication {plan.result.comm_exposed_s:.2f} s")
    if plan.result.tier_s:
        out += (f", tier transfers {plan.result.tier_s:.1f} s ({plan.result.tier_exposed_s:.2f} s "
                "exposed)")
    return out


def report(cfg: Config, tier_plans, today, cost: CostModel, clusters: int, top: int) -> list[str]:
    """`python -m ratrain.plan`'s lines about the tier: its figures with their sources, each
    policy's best plans with it (tier bytes, traffic per step, whether it is hidden), and the
    best with the tier beside today's best, with the simulator's breakdown of both."""
    r, layers = cost.rates, cfg.model.layers
    name = next(v for k, v in r.sources if k == "tier_bandwidth").split(":")[0].removeprefix("tier ")
    out = [f"\n== the memory tier {name}: per node, shared by its {r.ranks_per_node} ranks =="]
    for key, unit in (("tier_bytes", "B"), ("tier_bandwidth", "B/s"), ("tier_latency", "s")):
        v = getattr(r, key)
        src = " ".join(r.source(key).split(": ", 1)[-1].split())
        out.append(f"  {key} = {'not modelled' if v is None else f'{v:.4g} {unit}'}  ({src})")
    for pol, plans in tier_plans.items():
        out.append(f"\n== {pol} with the tier {name}: best layouts on {clusters} clusters ==")
        if not plans:
            out.append("  nothing fits under the caps")
            continue
        out.append(f"  {'pp':>3} {'dp':>4} {'mb':>2} {'m':>4} {'place':>5} {'step s':>8} "
                   f"{'tokens/s':>9} {'peak GiB':>8} {'tier GiB':>8} {'recovery':>22} "
                   f"{'optimizer':>9} {'tier GB/step':>12} {'tier s':>7} {'exposed s':>9} "
                   f"{'bubble s':>8}")
        for q in plans[:top]:
            lay, res = q.layout, q.result
            traffic = max(x.tier_bytes for x in res.ranks)
            out.append(f"  {lay.pp:>3} {lay.dp:>4} {lay.micro_batch:>2} {lay.num_micro_batches:>4} "
                       f"{lay.placement:>5} {q.step_s:>8.2f} {q.tokens_per_s:>9.0f} "
                       f"{_gib(q.peak_bytes):>8} {_gib(max(q.tier_peaks)):>8} "
                       f"{lay.offload + ': ' + lay.describe(layers):>22} {lay.offload_state:>9} "
                       f"{traffic / 1e9:>12.1f} {res.tier_s:>7.1f} {res.tier_exposed_s:>9.2f} "
                       f"{res.bubble_s:>8.2f}")
    best = max((p for ps in tier_plans.values() for p in ps[:1]), key=lambda p: p.tokens_per_s,
               default=None)
    now = max((p for ps in today.values() for p in ps[:1]), key=lambda p: p.tokens_per_s,
              default=None)
    if best is None:
        return out
    lay = best.layout
    hidden = ("hidden" if best.result.tier_exposed_s <= 0.01 * max(best.result.tier_s, 1e-9)
              else f"{best.result.tier_exposed_s:.2f} s of {best.result.tier_s:.1f} s exposed")
    out.append(f"\nbest with the tier {name}: {best.policy}, pp {lay.pp} x dp {lay.dp}, "
               f"{best.tokens_per_s:,.0f} tokens/s, its tier traffic {hidden}")
    if now is not None:
        out.append(f"  today's best: {now.policy}, pp {now.layout.pp} x dp {now.layout.dp}, "
                   f"{now.tokens_per_s:,.0f} tokens/s; with the tier / today: "
                   f"{best.tokens_per_s / now.tokens_per_s:.3f}x")
        out.append(f"  today (simulated, per step): {_breakdown(now)}")
    out.append(f"  with the tier (simulated, per step): {_breakdown(best)}")
    return out
