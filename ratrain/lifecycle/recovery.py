"""A layer's recovery under the DDR cap: kept, recomputed, or offloaded to the memory tier.

`schedule.recompute: auto` picks, per stage, the fewest layers that must leave the DDR for its
peak to fit the cap (the first ones of the stage), and with a tier (`offload.activations`) how
many of those the tier takes instead of recomputing them: `choose_recovery`. The executor runs
it at start-up with measured sizes (`runtime.measure`), the planner with sizes from shapes
(`plan.memory.fit_recovery`): the same rule. `hidden_layers` is `offload.activations: auto`'s
rule for how many layers the tier can take without showing (their transfers under the stage's
compute); `TierRates` holds what it weighs. The tier's transfers themselves are a pass over the
step (`lifecycle.passes.offload`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ratrain.exec.spec import OFFLOAD, block_flops, block_role


@dataclass(frozen=True)
class TierRates:
    """What `offload.activations: auto` weighs: the tier's `bandwidth` (B/s per node, None: not
    modelled), `latency` (s per transfer), the `sharing` ranks of a node, and the rank's
    `compute_flops` (None: not known, the tier is taken as free)."""

    bandwidth: float | None = None
    latency: float = 0.0
    sharing: int = 1
    compute_flops: float | None = None

    @classmethod
    def of_profile(cls, profile) -> TierRates:
        """The rates of a rank's `shim.platform.Profile` (its tier: `platform.tier`)."""
        spec = profile.tier
        return cls(spec.bandwidth if spec is not None else None,
                   (spec.latency or 0.0) if spec is not None else 0.0,
                   profile.ranks_per_node or 1, profile.compute_flops)

    def offloadable(self, model, blocks, micro_batch: int, act_bytes: int) -> int:
        """How many of a stage's layers (`blocks`) the tier takes without showing, each moving
        `act_bytes` out and back per micro-batch under the stage's compute (`hidden_layers`)."""
        layers = sum(1 for b in blocks if block_role(b) == "layer")
        if not self.compute_flops:
            return layers
        tokens = micro_batch * model.seq_len
        flops = sum(block_flops(model, block_role(b), tokens, phase)
                    for b in blocks if block_role(b) != "embed"
                    for phase in ("forward", "backward"))
        return hidden_layers(layers, act_bytes, flops / self.compute_flops, self.bandwidth,
                             self.latency, self.sharing)


def hidden_layers(layers: int, act_bytes: int, compute_s: float, bandwidth: float | None,
                  latency: float = 0.0, sharing: int = 1) -> int:
    """`offload.activations: auto`: how many of a stage's `layers` the tier takes without
    showing. Each offloaded layer moves `act_bytes` (its saved activations) out and back per
    micro-batch; the stage computes for `compute_s` per micro-batch (forward and backward of
    its blocks), under which the tier's transfers run, at the rank's share of the node's
    `bandwidth` (`sharing` ranks) plus `latency` per transfer. None bandwidth: the tier is not
    modelled (free), every layer."""
    if not bandwidth or math.isinf(bandwidth):
        return layers
    per_layer = 2 * (latency + act_bytes * sharing / bandwidth)
    if per_layer <= 0:
        return layers
    return max(0, min(layers, int(compute_s / per_layer)))


def recovery_choice(layers, moved: int, offloadable: int) -> dict[str, str]:
    """The first `moved` layers leave the DDR: the first `offloadable` of them to the tier, the
    rest recomputed fully; the others keep everything."""
    return {b: (OFFLOAD if i < min(moved, offloadable) else "full") if i < moved else "none"
            for i, b in enumerate(layers)}


def choose_recovery(cap, sizes, lists_for, blocks, per_layer: bool = True, mode: str = "off",
                    offloadable: int | None = None, tier_cap: int | None = None, walk=None):
    """`schedule.recompute: auto` with the tier: the fewest layers moved out of the DDR (the
    first ones of the stage) whose peak fits `cap`, the first `offloadable` of them offloaded
    (`mode` auto; prefer: all of them; off: none) and the rest recomputed fully; a choice
    whose tier bytes go over `tier_cap` offloads fewer. `lists_for(offloaded)`: the stage's
    lists with those layers' transfers in place; `walk(lists, sizes) -> (peak, tier peak)`.
    Returns ({layer: choice}, peak, tier peak). `per_layer=False`: no layer or every layer."""
    layers = [b for b in blocks if b.startswith("layers.")]
    top = {"off": 0, "prefer": len(layers), "auto": len(layers) if offloadable is None
           else offloadable}[mode]
    counts = range(len(layers) + 1) if per_layer else sorted({0, len(layers)})
    best = ({}, 0, 0)
    for k in counts:
        for j in range(min(k, top), -1, -1):  # as many offloaded as the tier holds
            choice = recovery_choice(layers, k, j)
            off = frozenset(b for b, c in choice.items() if c == OFFLOAD)
            peak, tier = walk(lists_for(off), sizes.with_recompute(choice))
            if tier_cap is None or tier <= tier_cap:
                break
        best = (choice, peak, tier)
        if cap is None or peak <= cap:
            return best
    return best


__all__ = ["TierRates", "choose_recovery", "hidden_layers", "recovery_choice"]
