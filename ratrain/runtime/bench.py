"""Look at and time the lifecycle policies.

    python -m ratrain.runtime.bench grid --pp 4 --m 6 --policy ratrain [--dp 2]  # step x rank grid
    python -m ratrain.runtime.bench memory --config jobs/llama2-7b.yaml --pp 8 --m 16 --dp 64
    mpirun -n 4 python -m ratrain.runtime.bench time --pp 2 --dp 2 --bandwidth 2e8
    mpirun -n 8 python -m ratrain.runtime.bench time --config jobs/bench-lifecycle.yaml --rounds 3

`grid` prints the schedule (one step after a previous one, so deferred work shows). `memory`
prints the memory model's peak per stage and policy (activation sizes from shapes,
`lifecycle.memory.stage_sizes`); `--dp`
gives `ratrain` its sharded optimizer state (the other policies keep whole state). `time` trains
a small model for a few steps under each policy in the same session, the link throttled through
the shim (`--bandwidth` B/s, `--latency` s) and compute paced to `--compute-flops` per rank (so
timings hold with more ranks than cores), and prints the median step time per policy.
`time --config JOB` instead runs the job file as the trainer wires it (its DDR cap with
`recompute: auto`, link throttle, compute and DDR pacing from `platform`; `--pp/--dp/--m/--steps`
and `--set` override it), the policies in `--rounds` rotated rounds, and prints per policy the
median step time after `--skip` steps, peak DDR, layers recomputed, the paced compute of the
busiest rank and the 1F1B ideal `(m + p - 1) / m` x it, ratios, and stage 0's time per kind of
action (scripts/bench-lifecycle.sh, docs/history/lifecycle.md, "Lifecycle").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from ratrain.config import (
    Config,
    ConfigError,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PlatformConfig,
    RunConfig,
    ScheduleConfig,
    load_config,
)
from ratrain.exec.spec import RECOMPUTE
from ratrain.lifecycle.memory import choose_recompute, simulate_peak, stage_sizes
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.lifecycle.policies import POLICIES, Policy
from ratrain.runtime import trace
from ratrain.runtime.rank import build_rank


def cmd_grid(args) -> None:
    model = ModelConfig(layers=args.layers)
    pol = Policy(args.policy, bucket_bytes=args.bucket_bytes)
    plan = PipelinePlan.of_model(model, pol, args.pp, args.dp, args.m, args.precision)
    print(f"# {args.policy}, pp={args.pp}, dp={args.dp}, m={args.m}, {args.precision} "
          "(a step after a step)")
    print(plan.grid(1, f=1, b=args.b, lifecycle=not args.compute_only,
               legend=True))


def cmd_memory(args) -> None:
    cfg = load_config(args.config, args.set)
    model, prec, mb = cfg.model, cfg.precision, cfg.parallel.micro_batch
    rows = []
    for policy in ("baseline-1f1b", "megatron-1f1b", "ratrain"):
        plan = PipelinePlan.from_config(cfg, policy, pp=args.pp, dp=args.dp, m=args.m,
                                        layers_per_stage=None)
        shards = plan.shards
        for info in plan.stages:
            layers = [b for b in info.blocks if b.startswith("layers.")]
            sizes = stage_sizes(model, mb, prec, info.blocks,
                                dict.fromkeys(layers, args.recompute), shards)
            lists = plan.stage_steps(info.stage, 2)
            peak = simulate_peak(lists, info.blocks, sizes)
            row = {"policy": policy, "stage": info.stage, "dp": args.dp, "shards": shards,
                   "peak_GiB": round(peak / 2**30, 3), "peak_MiB": round(peak / 2**20, 2)}
            if args.cap_gib:  # the fewest layers fully recomputed under the cap
                choice, cpeak = choose_recompute(int(args.cap_gib * 2**30), sizes, lists,
                                                 info.blocks)
                row["recomputed"] = sum(r == "full" for r in choice.values())
                row["layers"] = len(choice)
                row["auto_peak_GiB"] = round(cpeak / 2**30, 3)
            rows.append(row)
    for r in rows:
        print(json.dumps(r))


def _batch(cfg, step, replica):
    p, mc = cfg.parallel, cfg.model
    rng = np.random.default_rng(step)
    ids = rng.integers(0, mc.vocab_size, (p.dp * p.num_micro_batches, p.micro_batch, mc.seq_len + 1))
    lo = p.share_offset(replica)  # replica's micro-batches of the global batch
    ids = ids[lo:lo + p.micro_batches_of(replica)]
    return ids[..., :-1].copy(), ids[..., 1:].copy()


def _time_config(args, policy) -> Config:
    """`time` without --config: a small model, the link and compute pacing from the flags."""
    model = ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=4,
                        kv_heads=4, ffn_hidden=int(args.hidden * 8 / 3) // 8 * 8,
                        seq_len=args.seq)
    platform = PlatformConfig(profile="host", emulate=bool(args.bandwidth or args.compute_flops),
                              link_bandwidth=args.bandwidth or None, link_latency=args.latency,
                              compute_flops=args.compute_flops or None)
    return Config(model=model,
                  parallel=ParallelConfig(pp=args.pp, dp=args.dp, micro_batch=args.micro_batch,
                                          num_micro_batches=args.m),
                  precision=args.precision, schedule=ScheduleConfig(policy=policy),
                  optim=OptimConfig(lr=1e-3, grad_clip=1.0), platform=platform,
                  run=RunConfig(steps=100, threads=1))


def cmd_time(args) -> None:
    from mpi4py import MPI  # every rank of the benchmark: MPI is needed here

    comm = MPI.COMM_WORLD
    _time_config(args, "ratrain").check_world(comm.Get_size())  # before any work
    out = {}
    for policy in args.policies.split(","):
        cfg = _time_config(args, policy)
        rank = build_rank(cfg, comm, watchdog_s=120)
        ex, replica = rank.executor, rank.topo.replica
        if args.trace:  # every step's events (outside the ledger: the figures stay the run's)
            ex.timeline = trace.Timeline(cfg.run.trace_bytes)
        times = []
        for s in range(args.steps):
            comm.Barrier()  # benchmark only: start every step together
            res = ex.run_step(s, _batch(cfg, s, replica))
            times.append(res.step_time_s)
        ex.flush()
        if args.trace:
            ex.write_trace(f"{args.trace}.{policy}.json")
        t = max(comm.allgather(statistics.median(times[1:] or times)))
        out[policy] = {"step_s": round(t, 4), "loss": res.loss,
                       "peak_ddr_MiB": round(res.peak_ddr_bytes / 2**20, 2)}
        rank.close()
    if comm.Get_rank() == 0:
        base = out.get("baseline-1f1b", {}).get("step_s")
        for policy, r in out.items():
            if base:
                r["speedup_vs_baseline"] = round(base / r["step_s"], 3)
            print(json.dumps({"policy": policy, "pp": args.pp, "dp": args.dp, "m": args.m,
                              "bandwidth": args.bandwidth, **r}))


HOST_BUSY_MAX = 1.0  # real / paced compute above this: the host did not keep the platform's pace

# the parts of a step, by the first word of the action names (`lifecycle.schedule`)
BREAKDOWN = {"F": "fwd", "B": "bwd", "recv-fwd": "recv", "recv-bwd": "recv",
             "wait-sync": "wait_sync", "norm": "norm", "update": "update", "view": "view",
             "gather-view": "view", "wait-view": "wait_view", "wait-avg": "wait_avg"}


def _breakdown(events, t_from: float, steps: int) -> dict:
    """Seconds per step this rank spent in each part of a step (timeline events from t_from):
    forward / backward compute (paced, recompute included), waits for the neighbours'
    messages (pipeline bubbles + exposed p2p), the wait for gradient syncs (exposed
    data-parallel comm), the global facts (waits for the slowest stage), updates, view casts
    and view gathers."""
    out = dict.fromkeys(BREAKDOWN.values(), 0.0)
    for name, _group, t0, t1, tid, _args in events:
        part = BREAKDOWN.get(name.split(" ", 1)[0])
        if tid == 0 and t0 >= t_from and part is not None:
            out[part] += t1 - t0
    return {k: round(v / steps, 4) for k, v in out.items()}


def _job_run(cfg, comm, steps: int, skip: int) -> dict:
    """Train `cfg` for `steps` steps (random tokens) as `python -m ratrain.train` wires it (DDR
    cap, link throttle and compute / DDR pacing from `cfg.platform`); timings over the steps
    after the first `skip`. Collective; every rank returns the same dict."""
    rank = build_rank(cfg, comm, watchdog_s=120)
    ex, topo = rank.executor, rank.topo
    ex.timeline = trace.Timeline(cfg.run.trace_bytes)  # the window's events, for the breakdown
    pacer = ex.pacer
    times, peaks = [], []
    t_win = c_win = m_win = 0.0
    for s in range(steps):
        if s == skip:
            comm.Barrier()  # the measured window starts together
            t_win = time.perf_counter()
            c_win = pacer.compute_target_s if pacer else 0.0
            m_win = pacer.memory_target_s if pacer else 0.0
        res = ex.run_step(s, _batch(cfg, s, topo.replica))
        if s >= skip:
            times.append(res.step_time_s)
            peaks.append(res.peak_ddr_bytes)
    comm.Barrier()
    n = steps - skip
    window = (time.perf_counter() - t_win) / n
    recompute = ex.compute.recompute
    mine = {
        "window": window,
        "median": statistics.median(times),
        "compute": ((pacer.compute_target_s - c_win) / n) if pacer else 0.0,
        "memory": ((pacer.memory_target_s - m_win) / n) if pacer else 0.0,
        "busy": pacer.busy_s / max(pacer.compute_target_s + pacer.memory_target_s, 1e-9)
        if pacer else 0.0,
        "overruns": pacer.overruns if pacer else 0,
        "recomputed": sum(r == "full" for r in recompute.values()) if topo.replica == 0 else 0,
        "layers": len(recompute) if topo.replica == 0 else 0,
        "predicted": ex.predicted_peak,
        "stage": topo.stage,
        "breakdown": _breakdown(ex.events, t_win, n),
        "reports": ex.reports_loss,
    }
    ex.flush()
    rank.close()
    rows = comm.allgather(mine)
    rep = next(r for r in rows if r["reports"])
    return {
        "step_s": round(rep["median"], 4),  # the trainer's step_time_s (its reporting rank)
        "window_step_s": round(max(r["window"] for r in rows), 4),
        "loss": res.loss,
        "peak_ddr_MiB": round(max(peaks) / 2**20, 2),
        "predicted_peak_MiB": round(max(r["predicted"] for r in rows) / 2**20, 2),
        "recomputed": f"{sum(r['recomputed'] for r in rows)}/{sum(r['layers'] for r in rows)}",
        "recomputed_per_stage": [r["recomputed"] for r in rows if r["layers"]],
        "compute_s": round(max(r["compute"] for r in rows), 4),  # paced compute, busiest rank
        "update_view_s": round(max(r["memory"] for r in rows), 4),  # paced DDR-bound work
        "overruns": sum(r["overruns"] for r in rows),
        "host_busy": round(max(r["busy"] for r in rows), 3),  # real / paced time, worst rank
        "stage0": rows[0]["breakdown"],
    }


def job_rounds(cfgs: dict, comm, rounds: int, skip: int, steps: int | None = None) -> dict:
    """`_job_run` of every config of `cfgs` (name -> config) in `rounds` rounds, each round's
    order rotated by one (interleaved, so that a drift of the host weighs on all alike);
    `steps`: each run's (None: its config's run.steps). name -> the rounds' results."""
    names = list(cfgs)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            cfg = cfgs[name]
            runs[name].append(_job_run(cfg, comm, steps or cfg.run.steps, skip))
    return runs


def variant_sets(spec: str) -> list[str]:
    """`--set` overrides of one `--policies` entry: a preset's name, optionally with component
    switches, `baseline-1f1b+sync=layer+update=next-step` (the `schedule` section's keys)."""
    name, *switches = spec.split("+")
    out = [f"schedule.policy={name}"]
    for sw in switches:
        key, eq, val = sw.partition("=")
        if not eq:
            raise ConfigError(f"policy variant {spec!r}: {sw!r} is not KEY=VALUE (e.g. "
                              "baseline-1f1b+sync=layer+shard_optimizer=true)")
        out.append(f"schedule.{key}={val}")
    return out


def cmd_job(args) -> None:
    """`time --config`: each policy on the job's own config, in rounds (rotated order)."""
    from mpi4py import MPI  # every rank of the benchmark: MPI is needed here

    comm = MPI.COMM_WORLD
    sets = list(args.set)
    for key, val in (("parallel.pp", args.pp), ("parallel.dp", args.dp),
                     ("parallel.num_micro_batches", args.m), ("run.steps", args.steps)):
        if val is not None:
            sets.append(f"{key}={val}")
    policies = args.policies.split(",")
    cfgs = {pol: load_config(args.config, [*sets, *variant_sets(pol)]) for pol in policies}
    for cfg in cfgs.values():  # every variant checked before any work
        cfg.check_world(comm.Get_size())
    runs = job_rounds(cfgs, comm, args.rounds, args.skip)
    if comm.Get_rank() != 0:
        return
    p = cfgs[policies[-1]].parallel
    out = {}
    for pol, rs in runs.items():
        r = dict(rs[-1])
        r["step_s"] = round(statistics.median(x["step_s"] for x in rs), 4)
        r["window_step_s"] = round(statistics.median(x["window_step_s"] for x in rs), 4)
        r["rounds"] = [x["step_s"] for x in rs]
        # the 1F1B ideal: (m + p - 1) / m x the busiest rank's paced compute of a step
        r["ideal_1f1b_s"] = round((p.num_micro_batches + p.pp - 1) / p.num_micro_batches
                                  * r["compute_s"], 4)
        out[pol] = r
    for pol, r in out.items():
        for other in ("baseline-1f1b", "megatron-1f1b"):
            if other in out and other != pol:
                r[f"speedup_vs_{other.split('-')[0]}"] = round(out[other]["step_s"] / r["step_s"], 3)
        r["vs_ideal"] = round(r["step_s"] / r["ideal_1f1b_s"], 3) if r["ideal_1f1b_s"] else None
        r["host_kept_pace"] = r["host_busy"] <= HOST_BUSY_MAX
        if not r["host_kept_pace"]:
            print(f"warning: {pol}: host_busy {r['host_busy']} > {HOST_BUSY_MAX}: the host could "
                  "not keep pace with the emulated platform (real compute took longer than its "
                  "paced time), so this row's times and ratios measure the host, not the "
                  "schedule; rerun on a quieter host or with a larger platform.time_scale",
                  file=sys.stderr, flush=True)
        print(json.dumps({"policy": pol, "pp": p.pp, "dp": p.dp, "m": p.num_micro_batches,
                          "cap_MiB": round((cfg.platform.ddr_bytes or 0) / 2**20, 2), **r}),
              flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ratrain.runtime.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grid", help="print a policy's step x rank picture (no MPI)")
    g.add_argument("--pp", type=int, default=4, help="pipeline stages (default 4)")
    g.add_argument("--m", type=int, default=6, help="micro-batches per step (default 6)")
    g.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    g.add_argument("--policy", choices=POLICIES, default="ratrain",
                   help="schedule policy (default ratrain)")
    g.add_argument("--dp", type=int, default=1, help="replicas (ratrain shards over them)")
    g.add_argument("--precision", choices=("fp32", "fp16"), default="fp16",
                   help="fp16 adds the view materialisations (default fp16)")
    g.add_argument("--bucket-bytes", type=int, default=2**20,
                   help="megatron-1f1b's gradient bucket size in bytes (default 1 MiB)")
    g.add_argument("--b", type=int, default=1, help="ticks per backward")
    g.add_argument("--compute-only", action="store_true",
                   help="show forward/backward only, no lifecycle actions")
    mm = sub.add_parser("memory", help="each stage's peak memory under every policy (no MPI)")
    mm.add_argument("--config", required=True, help="job file (or shipped job name) to size")
    mm.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value (repeatable)")
    mm.add_argument("--pp", type=int, default=4, help="pipeline stages (default 4)")
    mm.add_argument("--m", type=int, default=8, help="micro-batches per step (default 8)")
    mm.add_argument("--recompute", default="none", choices=RECOMPUTE,
                    help="every layer's recompute choice (default none)")
    mm.add_argument("--dp", type=int, default=1, help="replicas (ratrain shards over them)")
    mm.add_argument("--cap-gib", type=float, default=0.0,
                    help="also choose the fewest layers to recompute under this cap (GiB)")
    t = sub.add_parser("time", help="time every policy's real steps under mpirun")
    for k, v in (("pp", 2), ("dp", 2), ("m", 4), ("hidden", 256), ("layers", 4), ("seq", 64),
                 ("micro_batch", 2), ("steps", 5)):
        t.add_argument(f"--{k.replace('_', '-')}", type=int, default=None,
                       help=f"default {v} (with --config: the job's)")
    t.add_argument("--config", default="",
                   help="time this job file as the trainer runs it (cap, link, pacing from its "
                        "platform section); --pp/--dp/--m/--steps override it")
    t.add_argument("--set", action="append", default=[], help="section.key=value (--config)")
    t.add_argument("--rounds", type=int, default=1, help="rounds of all policies (--config)")
    t.add_argument("--skip", type=int, default=2, help="first steps not timed (--config)")
    t.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="precision (default fp32)")
    t.add_argument("--bandwidth", type=float, default=0.0,
                   help="throttle links to this many bytes/s (0: not throttled)")
    t.add_argument("--latency", type=float, default=20e-6,
                   help="link latency in s with --bandwidth (default 20e-6)")
    t.add_argument("--compute-flops", type=float, default=0.0,
                   help="pace each block's compute to flops / this rate (0: host speed)")
    t.add_argument("--policies", default="baseline-1f1b,megatron-1f1b,ratrain",
                   help="comma-separated policies to time, interleaved; with --config each may "
                        "switch components: baseline-1f1b+sync=layer+update=next-step")
    t.add_argument("--trace", default="", metavar="PREFIX",
                   help="write each policy's Chrome trace to PREFIX.<policy>.json")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "time" and not args.config:
        for k, v in (("pp", 2), ("dp", 2), ("m", 4), ("hidden", 256), ("layers", 4), ("seq", 64),
                     ("micro_batch", 2), ("steps", 5)):
            if getattr(args, k) is None:
                setattr(args, k, v)
    run = cmd_job if args.cmd == "time" and args.config else {
        "grid": cmd_grid, "memory": cmd_memory, "time": cmd_time}[args.cmd]
    try:
        run(args)
    except ConfigError as e:  # a meaningless layout or config: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
