"""The lifecycle ablation (issue 15): from `baseline-1f1b` to `ratrain`, one component at a time.

    python benchmarks/ablation.py ladder                  # the variants, for --policies
    mpirun -n 8 --oversubscribe python -m ratrain.runtime.bench time \\
        --config jobs/bench-lifecycle.yaml --rounds 2 --policies "$(python benchmarks/ablation.py ladder)" \\
        | grep '^{' > measured.jsonl
    python benchmarks/ablation.py table --config jobs/bench-lifecycle.yaml --measured measured.jsonl
    python benchmarks/ablation.py weight --config jobs/bench-lifecycle.yaml --like jobs/llama2-7b.yaml
    python benchmarks/ablation.py simulate jobs/llama2-7b.yaml jobs/baichuan2-13b.yaml ...

`table` prints, per variant, the measured step (`runtime.bench time --config`, median of its
rounds) beside the simulator's (`plan.simulate.simulate_config` on the variant's config with the
layers the run recomputed, x the job's time_scale), and the loss (the same for every variant).
`weight` prints the `--set` overrides that give a job the per-parameter weight of another (the
simulator's stage-0 ratios, baseline-1f1b without recomputation: AdamW + view casts against
compute through `platform.ddr_bandwidth`, communication against compute through both link
levels' bandwidths and latencies). `simulate` gives every variant's predicted tokens/s for the
paper's models at their job layouts (auto recompute under the cap, as the variant recovers).
"""

from __future__ import annotations

import argparse
import json

from ratrain.config import load_config
from ratrain.runtime.bench import variant_sets
from ratrain.lifecycle.policies import PRESETS, policy_of
from ratrain.plan.check import run_plan
from ratrain.plan.simulate import simulate_config
from ratrain.shim.platform import resolve_platform

# (variant, what the row adds); each row keeps the ones above it
LADDER = (
    ("baseline-1f1b+recovery=uniform", "baseline-1f1b with GPU-style uniform recovery (all or no layers)"),
    ("baseline-1f1b", "+ per-layer activation recovery (the fewest layers that fit)"),
    ("baseline-1f1b+sync=layer", "+ layer-level gradient sync (each block after its last backward)"),
    ("baseline-1f1b+sync=layer+update=next-step", "+ stage-local update (deferred into the next step's warm-up)"),
    ("baseline-1f1b+sync=layer+update=next-step+buffers=per-block", "+ per-block gradient and view buffers"),
    ("baseline-1f1b+sync=layer+update=next-step+buffers=per-block+shard_optimizer=true",
     "+ optimizer-state sharding (ZeRO-1 per block; every view gathered at step start)"),
    ("baseline-1f1b+sync=layer+update=next-step+buffers=per-block+shard_optimizer=true+prefetch=true",
     "+ parameter-view prefetch (each gather waited for before its block's first forward) = ratrain"),
)


def _variant_cfg(config: str, sets, variant: str):
    return load_config(config, [*sets, *variant_sets(variant)])


def check_ladder(config: str = "jobs/tiny.yaml") -> None:
    """The last rung is ratrain's preset."""
    last = policy_of(_variant_cfg(config, [], LADDER[-1][0]).schedule)
    assert last.components == PRESETS["ratrain"], last.label


def cmd_table(a) -> None:
    rows = [json.loads(x) for x in open(a.measured) if x.startswith("{")]
    print("| variant | adds | measured step s (rounds) | simulated s | simulated / measured | recomputed | loss |")
    print("|---|---|---|---|---|---|---|")
    adds = dict(LADDER)
    for m in rows:
        cfg = _variant_cfg(a.config, a.set, m["policy"])
        res = simulate_config(cfg, recompute_layers=m["recomputed_per_stage"], steps=3,
                              with_memory=False)
        pred = res.step_s * cfg.platform.time_scale
        print(f"| `{m['policy']}` | {adds.get(m['policy'], '')} | {m['step_s']:.3f} "
              f"({', '.join(f'{x:.3f}' for x in m['rounds'])}) | {pred:.3f} | "
              f"**{pred / m['step_s']:.3f}** | {m['recomputed']} | {m['loss']:.10f} |")


def _stage0_ratios(cfg) -> tuple[float, float]:
    res = simulate_config(cfg, with_memory=False)
    r = res.ranks[0]
    return (r.update_s + r.view_s) / r.compute_s, r.comm_total_s / r.compute_s


def cmd_weight(a) -> None:
    base = ["schedule.policy=baseline-1f1b", "schedule.recompute=none"]
    job = load_config(a.config, [*a.set, *base])
    like = load_config(a.like, base)
    (mem_j, comm_j), (mem_l, comm_l) = _stage0_ratios(job), _stage0_ratios(like)
    prof = resolve_platform(job.platform)
    fm, fc = mem_j / mem_l, comm_j / comm_l
    ddr = float(prof.fact("ddr_bandwidth").value)
    sets = [f"platform.ddr_bandwidth={ddr * fm:.4g}",
            f"platform.link_bandwidth={prof.link_bandwidth * fc:.4g}",
            f"platform.link_latency={prof.link_latency / fc:.4g}",
            f"platform.intra_bandwidth={prof.intra_bandwidth * fc:.4g}",
            f"platform.intra_latency={prof.intra_latency / fc:.4g}"]
    check = load_config(a.config, [*a.set, *base, *sets])
    mem_c, comm_c = _stage0_ratios(check)
    print(json.dumps({"job": a.config, "like": a.like,
                      "update_view_per_compute": [round(mem_j, 4), round(mem_l, 4)],
                      "comm_per_compute": [round(comm_j, 4), round(comm_l, 4)],
                      "after": [round(mem_c, 4), round(comm_c, 4)], "sets": sets}))
    print(" ".join(f"--set {s}" for s in sets))


def cmd_simulate(a) -> None:
    print("| model (job layout) | variant | recomputed | simulated tokens/s | vs first row |")
    print("|---|---|---|---|---|")
    for job in a.jobs:
        first = None
        for variant, _ in LADDER:
            cfg = _variant_cfg(job, a.set, variant)
            full = run_plan(cfg).full
            res = simulate_config(cfg, recompute_layers=list(full), with_memory=False)
            tps = res.tokens_per_s
            first = first or tps
            p = cfg.parallel
            print(f"| {job} (pp {p.pp} x dp {p.dp}, m {p.num_micro_batches}) | `{variant}` | "
                  f"{sum(full)}/{cfg.model.layers} | {tps:,.0f} | {tps / first:.3f}x |",
                  flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ladder", help="the variants, comma-separated (for --policies)")
    t = sub.add_parser("table", help="measured beside simulated")
    t.add_argument("--config", required=True)
    t.add_argument("--measured", required=True, help="JSON lines of runtime.bench time --config")
    t.add_argument("--set", action="append", default=[])
    w = sub.add_parser("weight", help="--set overrides giving a job another's per-parameter weight")
    w.add_argument("--config", required=True)
    w.add_argument("--like", required=True)
    w.add_argument("--set", action="append", default=[])
    s = sub.add_parser("simulate", help="every variant simulated at the jobs' own layouts")
    s.add_argument("jobs", nargs="+")
    s.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    check_ladder()
    if a.cmd == "ladder":
        print(",".join(v for v, _ in LADDER))
    else:
        {"table": cmd_table, "weight": cmd_weight, "simulate": cmd_simulate}[a.cmd](a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
