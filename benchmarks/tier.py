"""The memory tier's benchmark (issue 31): offload against recomputation on an emulated tier.

    mpirun -n 2 --oversubscribe python benchmarks/tier.py peaks --config jobs/bench-tier.yaml
    mpirun -n 2 --oversubscribe python benchmarks/tier.py measure --config jobs/bench-tier.yaml \\
        --bandwidths 1e11,5e9 --rounds 2 | grep '^{' > measured.jsonl
    python benchmarks/tier.py table --measured measured.jsonl        # as Markdown
    python benchmarks/tier.py models --tier nvme     # the paper's four models (the planner)

`peaks` trains one step with no cap, without the tier and with every layer offloaded
(`offload.activations: all`), and prints per rank the ledger's DDR peak of each, the most
activation bytes parked in the tier at once, the activation bytes in the tier at the moment of
the offloaded run's DDR peak (the offloaded bytes), a layer's saved activations per
micro-batch, and whether the peak dropped by at least the offloaded bytes less the double
buffer (a layer's activations being written and one being read: two layers'); also each
stage's predicted peak with no layer and with every layer recomputed (how the job's cap is
derived).

`measure` trains the job (as `python -m ratrain.train` wires it: its DDR cap, `recompute:
auto`, links, pacing and the tier's throttle) at each tier bandwidth with the layers that must
leave the DDR recomputed (`offload.activations: off`) and offloaded (`prefer`), the variants
interleaved in `--rounds` rounds, and prints per variant the median step, the layers each stage
recomputed and offloaded, the DDR peak and the loss, each beside the simulator
(`plan.simulate.simulate_config` with the run's own choices, x the time scale); then a summary:
at each bandwidth the planner's choice against the faster measured, and simulated / measured's
range. The planner's choice is the recovery its simulator finds faster, each played with the
layers the run moved (the executor's measured sizes decide how many must leave the DDR; the
planner's shape-based sizes leave out the CPU kernels' scratch, so at the job's cap they would
move none). `table` prints those lines as Markdown.

`models` prints, for the paper's models, today's best plan and the best with the tier (`python
-m ratrain.plan --tier`, every policy), with the simulator's breakdown of both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ratrain.config import load_config
from ratrain.exec import layers as layer_kernels
from ratrain.exec.spec import OFFLOAD
from ratrain.plan.search import search
from ratrain.plan.simulate import simulate_config
from ratrain.plan.tierplan import tier_search

VARIANTS = {"recompute": "off", "offload": "prefer"}  # offload.activations of each
MODELS = ("jobs/llama2-7b.yaml", "jobs/baichuan2-13b.yaml", "jobs/qwen2.5-32b.yaml",
          "jobs/llama2-70b.yaml")


def _batch(cfg, step):
    p, mc = cfg.parallel, cfg.model
    ids = np.random.default_rng(step).integers(0, mc.vocab_size,
                                               (p.dp * p.num_micro_batches, p.micro_batch,
                                                mc.seq_len + 1))
    return ids[..., :-1].copy(), ids[..., 1:].copy()


def watch_peak(ledger, tier_ledger) -> dict:
    """Instrument `ledger` (the DDR's): at each new peak, note the activation bytes the tier
    holds (`tier_ledger`) at that moment. Returns the record ({"peak", "tier"}; reset it)."""
    seen = {"peak": 0, "tier": 0}
    reserve = ledger.reserve

    def watched(tag, nbytes):
        reserve(tag, nbytes)
        if ledger.current > seen["peak"]:
            seen.update(peak=ledger.current, tier=tier_ledger.in_use("tier.act")
                        if tier_ledger is not None else 0)

    ledger.reserve = watched
    return seen


def _run(cfg, comm, steps: int, skip: int) -> dict:
    """Train `cfg` for `steps` steps (every rank); this rank's figures."""
    from ratrain.runtime.rank import build_rank

    rank = build_rank(cfg, comm, watchdog_s=300)
    ex = rank.executor
    times, peaks = [], []
    seen = watch_peak(rank.ledger, ex.offloader.store.ledger if ex.offloader else None)
    try:
        for s in range(steps):
            comm.Barrier()
            seen.update(peak=0, tier=0)
            res = ex.run_step(s, _batch(cfg, s))
            if s >= skip:
                times.append(res.step_time_s)
                peaks.append(res.local_peak_ddr_bytes)
        ex.flush()
        rec = list(ex.recovery.values())
        tier = ex.offloader.store.ledger.peak_by_tag().get("tier.act", 0) if ex.offloader else 0
    finally:
        rank.close()
    return {"stage": ex.stage, "median": statistics.median(times), "peak": max(peaks),
            "full": rec.count("full"), "offload": rec.count(OFFLOAD), "loss": res.loss,
            "predicted": ex.predicted_peak, "tier_act_peak": tier, "reports": ex.reports_loss,
            "tier_at_peak": seen["tier"]}


def cmd_measure(a) -> None:
    from mpi4py import MPI  # the benchmark's ranks

    comm = MPI.COMM_WORLD
    runs: dict[tuple, list] = {}
    t0 = time.perf_counter()
    for r in range(a.rounds):
        for bw in a.bandwidths.split(","):
            names = list(VARIANTS)
            for name in names[r % 2:] + names[:r % 2]:  # rotated
                cfg = load_config(a.config, [*a.set, f"platform.tier_bandwidth={bw}",
                                             f"offload.activations={VARIANTS[name]}"])
                rows = comm.allgather(_run(cfg, comm, cfg.run.steps, a.skip))
                runs.setdefault((float(bw), name), []).append(rows)
    if comm.Get_rank() != 0:
        return
    out = []
    for (bw, name), rounds in runs.items():
        steps = [next(x["median"] for x in rows if x["reports"]) for rows in rounds]
        rows = sorted(rounds[-1], key=lambda x: x["stage"])
        m = {"case": f"{bw:.3g}/{name}", "variant": name, "tier_bandwidth": bw,
             "step_s": round(statistics.median(steps), 4), "rounds": [round(x, 4) for x in steps],
             "full": [x["full"] for x in rows], "offload": [x["offload"] for x in rows],
             "peak_ddr_MiB": round(max(x["peak"] for x in rows) / 2**20, 3),
             "loss": rows[-1]["loss"]}
        m["simulated_s"] = round(_simulated(a, m), 4)
        m["sim_over_measured"] = round(m["simulated_s"] / m["step_s"], 4)
        out.append(m)
        print(json.dumps(m), flush=True)
    summary = {"sim_over_measured_min": min(m["sim_over_measured"] for m in out),
               "sim_over_measured_max": max(m["sim_over_measured"] for m in out),
               "losses_equal": len({m["loss"] for m in out}) == 1,
               "wall_s": round(time.perf_counter() - t0, 1)}
    for bw in sorted({m["tier_bandwidth"] for m in out}, reverse=True):
        mine = [m for m in out if m["tier_bandwidth"] == bw]
        planned = {m["variant"]: m["simulated_s"] for m in mine}  # the simulator's verdict
        choice = min(planned, key=planned.get)
        faster = min(mine, key=lambda m: m["step_s"])["variant"]
        key = f"{bw:.3g}"
        summary[f"{key}.planner_choice"] = choice
        summary[f"{key}.measured_faster"] = faster
        summary[f"{key}.agree"] = choice == faster
        for name, sec in planned.items():
            summary[f"{key}.planned_{name}_s"] = round(sec, 4)
    summary["planner_agrees"] = all(v for k, v in summary.items() if k.endswith(".agree"))
    print(json.dumps(summary), flush=True)


def _simulated(a, m) -> float:
    """The simulator's step (this host's time) for a measured run, with its own choices."""
    cfg = load_config(a.config, [*a.set, f"platform.tier_bandwidth={m['tier_bandwidth']}",
                                 f"offload.activations={VARIANTS[m['variant']]}"])
    res = simulate_config(cfg, recompute_layers=m["full"], offload_layers=m["offload"], steps=3,
                          with_memory=False)
    return res.step_s * cfg.platform.time_scale


def cmd_table(a) -> None:
    """The Markdown table of `measure`'s lines (docs/BENCHMARKS.md)."""
    lines = [json.loads(x) for x in open(a.measured) if x.startswith("{")]
    rows, summary = [x for x in lines if "case" in x], lines[-1]
    print("| tier B/s (per node) | variant | measured step s (rounds) | simulated s | simulated / "
          "measured | recomputed, offloaded per stage | peak DDR MiB | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for m in rows:
        print(f"| {m['tier_bandwidth']:.3g} | {m['variant']} | {m['step_s']:.3f} ("
              f"{', '.join(f'{x:.3f}' for x in m['rounds'])}) | {m['simulated_s']:.3f} | "
              f"**{m['sim_over_measured']:.3f}** | {m['full']}, {m['offload']} | "
              f"{m['peak_ddr_MiB']} | {m['loss']:.10f} |")
    print()
    for key in sorted({k.split(".agree")[0] for k in summary if k.endswith(".agree")},
                      key=float, reverse=True):
        planned = ", ".join(f"{n} {summary[f'{key}.planned_{n}_s']:.3f} s" for n in VARIANTS)
        print(f"- tier {key} B/s: the planner chooses {summary[f'{key}.planner_choice']} "
              f"({planned}); measured, {summary[f'{key}.measured_faster']} is faster: "
              f"{'agree' if summary[f'{key}.agree'] else 'DISAGREE'}")


def cmd_peaks(a) -> None:
    from mpi4py import MPI  # the benchmark's ranks

    from ratrain.runtime.rank import build_rank

    comm = MPI.COMM_WORLD
    cfgs = {"none": load_config(a.config, [*a.set, "platform.ddr_bytes=0", "run.steps=1",
                                           "schedule.recompute=none", "offload.activations=off"]),
            "all": load_config(a.config, [*a.set, "platform.ddr_bytes=0", "run.steps=1",
                                          "schedule.recompute=none", "offload.activations=all"])}
    got = {k: _run(c, comm, 1, 0) for k, c in cfgs.items()}
    predicted = {}
    for rec in ("none", "full"):
        c = load_config(a.config, [*a.set, "platform.ddr_bytes=0", f"schedule.recompute={rec}",
                                   "offload.activations=off"])
        rank = build_rank(c, comm, cap=None, watchdog_s=300)
        predicted[rec] = rank.executor.predicted_peak
        ex, st, ctx = rank.executor, rank.state, rank.ctx
        layer = next(b for b in ex.blocks if b.startswith("layers."))
        if not st.has_view(layer):
            ex.materialize_now(layer)
        x = ctx.xp.zeros(ex.act_shape, ctx.dtype)
        cache = layer_kernels.cache_nbytes(layer_kernels.layer_forward(x, st.view(layer), ctx)[1])
        rank.close()
    rows = comm.allgather({
        "stage": got["none"]["stage"], "peak_none_MiB": got["none"]["peak"] / 2**20,
        "peak_offload_MiB": got["all"]["peak"] / 2**20,
        "tier_act_peak_MiB": got["all"]["tier_act_peak"] / 2**20, "layer_cache_MiB": cache / 2**20,
        "tier_at_ddr_peak_MiB": got["all"]["tier_at_peak"] / 2**20,
        "predicted_none_MiB": predicted["none"] / 2**20,
        "predicted_full_MiB": predicted["full"] / 2**20})
    if comm.Get_rank() == 0:
        met = True
        for r in sorted(rows, key=lambda r: r["stage"]):
            extents = -(-r["layer_cache_MiB"] * 2**20 // 4096) * 4096 / 2**20  # whole pages
            offloaded = r["tier_at_ddr_peak_MiB"] // extents * r["layer_cache_MiB"]
            drop = r["peak_none_MiB"] - r["peak_offload_MiB"]
            r.update(case=f"stage{r['stage']}", offloaded_MiB=offloaded, drop_MiB=drop,
                     target_met=drop >= offloaded - 2 * r["layer_cache_MiB"])
            met = met and r["target_met"]
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in r.items()}), flush=True)
        print(json.dumps({"target_met": met}), flush=True)


def cmd_models(a) -> None:
    """Per model, one JSON line: today's best plan and the best with the tier (every policy,
    placement pp, as `python -m ratrain.plan --tier` plans them), the simulator's breakdown of
    both (the busiest rank), and the tier's traffic; then a summary line."""
    out = []
    for job in a.jobs:
        t0 = time.perf_counter()
        cfg = load_config(job, [*a.set, f"platform.tier={a.tier}"])
        n = cfg.parallel.world_size
        today = search(cfg, n, placements=("pp",))
        tiered = tier_search(cfg, n, placements=("pp",))
        now = max((ps[0] for ps in today.values() if ps), key=lambda q: q.tokens_per_s)
        best = max((ps[0] for ps in tiered.values() if ps), key=lambda q: q.tokens_per_s)
        row = {"case": job.rsplit("/", 1)[-1].removesuffix(".yaml"), "tier": a.tier,
               "today_tokens_per_s": round(now.tokens_per_s), "today_policy": now.policy,
               "today_pp": now.layout.pp, "today_recovery": now.layout.describe(cfg.model.layers),
               "tier_tokens_per_s": round(best.tokens_per_s), "tier_policy": best.policy,
               "tier_pp": best.layout.pp,
               "tier_recovery": f"{best.layout.offload}: "
                                f"{best.layout.describe(cfg.model.layers)}",
               "tier_optimizer": best.layout.offload_state,
               "ratio": round(best.tokens_per_s / now.tokens_per_s, 4),
               "tier_GB_per_step": round(max(r.tier_bytes for r in best.result.ranks) / 1e9, 2),
               "tier_s": round(best.result.tier_s, 2),
               "tier_exposed_s": round(best.result.tier_exposed_s, 3),
               "tier_peak_GiB": round(max(best.tier_peaks) / 2**30, 2),
               "planned_s": round(time.perf_counter() - t0, 1)}
        for name, q in (("today", now), ("tier", best)):
            r = max(q.result.ranks, key=lambda x: x.busy_s)
            row.update({f"{name}_step_s": round(q.step_s, 2),
                        f"{name}_compute_s": round(r.compute_s, 2),
                        f"{name}_recompute_s": round(r.recompute_s, 2),
                        f"{name}_bubble_s": round(q.result.bubble_s, 2)})
        out.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({f"{r['case']}.ratio": r["ratio"] for r in out}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("peaks", "measure", "table"):
        s = sub.add_parser(name)
        s.add_argument("--config", default="jobs/bench-tier.yaml")
        s.add_argument("--set", action="append", default=[])
    sub.choices["measure"].add_argument("--bandwidths", default="1e11,5e9")
    sub.choices["measure"].add_argument("--rounds", type=int, default=2)
    sub.choices["measure"].add_argument("--skip", type=int, default=2)
    sub.choices["table"].add_argument("--measured", required=True)
    m = sub.add_parser("models")
    m.add_argument("jobs", nargs="*", default=list(MODELS))
    m.add_argument("--tier", default="nvme")
    m.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    {"peaks": cmd_peaks, "measure": cmd_measure, "table": cmd_table, "models": cmd_models}[a.cmd](a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
