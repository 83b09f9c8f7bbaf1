"""The planner's memory figures: each stage's peak under a layout, with sizes from shapes.

The model itself is the lifecycle's (`lifecycle.memory`: `simulate_peak` walks a rank's action
lists, `stage_sizes` sizes a stage from shapes); this module applies it to every stage of a
`PipelinePlan`.

    peak_memory(plan.steps(2), stage, plan.blocks[stage], sizes)
    counts, peaks, fits = fit_recompute(plan, model, micro_batch, cap)
"""

from __future__ import annotations

from ratrain.config import ModelConfig
from ratrain.lifecycle.memory import StageSizes, choose_recompute, simulate_peak, stage_sizes


def peak_memory(step_lists, stage: int, blocks, sizes: StageSizes) -> int:
    """Peak bytes of stage `stage` over consecutive steps (`step_lists[k][stage]`)."""
    return simulate_peak([lists[stage] for lists in step_lists], blocks, sizes)


def stage_peaks(plan, model: ModelConfig, micro_batch: int, recompute,
                steps: int = 2) -> tuple[int, ...]:
    """Every stage's peak over `steps` steps of `plan` with `recompute[stage]` (layer ->
    choice)."""
    step_lists = plan.steps(steps)
    return tuple(
        peak_memory(step_lists, s, names, stage_sizes(model, micro_batch, plan.precision, names,
                                                      recompute[s], plan.shards))
        for s, names in enumerate(plan.blocks))


def fit_recompute(plan, model: ModelConfig, micro_batch: int, cap: int | None, steps: int = 2):
    """Per stage of `plan`, the fewest layers fully recomputed whose peak fits `cap`
    (`lifecycle.memory.choose_recompute`; a policy of `recovery: uniform`: none or all).
    Returns (counts, peaks, fits)."""
    counts, peaks, fits = [], [], True
    for s, names in enumerate(plan.blocks):
        sizes = stage_sizes(model, micro_batch, plan.precision, names, shards=plan.shards)
        choice, peak = choose_recompute(cap, sizes, plan.stage_steps(s, steps), names,
                                        plan.per_layer_recovery)
        counts.append(sum(1 for r in choice.values() if r == "full"))
        peaks.append(peak)
        fits = fits and (cap is None or peak <= cap)
    return counts, peaks, fits


__all__ = ["fit_recompute", "peak_memory", "stage_peaks"]
