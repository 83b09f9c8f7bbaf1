"""Calibration: fit the cost model's compute rate to a measured run.

`calibrate(cfg, run_dir)` reads the run's `metrics.jsonl` (and `trace.json` when there is one)
and returns the rates with `compute_flops` fitted so that the simulator (`plan.simulate`)
reproduces the measured step; the simulator then predicts other layouts and scales from it.
`fit_compute_rate` is the bisection it (and `python -m ratrain.plan --match-tokens-per-s`) uses.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import yaml

from ratrain.config import Config
from ratrain.job.metrics import read_curve
from ratrain.plan.cost import CostModel, Rates
from ratrain.plan.simulate import simulate_config
from ratrain.shim.platform import load_profile


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` found: the fitted rates and how well they explain the run."""

    rates: Rates
    measured_step_s: float
    predicted_step_s: float  # with the fitted rates
    steps_used: int
    method: str  # "trace" (compute events) or "step" (fit of the simulated step time)

    @property
    def residual(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1.0


def read_metrics(path: str) -> list[dict]:
    """The per-step records of a run's `metrics.jsonl` (a run directory or the file itself)."""
    return read_curve(path, "step_time_s")  # the one reader (ratrain.job.metrics)


def measured_step_time(records: list[dict], skip: int = 1) -> tuple[float, int]:
    """Median `step_time_s` of the steps after the first `skip` (warm-up), skipped fp16 steps
    included (they cost the same compute). Returns (seconds, steps used)."""
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    if len(times) > skip:
        times = times[skip:]
    if not times:
        raise ValueError("no step_time_s in the metrics: nothing to calibrate from")
    times = sorted(times)
    n = len(times)
    med = times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])
    return float(med), n


def trace_compute_seconds(trace_path: str) -> dict[int, float]:
    """Per row (rank) of a Chrome trace, the seconds spent in compute events (`cat` "compute",
    or names starting with F / B for forward / backward); {} when the trace has none."""
    with open(trace_path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    out: dict[int, float] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = str(e.get("cat", ""))
        if cat != "compute" and not (cat == "" and str(e.get("name", ""))[:1] in "FB"):
            continue
        tid = int(e.get("pid", 0)) if "rank" not in e.get("args", {}) else int(e["args"]["rank"])
        out[tid] = out.get(tid, 0.0) + float(e.get("dur", 0.0)) * 1e-6
    return out


def calibrate(cfg: Config, run_dir: str, cost: CostModel | None = None, policy: str | None = None,
              skip: int = 1) -> Calibration:
    """Fit the compute rate to a measured run of `cfg` in `run_dir`.

    With a `trace.json` holding compute events, the rate is the busiest rank's predicted compute
    flops over its measured compute seconds (direct). Otherwise it is the rate at which the
    simulated step time of this very layout equals the measured median step time (a bisection:
    the simulated time falls monotonically as the rate rises). Link and memory rates are kept.
    """
    if cost is None:
        try:
            cost = CostModel.from_config(cfg)
        except ValueError:  # e.g. the host profile models no link: start from mt3000's figures
            cost = CostModel.from_config(cfg, Rates.from_profile(load_profile("mt3000")))
    measured, n = measured_step_time(read_metrics(run_dir), skip)
    steps = max(1, n)
    trace = os.path.join(run_dir, "trace.json") if os.path.isdir(run_dir) else ""
    if trace and os.path.exists(trace):
        per_rank = trace_compute_seconds(trace)
        if per_rank:
            sim = simulate_config(cfg, cost, policy)
            busiest = max(sim.ranks, key=lambda r: r.compute_s)
            flops = busiest.compute_s * cost.rates.compute_flops  # seconds x rate = flops
            measured_compute = max(per_rank.values()) / max(1, _trace_steps(run_dir, steps))
            rate = flops / measured_compute
            rates = cost.rates.with_(
                "compute_flops", rate, f"calibrated from {trace} (compute events)"
            )
            pred = simulate_config(cfg, cost.with_rates(rates), policy).step_s
            return Calibration(rates, measured, pred, steps, "trace")

    def step_at(rate: float) -> float:
        r = cost.rates.with_("compute_flops", rate, "calibration")
        return simulate_config(cfg, cost.with_rates(r), policy).step_s

    rate = fit_compute_rate(step_at, measured)
    rates = cost.rates.with_(
        "compute_flops", rate, f"calibrated from {run_dir} (median step time of {steps} steps)"
    )
    return Calibration(rates, measured, step_at(rate), steps, "step")


def fit_compute_rate(step_at, target_s: float, lo: float = 1e3, hi: float = 1e18) -> float:
    """The compute rate at which `step_at(rate)` (a simulated step time, falling as the rate
    rises) equals `target_s`, by bisection on a log scale; `hi` when even infinitely fast compute
    is too slow (communication alone exceeds the target)."""
    if step_at(hi) > target_s:
        return hi
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if step_at(mid) > target_s:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-6:
            break
    return math.sqrt(lo * hi)


def _trace_steps(run_dir: str, default: int) -> int:
    """How many steps a run's trace covers (`run.steps` of its resolved config when readable)."""
    path = os.path.join(run_dir, "config.yaml")
    try:
        with open(path) as f:
            return int(yaml.safe_load(f)["run"]["steps"])
    except Exception:  # noqa: BLE001 - a missing or partial config: fall back
        return default


__all__ = [
    "Calibration",
    "calibrate",
    "fit_compute_rate",
    "measured_step_time",
    "read_metrics",
    "trace_compute_seconds",
]
