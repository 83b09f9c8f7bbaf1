"""The cost model: what each action of a step costs on the platform, in seconds.

Everything here is a closed-form function of the model shape, the layout and a few platform
rates (`Rates`), each carrying its source:

- compute: a block's forward / backward time is its flops / `compute_flops` (one rank's sustained
  rate on this model's kernels). Flops per token are those of `ModelConfig.flops_per_token` split
  by block (`exec.spec.block_cost`): forward = 1/3, backward = 2/3 of a block's training flops.
  Recomputation adds a forward (`input`, full) or the attention core's forward (`selective`) to
  the backward;
- point-to-point: one message of n bytes costs `latency + n / bandwidth` (the shim's link model);
- all-reduce across `p` replicas (the latency-bandwidth model of `ratrain.comm`):
  ring `2 (p-1) (a + n / (p B))`, binomial tree (reduce then broadcast) `2 ceil(log2 p) (a + n / B)`,
  `auto` the cheaper of the two (the tree wins for small messages and many ranks);
- memory-bound lifecycle work: an AdamW update of one block moves 28 bytes per parameter (reads
  fp32 master, grad, m, v; writes master, m, v) and materialising an fp16 view moves 6 (reads the
  fp32 master, writes fp16), both at `mem_bandwidth`.

`calibrate(...)` fits the compute rate to a measured run (its `metrics.jsonl`, and `trace.json`
when there is one) so that the simulator then predicts other layouts and scales from it.

    cost = CostModel.from_config(cfg)            # profile from cfg.platform (mt3000, host, ...)
    cost.forward_time("layer"), cost.allreduce_time(4 * n, 64), cost.p2p_time(cost.activation_bytes)
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, replace

from ratrain.config import Config, ModelConfig
from ratrain.exec.spec import block_cost, model_blocks

# Not in the platform profile (the shim does not model DDR bandwidth): an assumption, overridable.
DEFAULT_MEM_BANDWIDTH = 25.6e9
MEM_BANDWIDTH_SOURCE = (
    "assumed (not public): one DDR4-3200 channel per cluster = 25.6e9 B/s, for the "
    "memory-bound AdamW update and fp16 view materialisation"
)
ADAMW_BYTES_PER_PARAM = 28  # read master, grad, m, v (4 x 4 B), write master, m, v (3 x 4 B)
VIEW_BYTES_PER_PARAM = 6  # read the fp32 master, write the fp16 view
ALGOS = ("ring", "tree", "auto")


@dataclass(frozen=True)
class Rates:
    """One rank's platform rates (per cluster) with their sources."""

    compute_flops: float  # sustained flop/s on model kernels
    link_bandwidth: float  # bytes/s of the rank's outgoing link
    link_latency: float  # s per message
    mem_bandwidth: float = DEFAULT_MEM_BANDWIDTH  # bytes/s, DDR
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for k in ("compute_flops", "link_bandwidth", "mem_bandwidth"):
            if not getattr(self, k) or getattr(self, k) <= 0:
                raise ValueError(f"Rates.{k}={getattr(self, k)!r} must be > 0")
        if self.link_latency < 0:
            raise ValueError(f"Rates.link_latency={self.link_latency!r} must be >= 0")

    def source(self, key: str) -> str:
        return dict(self.sources).get(key, "")

    def with_(self, key: str, value: float, source: str) -> Rates:
        """A copy with one rate replaced and its source recorded."""
        src = dict(self.sources)
        src[key] = source
        return replace(self, **{key: float(value)}, sources=tuple(src.items()))

    @classmethod
    def from_profile(cls, profile, mem_bandwidth: float | None = None) -> Rates:
        """From a `ratrain.shim.platform.Profile`; a value it does not model is an error (the
        planner needs every rate: use the `mt3000` profile or set platform.* in the config)."""
        missing = [
            k
            for k in ("compute_flops", "link_bandwidth", "link_latency")
            if getattr(profile, k) is None
        ]
        if missing:
            raise ValueError(
                f"platform profile {profile.name!r} does not model {', '.join(missing)}: the "
                "planner needs them; use platform.profile=mt3000 or set platform.<key>"
            )
        mb = mem_bandwidth or DEFAULT_MEM_BANDWIDTH
        return cls(
            compute_flops=float(profile.compute_flops),
            link_bandwidth=float(profile.link_bandwidth),
            link_latency=float(profile.link_latency),
            mem_bandwidth=float(mb),
            sources=(
                ("compute_flops", profile.source("compute_flops")),
                ("link_bandwidth", profile.source("link_bandwidth")),
                ("link_latency", profile.source("link_latency")),
                ("mem_bandwidth", "given" if mem_bandwidth else MEM_BANDWIDTH_SOURCE),
            ),
        )

    @classmethod
    def from_config(cls, cfg: Config, mem_bandwidth: float | None = None) -> Rates:
        """The profile named by `cfg.platform`, with the config's overrides."""
        from ratrain.shim.platform import resolve_platform

        return cls.from_profile(resolve_platform(cfg.platform), mem_bandwidth)


# --------------------------------------------------------------------------------------------
# Collectives and messages (pure functions of the latency-bandwidth model)
# --------------------------------------------------------------------------------------------


def p2p_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """One message: latency + n / B."""
    return latency + nbytes / bandwidth


def ring_allreduce_time(nbytes: float, p: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce (reduce-scatter + all-gather): 2 (p-1) (a + n / (p B)); 0 for p = 1."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * (latency + nbytes / (p * bandwidth))


def tree_allreduce_time(nbytes: float, p: int, bandwidth: float, latency: float) -> float:
    """Binomial-tree reduce then broadcast: 2 ceil(log2 p) (a + n / B); 0 for p = 1."""
    if p <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * (latency + nbytes / bandwidth)


def allreduce_terms(nbytes: float, p: int, algo: str, bandwidth: float, latency: float):
    """(latency part in s, bytes this rank puts on its link) of one all-reduce, for a simulator
    that shares a link between flows: time alone = latency part + wire bytes / B."""
    if algo not in ALGOS:
        raise ValueError(f"all-reduce algo {algo!r} is not one of {', '.join(ALGOS)}")
    if p <= 1:
        return 0.0, 0.0
    if algo == "auto":
        ring = ring_allreduce_time(nbytes, p, bandwidth, latency)
        tree = tree_allreduce_time(nbytes, p, bandwidth, latency)
        algo = "ring" if ring <= tree else "tree"
    if algo == "ring":
        return 2 * (p - 1) * latency, 2 * (p - 1) * nbytes / p
    steps = 2 * math.ceil(math.log2(p))
    return steps * latency, steps * nbytes


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Times of one rank's actions for one model, micro-batch size and precision.

    All compute figures are per micro-batch (`micro_batch * seq_len` tokens).
    """

    model: ModelConfig
    rates: Rates
    micro_batch: int = 1
    precision: str = "fp16"
    algo: str = "auto"  # gradient all-reduce algorithm

    @classmethod
    def from_config(cls, cfg: Config, rates: Rates | None = None, algo: str = "auto") -> CostModel:
        return cls(
            cfg.model,
            rates or Rates.from_config(cfg),
            cfg.parallel.micro_batch,
            cfg.precision,
            algo,
        )

    def with_rates(self, rates: Rates) -> CostModel:
        return replace(self, rates=rates)

    # -- sizes --------------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.micro_batch * self.model.seq_len

    @property
    def act_dtype_bytes(self) -> int:
        return 2 if self.precision == "fp16" else 4

    @property
    def activation_bytes(self) -> int:
        """Bytes of one micro-batch's activation (or its gradient) crossing a stage boundary."""
        return self.tokens * self.model.hidden * self.act_dtype_bytes

    def block_params(self, kind: str) -> int:
        """Parameters of one block of `kind` ("embed" | "layer" | "head")."""
        return block_params(self.model, kind)

    def grad_bytes(self, kind: str) -> int:
        """fp32 gradient bytes of one block (what its all-reduce moves)."""
        return 4 * self.block_params(kind)

    # -- compute --------------------------------------------------------------------------------

    def block_flops(self, kind: str) -> float:
        """Training flops (forward + backward) of one block for one micro-batch."""
        return block_cost(self.model, kind) * self.tokens

    def recompute_flops(self, kind: str, keep: str) -> float:
        """Extra flops the backward spends because the forward kept only part of the cache."""
        if kind != "layer" or keep == "all":
            return 0.0
        if keep == "input":  # full recomputation: the whole forward again
            return self.block_flops(kind) / 3.0
        if keep == "selective":  # the attention core's forward (QK^T and PV, causal half)
            return 2.0 * self.model.seq_len * self.model.hidden * self.tokens
        raise ValueError(f"keep={keep!r} is not one of all, selective, input")

    def _compute_time(self, kind: str, flops: float) -> float:
        if kind == "embed":  # a gather: memory-bound
            return self.tokens * self.model.hidden * self.act_dtype_bytes / self.rates.mem_bandwidth
        return flops / self.rates.compute_flops

    def forward_time(self, kind: str) -> float:
        return self._compute_time(kind, self.block_flops(kind) / 3.0)

    def backward_time(self, kind: str, keep: str = "all") -> float:
        """Backward of one block, including the recomputation its `keep` implies."""
        flops = 2.0 * self.block_flops(kind) / 3.0 + self.recompute_flops(kind, keep)
        return self._compute_time(kind, flops)

    # -- communication ----------------------------------------------------------------------------

    def p2p_time(self, nbytes: float | None = None) -> float:
        """One activation (default) or any message between neighbouring stages."""
        n = self.activation_bytes if nbytes is None else nbytes
        return p2p_time(n, self.rates.link_bandwidth, self.rates.link_latency)

    def allreduce_time(self, nbytes: float, p: int, algo: str | None = None) -> float:
        """One all-reduce of `nbytes` across `p` ranks, alone on the link."""
        lat, wire = self.allreduce_terms(nbytes, p, algo)
        return lat + wire / self.rates.link_bandwidth

    def allreduce_terms(self, nbytes: float, p: int, algo: str | None = None):
        return allreduce_terms(
            nbytes, p, algo or self.algo, self.rates.link_bandwidth, self.rates.link_latency
        )

    # -- memory-bound lifecycle work ---------------------------------------------------------------

    def update_time(self, kind: str, shards: int = 1) -> float:
        """AdamW of one block (fp32 masters and moments), or of this replica's segment of it
        (the largest, ceil(n / shards)) when the optimizer state is sharded."""
        n = -(-self.block_params(kind) // shards)
        return ADAMW_BYTES_PER_PARAM * n / self.rates.mem_bandwidth

    def view_time(self, kind: str, shards: int = 1) -> float:
        """Materialise one block's fp16 working view (0 in fp32: the view is the master), or
        cast this replica's segment of it when sharded (the rest arrives by all-gather)."""
        if self.precision != "fp16":
            return 0.0
        n = -(-self.block_params(kind) // shards)
        return VIEW_BYTES_PER_PARAM * n / self.rates.mem_bandwidth

    def view_bytes(self, kind: str) -> int:
        """Bytes of one block's working view (fp16, or the fp32 copy when sharded in fp32):
        what the sharded view all-gather assembles."""
        return (2 if self.precision == "fp16" else 4) * self.block_params(kind)

    def ring_half_terms(self, nbytes: float, p: int):
        """(latency part, wire bytes) of one ring reduce-scatter or all-gather of `nbytes`
        across `p` ranks: (p-1) a and (p-1) n / p (half a ring all-reduce)."""
        if p <= 1:
            return 0.0, 0.0
        return (p - 1) * self.rates.link_latency, (p - 1) * nbytes / p


@functools.lru_cache(maxsize=256)
def block_params(m: ModelConfig, kind: str) -> int:
    """Parameters of one block of `kind` ("embed" | "layer" | "head") of model `m`."""
    for b in model_blocks(replace(m, layers=1)):
        if b.kind == kind:
            return b.size
    raise ValueError(f"unknown block kind {kind!r}")


def block_kind(name: str) -> str:
    """`embed` / `layers.7` / `head` -> "embed" / "layer" / "head"."""
    return "layer" if name.startswith("layers.") else name


# --------------------------------------------------------------------------------------------
# Calibration from a measured run
# --------------------------------------------------------------------------------------------


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
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    from ratrain.plan.simulate import simulate_config  # the simulator builds on this module

    if cost is None:
        try:
            cost = CostModel.from_config(cfg)
        except ValueError:  # e.g. the host profile models no link: start from mt3000's figures
            from ratrain.shim.platform import load_profile

            cost = CostModel.from_config(cfg, Rates.from_profile(load_profile("mt3000")))
    policy = policy or cfg.schedule.policy
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
        import yaml

        with open(path) as f:
            return int(yaml.safe_load(f)["run"]["steps"])
    except Exception:  # noqa: BLE001 - a missing or partial config: fall back
        return default


__all__ = [
    "ADAMW_BYTES_PER_PARAM",
    "ALGOS",
    "Calibration",
    "CostModel",
    "DEFAULT_MEM_BANDWIDTH",
    "Rates",
    "VIEW_BYTES_PER_PARAM",
    "allreduce_terms",
    "block_kind",
    "block_params",
    "calibrate",
    "fit_compute_rate",
    "measured_step_time",
    "p2p_time",
    "read_metrics",
    "ring_allreduce_time",
    "tree_allreduce_time",
    "trace_compute_seconds",
]
