"""What the planner plays for a layout: every stage's blocks, action lists and recompute choices.

    blocks = stage_block_names(model, pp)                 # [("embed", "layers.0", ...), ...]
    lists = policy_steps("ratrain", blocks, m, "fp16", model, steps=2, shards=dp)
    recompute = recompute_for(blocks, "auto", [3, 0])     # per stage: layer -> choice

`policy_steps` also knows `1f1b-bare` / `gpipe-bare`: the pipeline order alone, without any
lifecycle action (the reference the lifecycle is measured against).
"""

from __future__ import annotations

from ratrain.config import Config, ModelConfig
from ratrain.exec.params import GRAD_BYTES_PER_PARAM
from ratrain.exec.spec import block_params, block_role, stage_blocks
from ratrain.lifecycle.policies import POLICIES, Policy, StageInfo, pipeline_steps, policy_of
from ratrain.lifecycle.schedule import gpipe, one_f_one_b

BARE = {"1f1b-bare": one_f_one_b, "gpipe-bare": gpipe}


def stage_block_names(model: ModelConfig, pp: int, layers_per_stage=None) -> list[tuple[str, ...]]:
    """Block names of every stage (embed on the first, head on the last)."""
    return [tuple(b.name for b in stage_blocks(model, pp, s, layers_per_stage))
            for s in range(pp)]


def plan_policy(cfg: Config, policy: str | Policy | None = None) -> str | Policy:
    """The policy the planner plays: a `BARE` order's name as is; a preset's name with the
    component keys `cfg.schedule` sets (`schedule.sync`, ...; `lifecycle.policies.policy_of`);
    None: the config's own policy."""
    if isinstance(policy, Policy) or policy in BARE:
        return policy
    return policy_of(cfg.schedule, policy)


def per_layer_recovery(policy: str | Policy) -> bool:
    """Whether `auto` recompute picks layers one at a time (the policy's `recovery` component;
    a bare order: yes)."""
    return isinstance(policy, str) or policy.components.recovery == "per-layer"


def policy_steps(policy: str | Policy, blocks, m: int, precision: str, model: ModelConfig | None = None,
                 steps: int = 2, shards: int = 1):
    """`steps` consecutive steps of every stage under `policy` (a policy name or a `BARE`
    order): `out[k][stage]`. `model` sizes the blocks' gradients (Megatron's buckets); None:
    zero bytes."""
    pp = len(blocks)
    if isinstance(policy, str) and policy in BARE:
        return [[BARE[policy](pp, s, m) for s in range(pp)]] * steps
    if not isinstance(policy, Policy) and policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join((*POLICIES, *BARE))}")
    infos = [StageInfo(pp, s, m, tuple(names),
                       tuple(GRAD_BYTES_PER_PARAM * block_params(model, block_role(b))
                             if model else 0 for b in names), precision, shards)
             for s, names in enumerate(blocks)]
    return pipeline_steps(policy if isinstance(policy, Policy) else Policy(policy), infos, steps)


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


def plan_shards(cfg: Config, policy: str | Policy | None, dp: int) -> int:
    """The dp segments of the optimizer state `policy` (`plan_policy`) uses at `dp` replicas,
    as the runtime does (a sharding policy: dp; otherwise 1)."""
    policy = plan_policy(cfg, policy)
    return 1 if isinstance(policy, str) else policy.shards(dp)


__all__ = ["BARE", "per_layer_recovery", "plan_policy", "plan_shards", "policy_steps", "recompute_for", "stage_block_names"]
