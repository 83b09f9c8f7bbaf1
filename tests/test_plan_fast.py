"""The planner's fast paths against its plain ones (issue 46): the compiled memory walk, the
recoveries it answers, the bound of the simulated step, and the searches that prune with it
give what the plain code gives. Equalities, not timings. No MPI."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from ratrain.config import load_config
from ratrain.exec.spec import OFFLOAD
from ratrain.lifecycle.memory import (
    LinearWalk,
    choose_recompute,
    peaks,
    simulate_peak,
    stage_sizes,
    whole_bytes,
)
from ratrain.lifecycle.passes import offload
from ratrain.lifecycle.passes.offload import OffloadPass
from ratrain.lifecycle.pipeline import PipelinePlan, resolve_policy
from ratrain.lifecycle.recovery import choose_recovery
from ratrain.plan.cost import CostModel
from ratrain.plan.memory import fit_recompute, fit_recovery
from ratrain.plan.prune import StepGraph
from ratrain.plan.search import (
    candidate_layouts,
    candidate_pps,
    placed_cost,
    plan_layout,
    search,
)
from ratrain.plan.simulate import simulate
from ratrain.plan.tierplan import (
    ACT_MODES,
    STATE_MODES,
    _counts,
    _resident_lower_bound,
    shallowest_depths,
    simulate_tier,
    tier_cap,
    tier_rates,
    tier_search,
)

POLICIES = ("baseline-1f1b", "megatron-1f1b", "ratrain")
GIB = 2**30


def _cfg(*sets):
    """7B's shapes at 8 layers and seq 1024 on mt3000: a cap of a few GiB binds."""
    return load_config("jobs/llama2-7b.yaml", ["parallel.pp=4", "parallel.dp=8",
                                               "parallel.num_micro_batches=8", "model.layers=8",
                                               "model.seq_len=1024", *sets])


def _tier(state):
    """The offload pass holding the optimizer `state` in the tier."""
    return (OffloadPass(state=state),)


def _plans():
    """Plans of every policy, optimizer state in the tier, precision and a few depths."""
    for prec in ("fp16", "fp32"):
        cfg = _cfg(f"precision={prec}")
        for pol in POLICIES:
            for pp, dp, m, state in ((2, 4, 3, "off"), (3, 2, 6, "moments"), (4, 8, 8, "masters"),
                                     (1, 2, 2, "off")):
                try:
                    plan = PipelinePlan.of_model(cfg.model, resolve_policy(cfg.schedule, pol),
                                                 pp, dp, m, prec, validate=False,
                                                 passes=_tier(state))
                except ValueError:  # masters where the view is the master
                    continue
                yield cfg, plan


# -- the compiled walk -------------------------------------------------------------------------


def test_the_compiled_walk_is_the_plain_walk():
    rnd, n = random.Random(46), 0
    for cfg, plan in _plans():
        for s, names in enumerate(plan.blocks):
            layers = [b for b in names if b.startswith("layers.")]
            sizes = stage_sizes(cfg.model, 1, plan.precision, names, shards=plan.shards)
            plain = LinearWalk(plan.stage_steps(s, 2), names, sizes, plan.passes)
            every = LinearWalk(offload.lists_with(plan, s, layers, 2), names, sizes,
                               plan.passes)
            for _ in range(4):
                off = frozenset(b for b in layers if rnd.random() < 0.5)
                choice = {b: OFFLOAD if b in off else rnd.choice(("none", "selective", "full"))
                          for b in layers}
                sz = sizes.with_recompute(choice)
                # the lists of a subset of the layers offloaded: every layer's, counted for it
                assert every.peaks(sz, off) == peaks(
                    offload.lists_with(plan, s, off, 2), names, sz, plan.passes)
                kept = sizes.with_recompute({b: c for b, c in choice.items() if c != OFFLOAD})
                assert plain.peaks(kept) == peaks(plan.stage_steps(s, 2), names, kept,
                                                  plan.passes)
                n += 1
    assert n > 100


def test_the_compiled_walk_refuses_other_sizes():
    cfg, plan = next(_plans())
    names = plan.blocks[0]
    sizes = stage_sizes(cfg.model, 1, plan.precision, names, shards=plan.shards)
    walk = LinearWalk(plan.stage_steps(0, 2), names, sizes, plan.passes)
    with pytest.raises(ValueError, match="sizes differ"):
        walk.peaks(stage_sizes(cfg.model, 2, plan.precision, names, shards=plan.shards))


def test_choose_recompute_is_the_plain_rule():
    for cfg, plan in _plans():
        for s, names in enumerate(plan.blocks):
            lists = plan.stage_steps(s, 2)
            sizes = stage_sizes(cfg.model, 1, plan.precision, names, shards=plan.shards)
            layers = [b for b in names if b.startswith("layers.")]
            peaks = [simulate_peak(lists, names, sizes.with_recompute(
                {b: "full" if i < k else "none" for i, b in enumerate(layers)}), plan.passes)
                for k in range(len(layers) + 1)]
            for cap in sorted(set(peaks)) + [min(peaks) - 1, None]:
                fit = next((k for k, p in enumerate(peaks) if cap is None or p <= cap),
                           len(layers))
                choice, peak = choose_recompute(cap, sizes, lists, names, passes=plan.passes)
                assert sum(c == "full" for c in choice.values()) == fit
                assert peak == peaks[fit]


def test_choose_recompute_keeps_sizes_that_are_not_whole_bytes():
    cfg, plan = next(_plans())
    names, lists = plan.blocks[0], plan.stage_steps(0, 2)
    sizes = stage_sizes(cfg.model, 1, plan.precision, names, shards=plan.shards)
    halves = replace(sizes, message_bytes=sizes.message_bytes + 0.5)
    assert whole_bytes(sizes) and not whole_bytes(halves)
    cap = simulate_peak(lists, names, halves, plan.passes) - 1
    # the plain walk, floats kept
    choice, peak = choose_recompute(cap, halves, lists, names, passes=plan.passes)
    assert peak == simulate_peak(lists, names, halves.with_recompute(choice), plan.passes)
    assert isinstance(peak, int) and choice


def _plain_recovery(plan, model, micro_batch, cap, mode, rates, share):
    """`fit_recovery` as it was: each choice's own lists, walked (the plain path)."""
    out = []
    for s, names in enumerate(plan.blocks):
        sizes = stage_sizes(model, micro_batch, plan.precision, names, shards=plan.shards)
        layer = next(b for b in names if b.startswith("layers."))
        top = rates.offloadable(model, names, micro_batch, sizes.act[layer]["none"])
        out.append(choose_recovery(
            cap, sizes, lambda off, s=s: offload.lists_with(plan, s, off, 2), names,
            plan.per_layer_recovery, mode, top, share,
            lambda lists, sz, names=names: peaks(lists, names, sz, plan.passes)))
    return out


@pytest.mark.parametrize("tier", ["nvme", "host"])
def test_fit_recovery_is_the_plain_rule(tier):
    cfg = _cfg(f"platform.tier={tier}")
    cost = CostModel.from_config(cfg)
    rates, share = tier_rates(cost), tier_cap(cost)
    for pol in POLICIES:
        for state in STATE_MODES:
            plan = PipelinePlan.of_model(cfg.model, resolve_policy(cfg.schedule, pol), 4, 8, 8,
                                         cfg.precision, validate=False, passes=_tier(state))
            none = max(simulate_peak(plan.stage_steps(s, 2), names, stage_sizes(
                cfg.model, 1, plan.precision, names, shards=plan.shards), plan.passes)
                for s, names in enumerate(plan.blocks))
            for cap in (none, int(0.8 * none), int(0.6 * none), 4 * GIB):
                for mode in (*ACT_MODES, "off"):
                    _, choices, peaks, tiers, _ = fit_recovery(plan, cfg.model, 1, cap, mode,
                                                               rates, share)
                    plain = _plain_recovery(plan, cfg.model, 1, cap, mode, rates, share)
                    assert [(c, p, t) for c, p, t in zip(choices, peaks, tiers)] == plain


def test_fit_recompute_stops_at_the_first_stage_over_the_cap():
    cfg = _cfg()
    plan = PipelinePlan.from_config(cfg, "baseline-1f1b", validate=False)
    counts, peaks, fits = fit_recompute(plan, cfg.model, 1, 4 * GIB)
    short = fit_recompute(plan, cfg.model, 1, 4 * GIB, stop=True)
    assert not fits and short[2] is False
    assert short[0] == counts[:len(short[0])] and short[1] == peaks[:len(short[1])]
    assert max(short[1]) > 4 * GIB


# -- the bound ---------------------------------------------------------------------------------


def test_the_bound_is_below_every_simulated_step():
    cfg = _cfg("platform.tier=nvme")
    cost = CostModel.from_config(cfg)
    ratio = []
    for pol in POLICIES:
        for lay in candidate_layouts(cfg, 32, micro_batches=(1, 2), placements=("pp", "dp")):
            c = placed_cost(cost, cfg, lay)
            for state in STATE_MODES:
                base = PipelinePlan.of_model(cfg.model, resolve_policy(cfg.schedule, pol),
                                             lay.pp, lay.dp, lay.num_micro_batches,
                                             cfg.precision, validate=False,
                                             passes=_tier(state))
                graph = StepGraph(base, c)
                for full, off in ((0, 0), (1, 0), (0, 1), (1, 1)):
                    choice = [{b: (OFFLOAD if i < off else "full" if i < off + full else "none")
                               for i, b in enumerate(x for x in names if x.startswith("layers."))}
                              for names in base.blocks]
                    plan = offload.with_layers(base, [[b for b, k in ch.items() if k == OFFLOAD]
                                                      for ch in choice], validate=False)
                    step = simulate(plan, c, choice, 1).step_s
                    low, weak = graph.lower_bound(choice), graph.lower_bound(choice, weak=True)
                    assert weak <= step and low <= step, (pol, lay, state, full, off)
                    # the plan with its transfers has the same chains as the plan without
                    assert StepGraph(plan, c).lower_bound(choice) == low
                    if not off and state == "off":  # the tier's time is not in the bound
                        ratio.append(low / step)
    assert min(ratio) > 0.9  # a bound that prunes


# -- the searches ------------------------------------------------------------------------------


def _key(p):
    return (p.layout, p.policy, p.result, p.peaks, p.cap, p.tier_peaks)


def _kept(plans, top):
    """What `python -m ratrain.plan` prints of a policy's plans: the `top` fastest and each
    placement's fastest."""
    first = {}
    for p in plans:
        first.setdefault(p.layout.placement, p)
    return [_key(p) for p in plans[:top]], {k: _key(p) for k, p in first.items()}


@pytest.mark.parametrize("cap_gib", [8, 12])
def test_search_answers_as_the_plain_search(cap_gib):
    cfg = _cfg()
    cost, cap = CostModel.from_config(cfg), cap_gib * GIB
    plans = search(cfg, 32, POLICIES, cost, cap, placements=("pp", "dp"))
    for pol in POLICIES:  # each layout alone, as plan_layout plays it
        plain = [p for lay in candidate_layouts(cfg, 32, placements=("pp", "dp"))
                 for p in plan_layout(cfg, lay, pol, cost, cap) if p.result is not None]
        plain = sorted(plain, key=lambda p: -p.tokens_per_s)
        assert [_key(p) for p in plans[pol]] == [_key(p) for p in plain]
        for top in (1, 2, 5):
            pruned = search(cfg, 32, (pol,), cost, cap, placements=("pp", "dp"), top=top)[pol]
            assert _kept(pruned, top) == _kept(plain, top)
    assert sum(len(v) for v in plans.values()) > 10


def _plain_tier_search(cfg, clusters, pol, cost, cap):
    """`tier_search` as it was: every layout, placement, state and mode on its own."""
    plans, share = [], tier_cap(cost)
    pps = candidate_pps(cfg.model.layers, clusters,
                        (cfg.parallel.pp, *shallowest_depths(cfg.model.layers)))
    for lay in candidate_layouts(cfg, clusters, pps=pps, placements=("pp", "dp")):
        seen = set()
        for state in STATE_MODES:
            for mode in ACT_MODES:
                try:
                    plan = PipelinePlan.of_model(cfg.model, resolve_policy(cfg.schedule, pol),
                                                 lay.pp, lay.dp, lay.num_micro_batches,
                                                 cfg.precision, validate=False,
                                                 passes=_tier(state))
                except ValueError:
                    continue
                if _resident_lower_bound(cfg, plan.blocks, plan.shards, state) > cap:
                    continue
                out = _plain_recovery(plan, cfg.model, lay.micro_batch, cap, mode,
                                      tier_rates(placed_cost(cost, cfg, lay)), share)
                if not all(p <= cap and (share is None or t <= share) for _, p, t in out):
                    continue
                choices = [c for c, _, _ in out]
                if _counts(choices) in seen:
                    continue
                seen.add(_counts(choices))
                tiered = offload.with_layers(plan, [[b for b, k in ch.items() if k == OFFLOAD]
                                                    for ch in choices], validate=False)
                plans.append(simulate_tier(cfg, lay, pol, cost, cap,
                                           (tiered, choices, [p for _, p, _ in out],
                                            [t for _, _, t in out]), mode, state))
    return sorted(plans, key=lambda p: -p.tokens_per_s)


@pytest.mark.parametrize("tier,cap_gib", [("nvme", 6), ("host", 10)])
def test_tier_search_answers_as_the_plain_search(tier, cap_gib):
    cfg = _cfg(f"platform.tier={tier}")
    cost, cap = CostModel.from_config(cfg), cap_gib * GIB
    for pol in ("baseline-1f1b", "ratrain"):
        plans = tier_search(cfg, 32, (pol,), cost, cap, placements=("pp", "dp"))[pol]
        plain = _plain_tier_search(cfg, 32, pol, cost, cap)
        assert [_key(p) for p in plans] == [_key(p) for p in plain]
        for top in (1, 3):
            pruned = tier_search(cfg, 32, (pol,), cost, cap, placements=("pp", "dp"),
                                 top=top)[pol]
            assert [_key(p) for p in pruned[:top]] == [_key(p) for p in plain[:top]]
            assert len(pruned) < len(plain) or len(plain) <= top
