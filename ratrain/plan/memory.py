"""The planner's memory figures: each stage's peak under a layout, with sizes from shapes.

The model itself is the lifecycle's (`lifecycle.memory`: `simulate_peak` walks a rank's action
lists, `stage_sizes` sizes a stage from shapes); this module applies it to every stage of a
planned layout.

    peak_memory(step_lists, stage, blocks[stage], sizes)
    counts, peaks, fits = fit_recompute(step_lists, blocks, model, micro_batch, precision, cap)
"""

from __future__ import annotations

from ratrain.config import ModelConfig
from ratrain.lifecycle.memory import StageSizes, choose_recompute, simulate_peak, stage_sizes


def peak_memory(step_lists, stage: int, blocks, sizes: StageSizes) -> int:
    """Peak bytes of stage `stage` over consecutive steps (`step_lists[k][stage]`)."""
    return simulate_peak([lists[stage] for lists in step_lists], blocks, sizes)


def stage_peaks(step_lists, blocks, model: ModelConfig, micro_batch: int, precision: str,
                recompute, shards: int = 1) -> tuple[int, ...]:
    """Every stage's peak with `recompute[stage]` (layer -> choice)."""
    return tuple(
        peak_memory(step_lists, s, names, stage_sizes(model, micro_batch, precision, names,
                                                      recompute[s], shards))
        for s, names in enumerate(blocks))


def fit_recompute(step_lists, blocks, model: ModelConfig, micro_batch: int, precision: str,
                  cap: int | None, shards: int = 1, per_layer: bool = True):
    """Per stage, the fewest layers fully recomputed whose peak fits `cap`
    (`lifecycle.memory.choose_recompute`; `per_layer=False`: none or all). Returns (counts,
    peaks, fits)."""
    counts, peaks, fits = [], [], True
    for s, names in enumerate(blocks):
        sizes = stage_sizes(model, micro_batch, precision, names, shards=shards)
        choice, peak = choose_recompute(cap, sizes, [lists[s] for lists in step_lists], names,
                                        per_layer)
        counts.append(sum(1 for r in choice.values() if r == "full"))
        peaks.append(peak)
        fits = fits and (cap is None or peak <= cap)
    return counts, peaks, fits


__all__ = ["fit_recompute", "peak_memory", "stage_peaks"]
