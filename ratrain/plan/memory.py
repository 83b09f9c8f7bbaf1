"""The planner's memory figures: each stage's peak under a layout, with sizes from shapes.

The model itself is the lifecycle's (`lifecycle.memory`: `simulate_peak` walks a rank's action
lists, `stage_sizes` sizes a stage from shapes); this module applies it to every stage of a
`PipelinePlan`.

    peak_memory(plan.steps(2), stage, plan.blocks[stage], sizes)
    counts, peaks, fits = fit_recompute(plan, model, micro_batch, cap)
"""

from __future__ import annotations

from ratrain.config import ModelConfig
from ratrain.exec.spec import OFFLOAD
from ratrain.lifecycle.memory import StageSizes, choose_recompute, simulate_peak, stage_sizes
from ratrain.lifecycle.passes import offload
from ratrain.lifecycle.recovery import choose_recovery


def peak_memory(step_lists, stage: int, blocks, sizes: StageSizes, passes=()) -> int:
    """Peak bytes of stage `stage` over consecutive steps (`step_lists[k][stage]`) with the
    plan's `passes`."""
    return simulate_peak([lists[stage] for lists in step_lists], blocks, sizes, passes)


def stage_peaks(plan, model: ModelConfig, micro_batch: int, recompute,
                steps: int = 2) -> tuple[int, ...]:
    """Every stage's peak over `steps` steps of `plan` with `recompute[stage]` (layer ->
    choice)."""
    step_lists = plan.steps(steps)
    return tuple(
        peak_memory(step_lists, s, names, stage_sizes(model, micro_batch, plan.precision, names,
                                                      recompute[s], plan.shards), plan.passes)
        for s, names in enumerate(plan.blocks))


def stage_tier_peaks(plan, model: ModelConfig, micro_batch: int, recompute,
                     steps: int = 2) -> tuple[int, ...]:
    """Every stage's peak bytes in the memory tier (its offloaded state, and activations
    parked or in flight) over `steps` steps of `plan` with `recompute[stage]`."""
    step_lists = plan.steps(steps)
    return tuple(
        offload.peaks([lists[s] for lists in step_lists], names,
                      stage_sizes(model, micro_batch, plan.precision, names, recompute[s],
                                  plan.shards), plan.passes)[1]
        for s, names in enumerate(plan.blocks))


def fit_recovery(plan, model: ModelConfig, micro_batch: int, cap: int | None, mode: str,
                 rates, tier_cap: int | None = None, steps: int = 2):
    """`fit_recompute` with the memory tier: per stage, each layer kept, recomputed fully or
    offloaded (`lifecycle.recovery.choose_recovery` by `offload.activations` `mode`, auto
    weighing `rates`, a `TierRates`; `tier_cap`: a rank's share of the tier). Returns (the plan
    with the offloaded layers' transfers, per-stage choices, DDR peaks, tier peaks, fits)."""
    choices, peaks, tiers, fits = [], [], [], True
    for s, names in enumerate(plan.blocks):
        sizes = stage_sizes(model, micro_batch, plan.precision, names, shards=plan.shards)
        layer = next((b for b in names if b.startswith("layers.")), None)
        top = rates.offloadable(model, names, micro_batch,
                                sizes.act[layer]["none"]) if layer else 0

        made: dict = {}

        def lists_for(off, s=s, made=made):  # one set of layers is asked for several times
            if off not in made:
                made[off] = offload.lists_with(plan, s, off, steps)
            return made[off]

        def walk(lists, sz, names=names):
            return offload.peaks(lists, names, sz, plan.passes)

        choice, peak, tier = choose_recovery(cap, sizes, lists_for, names,
                                             plan.per_layer_recovery, mode, top, tier_cap, walk)
        choices.append(choice)
        peaks.append(peak)
        tiers.append(tier)
        fits = fits and (cap is None or peak <= cap) and (tier_cap is None or tier <= tier_cap)
    off = [tuple(b for b, c in ch.items() if c == OFFLOAD) for ch in choices]
    return offload.with_layers(plan, off, validate=False), choices, peaks, tiers, fits


def fit_recompute(plan, model: ModelConfig, micro_batch: int, cap: int | None, steps: int = 2):
    """Per stage of `plan`, the fewest layers fully recomputed whose peak fits `cap`
    (`lifecycle.memory.choose_recompute`; a policy of `recovery: uniform`: none or all).
    Returns (counts, peaks, fits)."""
    counts, peaks, fits = [], [], True
    for s, names in enumerate(plan.blocks):
        sizes = stage_sizes(model, micro_batch, plan.precision, names, shards=plan.shards)
        choice, peak = choose_recompute(cap, sizes, plan.stage_steps(s, steps), names,
                                        plan.per_layer_recovery, plan.passes)
        counts.append(sum(1 for r in choice.values() if r == "full"))
        peaks.append(peak)
        fits = fits and (cap is None or peak <= cap)
    return counts, peaks, fits


__all__ = ["fit_recompute", "fit_recovery", "peak_memory", "stage_peaks", "stage_tier_peaks"]
