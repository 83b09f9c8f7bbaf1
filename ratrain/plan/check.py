"""The memory plan of one run, checked before it starts (`python -m ratrain.train --dry-run`).

Every stage's predicted peak DDR bytes under the run's own layout, policy and recompute
(`auto`: the fewest layers fully recomputed that fit, as the executor would choose), from
shapes through the lifecycle's memory model (`ratrain.plan.memory`), against the platform's
cap. Nothing is allocated: the plan of a 70B job runs on a laptop.

    plan = run_plan(cfg)
    plan.check(rank)            # ConfigError naming the stage, its peak, the cap and the fixes
    print("\\n".join(plan.describe()))

The trainer checks every run at start-up the same way (`python -m ratrain.train`), refusing
only what cannot fit even allowing for the shape-based model's error (`tolerance=0.9`: the
executor's own, measured plan is within 10-20% of it), and, with no cap (the `host` profile),
against the memory the node has for its ranks (`available_memory`), which turns an oversized
micro-batch into a one-line refusal instead of the kernel's OOM killer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ratrain.config import Config, ConfigError
from ratrain.exec.spec import OFFLOAD
from ratrain.lifecycle.recovery import TierRates
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.plan.memory import fit_recompute, fit_recovery, stage_peaks, stage_tier_peaks
from ratrain.plan.steps import recompute_for
from ratrain.comm.topology import coords
from ratrain.shim.platform import class_of, rank_profile, resolve_platform


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class RunPlan:
    pp: int
    dp: int
    cap: int | None  # bytes per rank; None: no cap
    peaks: tuple[int, ...]  # predicted peak bytes per stage
    layers: tuple[int, ...]  # layers per stage
    full: tuple[int, ...] | None  # recompute auto: layers fully recomputed per stage
    cap_key: str = "platform.ddr_bytes"  # where the cap comes from (a class's own)
    placement: str = "pp"
    offloaded: tuple[int, ...] | None = None  # offload.*: layers offloaded per stage
    tier_peaks: tuple[int, ...] | None = None  # ... and bytes in the tier per stage (a rank)
    tier_cap: int | None = None  # a rank's share of the tier (platform.tier_bytes)

    def over(self, stage: int) -> bool:
        return self.cap is not None and self.peaks[stage] > self.cap

    def check(self, rank: int, tolerance: float = 1.0, available: int | None = None,
              local_ranks: int = 1) -> None:
        """Raise ConfigError when rank `rank`'s stage does not fit the cap (its peak times
        `tolerance` over it); with no cap, when `local_ranks` such peaks exceed `available`."""
        stage, _ = coords(rank, self.pp, self.dp, self.placement)
        peak = tolerance * self.peaks[stage]
        if self.cap is None and available is not None and peak * local_ranks > available:
            raise ConfigError(
                f"rank {rank} (stage {stage}, {self.layers[stage]} layers) is predicted to need "
                f"{_gib(self.peaks[stage])}, with {local_ranks} rank(s) on this node that have "
                f"{_gib(available)} of memory available: lower parallel.micro_batch, set "
                "schedule.recompute=full, or raise parallel.pp"
            )
        if self.cap is not None and peak > self.cap:
            raise ConfigError(
                f"rank {rank} (stage {stage}, {self.layers[stage]} layers) is predicted to need "
                f"{_gib(self.peaks[stage])}, over the DDR cap of {_gib(self.cap)} "
                f"({self.cap_key}): set schedule.recompute=auto (or full), raise parallel.pp, "
                "lower parallel.micro_batch, or use schedule.policy=ratrain with dp > 1 (sharded "
                "optimizer state)"
            )

    def check_device(self, rank: int, device, local_ranks: int = 1) -> None:
        """Raise ConfigError when rank `rank`'s stage, times the node's ranks that share its
        card (`Device.sharing`), is predicted over the card's memory (`run.device: gpu`)."""
        if device.memory_bytes is None:
            return
        stage, _ = coords(rank, self.pp, self.dp, self.placement)
        sharing = device.sharing(local_ranks)
        if self.peaks[stage] * sharing > device.memory_bytes:
            raise ConfigError(
                f"rank {rank} (stage {stage}, {self.layers[stage]} layers) is predicted to need "
                f"{_gib(self.peaks[stage])} on {device.describe()}, shared by {sharing} rank(s): "
                "over the card (run.device: gpu); raise parallel.pp, lower parallel.micro_batch, "
                "set schedule.recompute=auto, or run fewer ranks per GPU")

    def describe(self) -> list[str]:
        cap = "no cap" if self.cap is None else f"cap {_gib(self.cap)}"
        lines = [f"memory plan (predicted peak per rank, {cap}):"]
        for s, peak in enumerate(self.peaks):
            rec = "" if self.full is None else f", {self.full[s]} fully recomputed"
            if self.tier_peaks is not None:
                rec += (f", {self.offloaded[s]} offloaded, {_gib(self.tier_peaks[s])} in the "
                        "tier" + ("" if self.tier_cap is None else f" of {_gib(self.tier_cap)}"))
            verdict = "OVER THE CAP" if self.over(s) else "fits"
            lines.append(f"  stage {s} ({self.layers[s]} layers{rec}) x {self.dp} replicas: "
                         f"{_gib(peak)}  {verdict}")
        return lines


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


def run_plan(cfg: Config, rank: int | None = None) -> RunPlan:
    """The predicted per-stage peaks of `cfg` as it would run (see the module doc): of replica
    0 against the profile's cap, or with `rank`, of that rank's replica (its micro-batches)
    against its class's cap (`platform.classes`)."""
    m, p, s = cfg.model, cfg.parallel, cfg.schedule
    replica, cap_key = 0, "platform.ddr_bytes"
    if rank is None:
        cap = resolve_platform(cfg.platform).ddr_bytes
    else:
        _, replica = coords(rank, p.pp, p.dp, p.placement)
        cap = rank_profile(cfg.platform, rank).ddr_bytes
        cls = class_of(cfg.platform, rank)
        if cls is not None and cls.ddr_bytes is not None:
            i = [c.name for c in cfg.platform.classes].index(cls.name)
            cap_key = f"platform.classes[{i}].ddr_bytes of class {cls.name}"
    plan = PipelinePlan.from_config(cfg, replica=replica)
    blocks = plan.blocks
    layers = tuple(sum(1 for b in names if b.startswith("layers.")) for names in blocks)
    cap = int(cap) if cap is not None else None
    if cfg.offload.enabled:
        return _tier_plan(cfg, plan, cap, layers, cap_key, rank)
    full = None
    if s.recompute == "auto":
        full, peaks, _ = fit_recompute(plan, m, p.micro_batch, cap)
        full = tuple(full)
    else:
        peaks = stage_peaks(plan, m, p.micro_batch, recompute_for(blocks, s.recompute))
    return RunPlan(p.pp, p.dp, cap, tuple(peaks), layers, full, cap_key, p.placement)


def _tier_plan(cfg: Config, plan, cap, layers, cap_key, rank) -> RunPlan:
    """`run_plan` of a run with a memory tier (`offload.*`): each stage's recovery as the
    executor chooses it (keep / recompute / offload), its DDR peak and its bytes in the tier."""
    m, p, s = cfg.model, cfg.parallel, cfg.schedule
    prof = resolve_platform(cfg.platform) if rank is None else rank_profile(cfg.platform, rank)
    tier_cap = prof.tier.rank_share(prof.ranks_per_node) if prof.tier is not None else None
    if s.recompute == "auto":
        plan, choices, peaks, tiers, _ = fit_recovery(
            plan, m, p.micro_batch, cap, cfg.offload.activations, TierRates.of_profile(prof),
            tier_cap)
    else:
        mode = OFFLOAD if cfg.offload.activations == "all" else s.recompute
        choices = recompute_for(plan.blocks, "none" if mode == OFFLOAD else mode)
        choices = [{b: mode for b in c} for c in choices]
        peaks = stage_peaks(plan, m, p.micro_batch, choices)
        tiers = stage_tier_peaks(plan, m, p.micro_batch, choices)
    count = [tuple(sum(1 for c in ch.values() if c == kind) for ch in choices)
             for kind in ("full", OFFLOAD)]
    return RunPlan(p.pp, p.dp, cap, tuple(peaks), layers, count[0], cap_key, p.placement,
                   count[1], tuple(tiers), tier_cap)


__all__ = ["RunPlan", "available_memory", "run_plan"]
