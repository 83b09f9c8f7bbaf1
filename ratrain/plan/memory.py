"""The planner's memory figures: each stage's peak under a layout, with sizes from shapes.

The model itself is the lifecycle's (`lifecycle.memory`: `simulate_peak` walks a rank's action
lists, `stage_sizes` sizes a stage from shapes); this module applies it to every stage of a
`PipelinePlan`.

The search asks one stage's lists for many recompute and offload choices. So each stage's
lists are compiled once (`lifecycle.memory.LinearWalk`) and evaluated per choice, with the
same integers as the plain walk. `Walks` holds a plan's compiled stages for the callers that
ask it several questions. `fit_recovery` compiles a stage's lists with every layer's transfers
in place, and counts those of the layers a choice offloads (see `LinearWalk`).

    peak_memory(plan.steps(2), stage, plan.blocks[stage], sizes)
    counts, peaks, fits = fit_recompute(plan, model, micro_batch, cap)
"""

from __future__ import annotations

from ratrain.config import ModelConfig
from ratrain.exec.spec import OFFLOAD
from ratrain.lifecycle.memory import (
    LinearWalk,
    StageSizes,
    choose_recompute,
    simulate_peak,
    stage_sizes,
)
from ratrain.lifecycle.passes import offload
from ratrain.lifecycle.recovery import choose_recovery


def peak_memory(step_lists, stage: int, blocks, sizes: StageSizes, passes=()) -> int:
    """Peak bytes of stage `stage` over consecutive steps (`step_lists[k][stage]`) with the
    plan's `passes`."""
    return simulate_peak([lists[stage] for lists in step_lists], blocks, sizes, passes)


class Walks:
    """The compiled walks of a plan's stages over `steps` steps, each made at its first use,
    with the plan's passes. `sizes(s, recompute)` are stage s's sizes from shapes,
    `peaks(s, recompute)` its (DDR, tier) peaks."""

    def __init__(self, plan, model: ModelConfig, micro_batch: int, steps: int = 2):
        self.plan, self.model, self.micro_batch, self.steps = plan, model, micro_batch, steps
        self._walks: dict = {}

    def sizes(self, s: int, recompute=None) -> StageSizes:
        plan = self.plan
        return stage_sizes(self.model, self.micro_batch, plan.precision, plan.blocks[s],
                           recompute, plan.shards)

    def walk(self, s: int) -> LinearWalk:
        if s not in self._walks:
            self._walks[s] = LinearWalk(self.plan.stage_steps(s, self.steps),
                                        self.plan.blocks[s], self.sizes(s), self.plan.passes)
        return self._walks[s]

    def peaks(self, s: int, recompute) -> tuple[int, int]:
        return self.walk(s).peaks(self.sizes(s, recompute))

    def tier_walk(self, s: int) -> LinearWalk:
        """Stage s's walk with every layer's activation transfers in place: a choice counts
        those of the layers it offloads (`LinearWalk.peaks`)."""
        key = (s, "transfers")
        if key not in self._walks:
            names = self.plan.blocks[s]
            layers = [b for b in names if b.startswith("layers.")]
            self._walks[key] = LinearWalk(offload.lists_with(self.plan, s, layers, self.steps),
                                          names, self.sizes(s), self.plan.passes)
        return self._walks[key]


def _walks(plan, model, micro_batch, steps, walks):
    if walks is None:
        return Walks(plan, model, micro_batch, steps)
    if walks.plan is not plan or (walks.model, walks.micro_batch, walks.steps) != (
            model, micro_batch, steps):
        raise ValueError("the compiled walks are another plan's")
    return walks


def stage_peaks(plan, model: ModelConfig, micro_batch: int, recompute,
                steps: int = 2, walks: Walks | None = None,
                stop: int | None = None) -> tuple[int, ...]:
    """Every stage's peak over `steps` steps of `plan` with `recompute[stage]` (layer ->
    choice). `walks`: the plan's compiled walks, when the caller asks more than once; `stop`:
    the peaks up to the first stage over it only."""
    walks = _walks(plan, model, micro_batch, steps, walks)
    peaks = []
    for s in range(len(plan.blocks)):
        peaks.append(walks.peaks(s, recompute[s])[0])
        if stop is not None and peaks[-1] > stop:
            break
    return tuple(peaks)


def stage_tier_peaks(plan, model: ModelConfig, micro_batch: int, recompute,
                     steps: int = 2) -> tuple[int, ...]:
    """Every stage's peak bytes in the memory tier (its offloaded state, and activations
    parked or in flight) over `steps` steps of `plan` with `recompute[stage]`."""
    walks = Walks(plan, model, micro_batch, steps)
    return tuple(walks.peaks(s, recompute[s])[1] for s in range(len(plan.blocks)))


def stage_recovery(plan, s: int, model: ModelConfig, micro_batch: int, cap: int | None,
                   mode: str, rates, tier_cap: int | None = None, steps: int = 2,
                   walks: Walks | None = None):
    """Stage s's recovery (`fit_recovery`'s rule): ({layer: choice}, DDR peak, tier peak).
    Its lists are compiled once with every layer's transfers in place (`Walks.tier_walk`)."""
    walks = _walks(plan, model, micro_batch, steps, walks)
    names, sizes = plan.blocks[s], walks.sizes(s)
    layers = [b for b in names if b.startswith("layers.")]
    top = rates.offloadable(model, names, micro_batch,
                            sizes.act[layers[0]]["none"]) if layers else 0
    walk = walks.tier_walk(s)

    def lists_for(off):  # the layers whose transfers count: all that the walk needs
        return frozenset(off)

    def peaks(off, sz):
        return walk.peaks(sz, off)

    return choose_recovery(cap, sizes, lists_for, names, plan.per_layer_recovery, mode, top,
                           tier_cap, peaks)


def stage_fits(peak: int, tier: int, cap: int | None, tier_cap: int | None) -> bool:
    """Whether a stage's DDR peak fits `cap` and its tier peak `tier_cap` (None: no cap)."""
    return (cap is None or peak <= cap) and (tier_cap is None or tier <= tier_cap)


def offloaded_layers(choices) -> list[tuple[str, ...]]:
    """Per stage, the layers whose recovery choice is offload."""
    return [tuple(b for b, c in ch.items() if c == OFFLOAD) for ch in choices]


def fit_recovery(plan, model: ModelConfig, micro_batch: int, cap: int | None, mode: str,
                 rates, tier_cap: int | None = None, steps: int = 2):
    """`fit_recompute` with the memory tier: per stage, each layer kept, recomputed fully or
    offloaded (`lifecycle.recovery.choose_recovery` by `offload.activations` `mode`, auto
    weighing `rates`, a `TierRates`; `tier_cap`: a rank's share of the tier). Returns (the plan
    with the offloaded layers' transfers, per-stage choices, DDR peaks, tier peaks, fits)."""
    choices, peaks, tiers, fits = [], [], [], True
    walks = Walks(plan, model, micro_batch, steps)
    for s in range(len(plan.blocks)):
        choice, peak, tier = stage_recovery(plan, s, model, micro_batch, cap, mode, rates,
                                            tier_cap, steps, walks)
        choices.append(choice)
        peaks.append(peak)
        tiers.append(tier)
        fits = fits and stage_fits(peak, tier, cap, tier_cap)
    plan = offload.with_layers(plan, offloaded_layers(choices), validate=False)
    return plan, choices, peaks, tiers, fits


def fit_recompute(plan, model: ModelConfig, micro_batch: int, cap: int | None, steps: int = 2,
                  walks: Walks | None = None, stop: bool = False):
    """Per stage of `plan`, the fewest layers fully recomputed whose peak fits `cap`
    (`lifecycle.memory.choose_recompute`; a policy of `recovery: uniform`: none or all).
    Returns (counts, peaks, fits). `walks`: see `stage_peaks`; `stop`: the stages up to the
    first that does not fit only."""
    walks = _walks(plan, model, micro_batch, steps, walks)
    counts, peaks, fits = [], [], True
    for s, names in enumerate(plan.blocks):
        choice, peak = choose_recompute(cap, walks.sizes(s), None, names,
                                        plan.per_layer_recovery, plan.passes, walks.walk(s))
        counts.append(sum(1 for r in choice.values() if r == "full"))
        peaks.append(peak)
        fits = fits and (cap is None or peak <= cap)
        if stop and not fits:
            break
    return counts, peaks, fits


__all__ = ["Walks", "fit_recompute", "fit_recovery", "offloaded_layers", "peak_memory",
           "stage_fits", "stage_peaks", "stage_recovery", "stage_tier_peaks"]
