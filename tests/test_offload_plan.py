"""The memory tier in the profile, the simulator and the planner (issue 31)."""

from __future__ import annotations

import pytest

from ratrain.config import load_config
from ratrain.exec.layers import layer_cache_nbytes
from ratrain.plan import __main__ as plan_main
from ratrain.plan.cost import CostModel
from ratrain.plan.search import Layout, cap_bytes, plan_layout
from ratrain.plan.simulate import simulate_config
from ratrain.plan.tierplan import plan_layout_tier
from ratrain.shim.platform import ProfileError, load_profile, resolve_platform
from ratrain.shim.tier import parse_tiers

SETS = ["platform.profile=mt3000", "parallel.pp=2", "parallel.num_micro_batches=4",
        "schedule.recompute=auto", "offload.activations=prefer"]


def test_profiles_state_their_tiers_with_sources():
    prof = load_profile("mt3000")
    assert set(prof.tiers) == {"host", "nvme"}
    for t in prof.tiers.values():
        assert all(t.source(k) for k in ("bytes", "bandwidth", "latency"))
    cfg = load_config("tiny", ["platform.profile=mt3000", "platform.tier=nvme",
                               "platform.tier_bandwidth=1e9"])
    tier = resolve_platform(cfg.platform).tier
    assert tier.bandwidth == 1e9 and tier.source("bandwidth") == "config: platform.tier_bandwidth"
    assert tier.bytes == prof.tiers["nvme"].bytes and tier.rank_share(4) == tier.bytes // 4
    assert resolve_platform(load_config("tiny").platform).tier is None
    with pytest.raises(ProfileError, match="platform.tier='ssd'.*host, nvme"):
        resolve_platform(load_config("tiny", ["platform.profile=mt3000",
                                              "platform.tier=ssd"]).platform)
    with pytest.raises(ValueError, match="tiers.x.bandwidth needs `value`"):
        parse_tiers({"x": {"bytes": {"value": 1, "source": "s"}, "latency": {
            "value": 0, "source": "s"}}}, "p.yaml")


def _tiny(bandwidth: float, cap_frac: float = 0.75):
    """The tiny job on mt3000 at pp 2 with a cap that stage 0 fits only by moving layers."""
    base = load_config("tiny", [*SETS, f"platform.tier_bandwidth={bandwidth}"])
    lay = Layout(2, 1, base.parallel.micro_batch, 4)
    cost = CostModel.from_config(base)
    none = plan_layout(base, lay, "ratrain", cost, None, recompute=("none",))[0].peak_bytes
    return base, lay, cost, int(cap_frac * none)


def test_the_planner_offloads_what_the_tier_hides_and_recomputes_the_rest():
    cfg, lay, cost, cap = _tiny(1e14)  # a tier faster than anything: offloading is free
    fast = plan_layout_tier(cfg, lay, "ratrain", cost, cap, "auto", "off")
    rec = plan_layout_tier(cfg, lay, "ratrain", cost, cap, "off", "off")
    assert sum(fast.layout.offload_layers) > 0 and sum(fast.layout.recompute_layers) == 0
    assert sum(rec.layout.recompute_layers) > 0 and sum(rec.layout.offload_layers) == 0
    assert fast.peak_bytes <= cap and rec.peak_bytes <= cap
    assert fast.tokens_per_s > rec.tokens_per_s  # no recomputation, nothing exposed
    assert fast.result.tier_exposed_s < 1e-6 * fast.step_s
    # each offloaded layer moves its activations out and back per micro-batch
    act = layer_cache_nbytes(cfg.model, lay.micro_batch, cfg.precision, "none")
    per_stage = [2 * n * lay.num_micro_batches * act for n in fast.layout.offload_layers]
    assert sorted(r.tier_bytes for r in fast.result.ranks) == sorted(per_stage)
    slow, lay, cost, cap = _tiny(1e3)  # a tier slower than anything: auto recomputes
    auto = plan_layout_tier(slow, lay, "ratrain", cost, cap, "auto", "off")
    prefer = plan_layout_tier(slow, lay, "ratrain", cost, cap, "prefer", "off")
    assert sum(auto.layout.offload_layers) == 0
    assert prefer.result.tier_exposed_s > 0 and prefer.tokens_per_s < auto.tokens_per_s


def test_the_simulator_plays_a_runs_own_choice():
    cfg, lay, cost, cap = _tiny(1e14)
    cfg = load_config("tiny", [*SETS, "platform.tier_bandwidth=1e14", f"platform.ddr_bytes={cap}"])
    off = simulate_config(cfg, recompute_layers=[0, 0], offload_layers=[2, 1], with_memory=False)
    full = simulate_config(cfg, recompute_layers=[2, 1], offload_layers=[0, 0],
                           with_memory=False)
    assert off.step_s < full.step_s and off.tier_s > 0 and full.tier_s == 0


def test_plan_prints_the_tier_only_when_stated(capsys):
    args = ["--config", "tiny", "--set", "platform.profile=mt3000", "--clusters", "2",
            "--policy", "ratrain", "--placement", "pp", "--scaling", "", "--micro-batches", "1"]
    assert plan_main.main(args) == 0
    without = capsys.readouterr().out
    assert "memory tier" not in without
    assert plan_main.main(args + ["--tier", "host"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(without.rsplit("\n(planned in", 1)[0])  # today's plan, unchanged
    assert "== the memory tier host: per node, shared by its 4 ranks ==" in out
    assert "best with the tier host" in out and "today's best" in out
    assert cap_bytes(load_config("tiny", ["platform.profile=mt3000"])) == 20 * 2**30
