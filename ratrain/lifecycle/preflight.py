"""Checks of a run that need no training done, made at start-up on every rank.

    problem = memory_problem(cfg, stage, local_ranks=2)   # None, or one line naming the fix

The memory plan of a stage is the lifecycle's memory model (`memory.simulate_peak`) played
over the policy's action lists with sizes from shapes (`memory.stage_sizes`, the planner's):
the static state, views, gradients, the activations each recompute choice keeps, messages. The
executor later plays the same model with sizes measured from the kernels' caches, which are
within 10-20% of these; so a plan refused here would not have fitted (the cap is compared with
the plan's peak less 10%), and one that passes may still meet the cap in a step, where the
ledger stops the job naming the tag. Against `recompute: auto` the plan is the most
recomputation allowed (every layer `full`). With no DDR cap (the `host` profile) the plan is
compared with the memory this node has available for its ranks (`MemAvailable`), which turns an
oversized micro-batch into a one-line refusal instead of the kernel's OOM killer.
"""

from __future__ import annotations

from ratrain.exec.spec import stage_blocks
from ratrain.lifecycle.memory import simulate_peak, stage_sizes
from ratrain.lifecycle.policies import StageInfo, as_policy
from ratrain.shim.platform import resolve_platform

TOLERANCE = 0.9  # the shape-based plan may overestimate the measured one by up to ~10-20%


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def available_memory() -> int | None:
    """Bytes the kernel says a new allocation can get on this node (`MemAvailable`)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        return None
    return None


def plan_peak(cfg, stage: int) -> int:
    """The memory plan's peak bytes of `stage` (shape-based; see the module)."""
    p = cfg.parallel
    blocks = stage_blocks(cfg.model, p.pp, stage, p.layers_per_stage)
    policy = as_policy(cfg.schedule.policy)
    info = StageInfo.from_config(cfg, stage, blocks, policy)
    mode = cfg.schedule.recompute
    names = [b.name for b in blocks]
    choice = {b: ("full" if mode == "auto" else mode) for b in names if b.startswith("layers.")}
    sizes = stage_sizes(cfg.model, p.micro_batch, cfg.precision, names, choice, info.shards)
    return simulate_peak(policy.steps(info, 2, flush=False), names, sizes)


def memory_problem(cfg, stage: int, local_ranks: int = 1) -> str | None:
    """Why `stage`'s memory plan cannot fit (the DDR cap, or the node's memory without one),
    in one line naming the fix; None when it may fit."""
    cap = resolve_platform(cfg.platform).ddr_bytes
    peak = plan_peak(cfg, stage)
    fixes = ("lower parallel.micro_batch, set schedule.recompute (full or auto), add pipeline "
             "stages (parallel.pp)")
    if cap is not None:
        if TOLERANCE * peak > cap:
            return (f"stage {stage}'s memory plan needs about {_gib(peak)} per rank, over the "
                    f"DDR cap of {_gib(cap)} (platform.ddr_bytes / profile "
                    f"{cfg.platform.profile}): {fixes}, or raise platform.ddr_bytes")
        return None
    avail = available_memory()
    if avail is not None and TOLERANCE * peak * local_ranks > avail:
        return (f"stage {stage}'s memory plan needs about {_gib(peak)} per rank, {local_ranks} "
                f"rank(s) on this node, and it has {_gib(avail)} available: {fixes}")
    return None


__all__ = ["available_memory", "memory_problem", "plan_peak"]
