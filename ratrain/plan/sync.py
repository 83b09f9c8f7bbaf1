"""Full against partial synchronization for one job on one link, by the simulator.

    rows = sync_table(cfg, periods=(2, 4, 8))        # cfg's layout, policy and platform
    for r in rows: r.label, r.step_s, r.tokens_per_s, r.exposed_s, r.averaged_bytes, r.speedup

What `python -m ratrain.plan --sync-periods 2,4,8` prints. The rows: full synchronization under
the config's policy; when that policy shards the optimizer state over the replicas (which
partial synchronization cannot, `lifecycle.passes.partial.PartialSync.check`), full synchronization with
it whole too; then partial synchronization at each period H under the unsharded policy. Each
row's step is the simulator's (a whole period's mean for partial), with the data-parallel
communication a step moves (gradients all-reduced, or the blocks a step averages) and the
exposed part of it; `speedup` is over the fastest full-synchronization row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ratrain.config import Config, with_overrides
from ratrain.exec.spec import block_role
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.lifecycle.passes.partial import AverageParams
from ratrain.lifecycle.schedule import SyncGrad, expand
from ratrain.plan.cost import CostModel
from ratrain.plan.simulate import simulate_config


@dataclass(frozen=True)
class SyncRow:
    label: str
    step_s: float  # in the platform's time (x platform.time_scale: this host's under emulation)
    tokens_per_s: float
    exposed_s: float  # the largest exposed communication of any rank, per step
    synced_bytes: float  # fp32 bytes a step all-reduces across the replicas (the busiest stage)
    speedup: float = 1.0  # over the fastest full-synchronization row


def synced_bytes(plan: PipelinePlan, cost: CostModel, steps: int) -> float:
    """The fp32 bytes the busiest stage all-reduces across its replicas per step (gradients
    under full synchronization, masters of the averaged blocks under partial), over `steps`."""
    per_stage = []
    for s in range(plan.pp):
        n = 0.0
        for lst in plan.stage_steps(s, steps):
            for a in lst:
                for _, e in expand(a, plan.blocks[s]):
                    if isinstance(e, (SyncGrad, AverageParams)):
                        n += sum(cost.grad_bytes(block_role(b)) for b in e.blocks)
        per_stage.append(n / steps)
    return max(per_stage)


def sync_table(cfg: Config, periods=(2, 4, 8), cost: CostModel | None = None) -> list[SyncRow]:
    """The rows (see the module) for `cfg`'s layout, policy, recompute and platform."""
    cost = cost or CostModel.from_config(cfg)
    scale = cfg.platform.time_scale
    variants = [(f"full ({cfg.schedule.policy})", with_overrides(cfg, ["sync.mode=full"]))]
    plan = PipelinePlan.from_config(variants[0][1])
    unsharded = cfg
    if plan.shards > 1:
        unsharded = with_overrides(cfg, ["schedule.shard_optimizer=false"])
        variants.append(("full, optimizer state whole",
                         with_overrides(unsharded, ["sync.mode=full"])))
    for h in periods:
        variants.append((f"partial, H = {h}",
                         with_overrides(unsharded, ["sync.mode=partial", f"sync.period={h}"])))
    rows = []
    for label, c in variants:
        res = simulate_config(c, cost, with_memory=False)
        p = PipelinePlan.from_config(c)
        rows.append(SyncRow(label, res.step_s * scale, res.tokens_per_s / scale,
                            res.comm_exposed_s * scale, synced_bytes(p, cost, p.period)))
    best_full = min(r.step_s for r, (_, c) in zip(rows, variants) if not c.sync.partial)
    return [replace(r, speedup=best_full / r.step_s) for r in rows]


__all__ = ["SyncRow", "sync_table", "synced_bytes"]
