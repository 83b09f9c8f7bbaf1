"""What the planner plays for a layout: its `PipelinePlan` and recompute choices.

    plan = PipelinePlan.from_config(cfg, "ratrain", pp=4, dp=8, m=16)  # lifecycle.pipeline
    recompute = recompute_for(plan.blocks, "auto", [3, 0])  # per stage: layer -> choice

A bare order (`1f1b-bare`, `gpipe-bare`: the pipeline alone, the reference the lifecycle is
measured against) is a `Policy` with no lifecycle, played like any other.
"""

from __future__ import annotations

from ratrain.lifecycle.recovery import recovery_choice


def recompute_for(blocks, recompute: str, full_layers: list[int] | None = None):
    """Per stage, layer -> recompute choice. `recompute`: none | selective | full, or (`auto`,
    or any with `full_layers`) per-stage counts of fully recomputed layers (the first n layers
    of stage s); `auto` without counts recomputes nothing."""
    out = []
    for s, names in enumerate(blocks):
        layers = [b for b in names if b.startswith("layers.")]
        if full_layers is not None:
            n = full_layers[s]
            out.append({b: ("full" if i < n else "none") for i, b in enumerate(layers)})
        elif recompute in ("none", "auto", "selective", "full"):
            out.append(dict.fromkeys(layers, "none" if recompute == "auto" else recompute))
        else:
            raise ValueError(f"recompute={recompute!r} is not one of none, selective, full, auto")
    return out


def recovery_for(blocks, full_layers, offload_layers):
    """Per stage, layer -> recovery choice of `schedule.recompute: auto` with the memory tier:
    the first `offload_layers[s]` layers of stage s offloaded, the next `full_layers[s]`
    recomputed fully (`lifecycle.recovery.recovery_choice`), the rest kept."""
    return [recovery_choice([b for b in names if b.startswith("layers.")], f + o, o)
            for names, f, o in zip(blocks, full_layers, offload_layers)]


__all__ = ["recompute_for", "recovery_for"]
