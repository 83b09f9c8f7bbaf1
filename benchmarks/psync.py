"""Issue 32's targets: partial synchronization (`sync.mode: partial`) against full on slow links.

    python benchmarks/psync.py speed --config jobs/psync.yaml [--periods 4] [--rounds 3]
        [--average before-update,after-update] [--steps 10] [--skip 2] [--ranks 4]
        [--launcher "CMD ..."] [--record NAME]
    python benchmarks/psync.py quality --config jobs/psync.yaml --out DIR [--period 4]
        [--average A] [--extra-steps STEPS/2] [--ranks 4] [--launcher "CMD ..."]
        [--png docs/psync-curves.png] [--record NAME]
    python benchmarks/psync.py assign --config jobs/psync.yaml [--periods 2,4,8] [--average A]
        [--set ...]
    python benchmarks/psync.py curves --config jobs/psync.yaml --out DIR [--period 4] [--set ...]
        [--full-set ...] [--partial-set ...] [--seeds 1234,1,2] [--control]
        [--average A]

`speed`: the job under full sync and under partial sync at each period H of `--periods` (and each
placement of `--average`, a comma list of `sync.average` values, none: the job's; variant
`partial-H`, or `partial-H-after` under after-update), run under one `mpirun -n RANKS` (or the
`--launcher` prefix, e.g. `scripts/cluster.sh run --name ps --` for 2 emulated nodes), each
`--steps` steps of random tokens as the trainer wires it (`runtime.bench.job_rounds`: link
throttle, compute and DDR pacing), the variants in `--rounds` rotated rounds (interleaved). A
variant's step is the mean over the steps after `--skip` (a whole number of periods: partial steps
differ through a period), its round's slowest rank; the median over rounds is measured. Printed,
one JSON object per variant: its measured and predicted step (the simulator's,
`plan.simulate.simulate_config` x time_scale), their ratio, the exposed gradient or average waits
of stage 0 and the paced compute; then a summary with each partial variant's steps/s over full's.

`quality`: trains the job (`python -m ratrain.train`, its own steps, the default corpus, evals
every `data.eval_interval`) under full and then under partial sync at `--period` into `DIR/full`
and `DIR/partial-H` (`-after` under after-update), then judges the partial run by `ratrain.compare`
against the full one (`docs/BENCHMARKS.md`'s recipe): eval loss no more than 2% worse at any eval
after the first 20% of training and no more than 1% at full's last step, the wall-clock time to
full sync's final eval loss, and what a partial step is worth in full's steps (as `curves`). The
partial run goes on `--extra-steps` past full's last step (the job's learning rate then stays at
its floor: its decay has a length of its own, `optim.decay_steps`), so that a run that ends short
of full's final loss is timed when it gets there rather than never; the shared steps are compared
as they are. The default, half the job's `run.steps`, is room for a partial step worth about 2/3
of full's (0.77-0.86 at H = 4 on jobs/psync.yaml; steps past the schedule, at its floor rate,
are worth less: the recorded run, at 0.77, got there 60 steps past 150; docs/BENCHMARKS.md).

`curves` (one process, no MPI, no pacing: a few minutes): the eval curves of full and partial sync
as the runtime computes them, to see how a job's quality depends on its settings (seeds, learning
rate, batch): full sync as one rank with the whole global batch, partial sync as the replicas one
after another, each a rank of its own whose parameter averages are summed in the runtime's order
(the runtime is bitwise this: `tests/test_partial_mpi.py`). Writes `DIR/full/eval.jsonl` and
`DIR/partial-H-after/eval.jsonl` (`partial-H` before the update; with `mean_model`: the eval loss
of the replicas' mean, what a checkpoint's model is) and prints the pair's verdict by the recipe's
bounds (`ratrain.compare.judge`) as a JSON line: the largest deviation after the first 20%, the
signed one at the end, what a partial step is worth in full's steps (`step_efficiency`,
`ratrain.compare`'s: 0.77 = partial's 150 steps got as far as full's first 116), both final
losses, whether within. `--seeds S,S,...` trains a pair at each `init.seed` into
`DIR/seed-S/`, a line each, then a summary (the mean deviation at the end and step efficiency,
the worst after 20%): one pair of runs is too noisy to judge a job by (docs/history/partial-sync.md). `--set`
overrides both runs; `--full-set` and `--partial-set` one of them (to ask, say, whether the
replicas want another learning rate or clip than full sync's). `--control` trains full sync against
itself instead, the second run with the global batch in half as many micro-batches of twice the
sequences (`DIR/full-regrouped`: the same tokens and the same mathematics, summed in another order)
and judges it by the same bounds, either way: how far rounding alone moves the job's eval loss. A
job whose floor is near the bounds cannot judge them (at `optim.lr` 3e-3 the psync job's was up to
3.4%, docs/history/partial-sync.md, "The job's floor"). `--average P` sets the partial runs' `sync.average` (none: the job's;
after-update, the default: each block averaged after the step's update, into `DIR/partial-H-after`;
before-update, DreamDDP's placement, into `DIR/partial-H`); every subcommand takes it.

`assign` (simulated, no MPI): whether another assignment of blocks to the steps of a period
would pay over round-robin (`sync.assign`): the simulator's step (a period's mean) of the job
under round-robin, contiguous runs of blocks in model order, in backward order (DreamDDP's
schedule puts the output side's layers first, where the most backward is left to hide them),
and balanced by bytes (the largest first into the lightest step).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # tests._partial_ref: partial sync's reference (`curves`)
from record import write_record  # noqa: E402 - after the path above

FULL, REGROUPED = "full", "full-regrouped"
TOL, AFTER, FINAL_TOL, MIN_SPEEDUP = 0.02, 0.2, 0.01, 1.3  # the (the recipe's) bounds


def partial_name(period: int, average: str) -> str:
    """A partial run's (or variant's) name: partial-H, with -after under sync.average
    after-update."""
    return f"partial-{period}" + ("-after" if average == "after-update" else "")


def partial_sets(period: int, average: str | None) -> list[str]:
    """The overrides of partial sync at `period` (`average`: None, the job's placement)."""
    return ["sync.mode=partial", f"sync.period={period}",
            *([f"sync.average={average}"] if average else [])]


def variants(periods, averages) -> dict[str, list[str]]:
    """Variant name -> its `--set` overrides: full sync, then partial at each period and
    placement (`sync.average` values)."""
    out = {FULL: ["sync.mode=full"]}
    for h in periods:
        for a in averages:
            out[partial_name(h, a)] = partial_sets(h, a)
    return out


def worker(args) -> None:
    """Every rank: the variants in rotated rounds; rank 0 prints one JSON object each."""
    from mpi4py import MPI  # the benchmark's ranks

    from ratrain.config import load_config
    from ratrain.runtime.bench import job_rounds
    from ratrain.plan.simulate import simulate_config

    comm = MPI.COMM_WORLD
    job = json.loads(Path(args.worker).read_text())
    cfgs = {name: load_config(args.config, [*job["sets"], *sets])
            for name, sets in job["variants"].items()}
    for cfg in cfgs.values():
        cfg.check_world(comm.Get_size())
    runs = job_rounds(cfgs, comm, args.rounds, args.skip, args.steps)
    if comm.Get_rank() != 0:
        return
    for name, rs in runs.items():
        cfg = cfgs[name]
        step = statistics.median(x["window_step_s"] for x in rs)
        sim = simulate_config(cfg, with_memory=False)
        pred = sim.step_s * cfg.platform.time_scale
        waits = rs[-1]["stage0"]
        print(json.dumps({
            "case": name, "dp": cfg.parallel.dp, "sync": cfg.sync.mode,
            "period": cfg.sync.period if cfg.sync.partial else 1,
            **({"average": cfg.sync.average} if cfg.sync.partial else {}),
            "step_s": round(step, 4), "rounds": [x["window_step_s"] for x in rs],
            "steps_per_s": round(1 / step, 4), "predicted_step_s": round(pred, 4),
            "measured_over_predicted": round(step / pred, 3),
            "exposed_wait_s": round(waits.get("wait_sync", 0.0) + waits.get("wait_avg", 0.0), 4),
            "predicted_exposed_s": round(sim.comm_exposed_s * cfg.platform.time_scale, 4),
            "compute_s": rs[-1]["compute_s"], "host_busy": max(x["host_busy"] for x in rs),
            "overruns": rs[-1]["overruns"], "loss": rs[-1]["loss"],
        }), flush=True)


def _launch(args) -> list[str]:
    py = sys.executable
    mpirun = os.environ.get("MPIRUN", str(Path(py).with_name("mpirun")))
    return (shlex.split(args.launcher) + ["-n", str(args.ranks)] if args.launcher
            else [mpirun, "-n", str(args.ranks), "--oversubscribe"])


def speed(args, argv) -> int:
    periods = [int(x) for x in args.periods.split(",")]
    if (args.steps - args.skip) % max(periods):
        print(f"error: --steps - --skip = {args.steps - args.skip} must be a whole number of "
              f"periods ({max(periods)})", file=sys.stderr)
        return 2
    from ratrain.config import load_config

    averages = _averages(args) or [load_config(args.config, args.set).sync.average]
    job = {"sets": args.set, "variants": variants(periods, averages)}
    load_before = round(os.getloadavg()[0], 2)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    cmd = [*_launch(args), sys.executable, str(Path(__file__).resolve()), "worker",
           "--config", args.config, "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--skip", str(args.skip), "--worker", f.name]
    out = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True)
    os.unlink(f.name)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or len(rows) != len(job["variants"]):
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        print(f"error: the measurement exited {out.returncode}", file=sys.stderr)
        return 1
    full = rows[0]
    summary: dict = {"load_before": load_before, "load_after": round(os.getloadavg()[0], 2)}
    for r in rows:
        print(json.dumps(r))
        for k in ("step_s", "steps_per_s", "predicted_step_s", "measured_over_predicted",
                  "exposed_wait_s", "host_busy"):
            summary[f"{r['case']}.{k}"] = r[k]
        summary[f"{r['case']}.within_10pct"] = abs(r["measured_over_predicted"] - 1) <= 0.1
    for r in rows[1:]:
        summary[f"{r['case']}_over_full"] = round(r["steps_per_s"] / full["steps_per_s"], 3)
        summary[f"{r['case']}_over_full_predicted"] = round(
            full["predicted_step_s"] / r["predicted_step_s"], 3)
    print(json.dumps(summary))
    if args.record:
        write_record(args.record, "python benchmarks/psync.py " + shlex.join(argv), summary,
                     load_before)
    return 0


def quality(args, argv) -> int:
    """Train full, then partial; judge partial against full with `ratrain.compare`."""
    from ratrain.config import load_config

    out, (average,) = Path(args.out), _averages(args) or [None]
    job = load_config(args.config, args.set)
    name = partial_name(args.period, average or job.sync.average)
    runs = {FULL: out / FULL, name: out / name}
    sets = {FULL: ["sync.mode=full"], name: partial_sets(args.period, average)}
    extra = job.run.steps // 2 if args.extra_steps is None else args.extra_steps
    sets[name].append(f"run.steps={job.run.steps + extra}")
    load_before = round(os.getloadavg()[0], 2)
    for name, run_dir in runs.items():
        over = [x for s in (*args.set, *sets[name], f"run.dir={run_dir}") for x in ("--set", s)]
        cmd = [*_launch(args), sys.executable, "-m", "ratrain.train", "--config", args.config,
               *over]
        print("+ " + shlex.join(cmd), flush=True)
        if subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT))).returncode:
            print(f"error: the {name} run failed", file=sys.stderr)
            return 1
    full, partial = str(runs[FULL]), str(runs[name])
    cmp = [sys.executable, "-m", "ratrain.compare", partial, full, "--key", "eval_loss",
           "--tol", str(TOL), "--after", str(AFTER), "--final-tol", str(FINAL_TOL), "--worse-only",
           "--time-to-final", "--min-speedup", str(MIN_SPEEDUP), "--step-efficiency",
           "--prefix"] + (
               ["--png", args.png] if args.png else [])
    print("+ " + shlex.join(cmp), flush=True)
    res = subprocess.run(cmp, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    figures = dict(x.split("=", 1) for line in res.stdout.splitlines() for x in line.split()
                   if "=" in x)
    summary = {k: float(v) for k, v in figures.items()}
    summary.update(passed=res.returncode == 0, load_before=load_before,
                   load_after=round(os.getloadavg()[0], 2))
    print(json.dumps(summary))
    if args.record:
        write_record(args.record, "python benchmarks/psync.py " + shlex.join(argv), summary,
                     load_before)
    return res.returncode


def _curve(cfg, partial: bool, path: Path, regroup: bool = False) -> None:
    """Train `cfg` in one process (see the module) and write its evals to `path`; `regroup`
    (full sync only): the global batch in half as many micro-batches of twice the sequences."""
    import time
    from dataclasses import replace

    import numpy as np

    from ratrain.data import check_data, eval_batches, open_datasets
    from ratrain.runtime.rank import build_rank

    from tests._partial_ref import Replicas

    dp, m = cfg.parallel.dp, cfg.parallel.num_micro_batches
    train, ev = open_datasets(cfg, check_data(cfg, None))
    shares = [eval_batches(ev, cfg.data.eval_batches, r) for r in range(dp)]
    if partial:
        reps = Replicas(cfg)
        exs, ranks = reps.executors, reps.ranks
    else:  # one rank with the whole global batch
        g = 2 if regroup else 1
        whole = replace(cfg.parallel, dp=1, micro_batch=cfg.parallel.micro_batch * g,
                        num_micro_batches=m * dp // g)
        ranks = [build_rank(replace(cfg, parallel=whole), None)]
        exs = [ranks[0].executor]

    def joined(parts):  # the replicas' (inputs, targets) as the whole rank's micro-batches
        return tuple(np.concatenate([p[i] for p in parts]).reshape(
            whole.num_micro_batches, whole.micro_batch, -1) for i in range(2))

    whole_eval = None if partial else [joined([s[k] for s in shares])
                                       for k in range(len(shares[0]))]
    t0, out = time.perf_counter(), []
    for step in range(cfg.run.steps):
        batches = [train.batch_for_step(step, r) for r in range(dp)]
        if partial:
            reps.step(step, batches)
        else:
            exs[0].run_step(step, joined(batches))
        if (step + 1) % cfg.data.eval_interval:
            continue
        rec = {"step": step + 1, "elapsed_s": round(time.perf_counter() - t0, 3)}
        if partial:  # the replicas' mean loss (the trainer's), and the mean model's
            rec["eval_loss"] = float(np.mean([ex.eval_loss(sh) for ex, sh in zip(exs, shares)]))
            own = exs[0].state.master_buf.copy()
            exs[0].state.master_buf[...] = reps.mean_master()
            rec["mean_model"] = float(np.mean([exs[0].eval_loss(sh) for sh in shares]))
            exs[0].state.master_buf[...] = own
        else:
            rec["eval_loss"] = exs[0].eval_loss(whole_eval)
        out.append(rec)
    for r in ranks:
        r.close()
    path.mkdir(parents=True, exist_ok=True)
    (path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))


def curves(args) -> int:
    """Full and partial sync's eval curves in one process (see the module) at each seed of
    `--seeds` (none: the config's), each pair judged by the recipe's bounds; exit 0 when every
    pair is within them. `--control`: full against itself regrouped instead (the job's floor)."""
    from ratrain.compare import judge, read_metrics, step_efficiency
    from ratrain.config import load_config

    if args.control:  # refused before any work, in one line
        extra = [*(f"--partial-set {x}" for x in args.partial_set),
                 *(["--average " + args.average] if args.average else [])]
        if extra:
            print(f"psync curves: --control trains no partial run; drop {' '.join(extra)}",
                  file=sys.stderr)
            return 2
        par = load_config(args.config, [*args.set, *args.full_set]).parallel
        if par.dp * par.num_micro_batches % 2:
            print(f"psync curves: --control halves the global batch's {par.dp} x "
                  f"{par.num_micro_batches} micro-batches (parallel.dp x num_micro_batches), "
                  "an odd count; make either even", file=sys.stderr)
            return 2
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    other = "regrouped" if args.control else "partial"
    average = (_averages(args) or [None])[0]
    rows = []
    for seed in seeds:
        base = [*args.set, "platform.emulate=false",
                *([f"init.seed={seed}"] if seed is not None else [])]
        out = Path(args.out) / (f"seed-{seed}" if args.seeds else "")
        full_cfg = load_config(args.config, [*base, *args.full_set, "sync.mode=full"])
        _curve(full_cfg, False, out / FULL)
        if args.control:
            name = REGROUPED
            _curve(full_cfg, False, out / name, regroup=True)
        else:
            cfg = load_config(args.config, [*base, *args.partial_set,
                                            *partial_sets(args.period, average)])
            name = partial_name(args.period, cfg.sync.average)
            _curve(cfg, True, out / name)
        part, full = (read_metrics(str(out / r), "eval_loss") for r in (name, FULL))
        # partial is judged where it is worse; rounding's deviations count either way
        worst, _, steps, devs = judge(part, full, AFTER, worse_only=not args.control)
        last = steps[-1]
        rows.append({"seed": seed, "period": 0 if args.control else args.period,
                     **({"average": cfg.sync.average} if not args.control else {}),
                     "max_after_pct": round(100 * worst, 3),
                     "end_pct": round(100 * (part[last] / full[last] - 1), 3),  # signed
                     "step_efficiency": round(step_efficiency(part, full), 3),
                     "full_final": round(full[last], 4), f"{other}_final": round(part[last], 4),
                     "within": worst <= TOL and devs[-1] <= FINAL_TOL})
        print(json.dumps(rows[-1]), flush=True)
    summary = {"seeds": len(rows), "period": rows[0]["period"],
               "mean_end_pct": round(sum(r["end_pct"] for r in rows) / len(rows), 3),
               "mean_step_efficiency": round(
                   sum(r["step_efficiency"] for r in rows) / len(rows), 3),
               "worst_after_pct": max(r["max_after_pct"] for r in rows),
               "within": all(r["within"] for r in rows)}
    print(json.dumps(summary))
    return 0 if summary["within"] else 1


def assignments(blocks, period: int, size) -> dict[str, dict[str, int]]:
    """Name -> {block: step of the period} for the candidates `assign` compares."""
    n = len(blocks)
    load, lpt = [0.0] * period, {}
    for b in sorted(blocks, key=lambda b: -size(b)):
        k = min(range(period), key=load.__getitem__)
        lpt[b], load[k] = k, load[k] + size(b)
    return {"round-robin": {b: i % period for i, b in enumerate(blocks)},
            "contiguous": {b: min(period - 1, i * period // n) for i, b in enumerate(blocks)},
            "backward-contiguous": {b: min(period - 1, (n - 1 - i) * period // n)
                                    for i, b in enumerate(blocks)},
            "balanced-bytes": lpt}


def assign(args) -> int:
    """The simulator's step of the job under each candidate assignment (see the module)."""
    from ratrain.config import load_config
    from ratrain.exec.spec import block_role
    from ratrain.lifecycle.passes.partial import PartialSync
    from ratrain.lifecycle.pipeline import PipelinePlan
    from ratrain.plan.cost import CostModel
    from ratrain.plan.simulate import Group, simulate_grid
    from ratrain.plan.steps import recompute_for

    average = (_averages(args) or [None])[0]
    for h in (int(x) for x in args.periods.split(",")):
        cfg = load_config(args.config, [*args.set, *partial_sets(h, average)])
        cost, base = CostModel.from_config(cfg), PipelinePlan.from_config(cfg)
        blocks = [b for s in base.blocks for b in s]
        row = {"period": h}
        size = {b: cost.grad_bytes(block_role(b)) for b in blocks}
        for name, phase in assignments(blocks, h, size.__getitem__).items():
            plan = base.with_pass(PartialSync(h, phase, base.pass_named("partial").after))
            res = simulate_grid([Group(tuple(range(base.dp)), plan, (cost,) * base.pp)],
                                recompute_for(plan.blocks, cfg.schedule.recompute, None), 1)
            row[name] = round(res.step_s * cfg.platform.time_scale, 4)
        row["best_over_round_robin"] = round(row["round-robin"] / min(
            v for k, v in row.items() if k not in ("period", "round-robin")), 3)
        print(json.dumps(row), flush=True)
    return 0


def _averages(args) -> list[str]:
    """`--average`'s placements (none: the job's own)."""
    return [x for x in args.average.split(",") if x]


def _check_averages(args) -> str:
    """A one-line refusal of `--average`, or ''."""
    from ratrain.config import SyncConfig

    got = _averages(args)
    wrong = [x for x in got if x not in SyncConfig.AVERAGES]
    if wrong:
        return (f"--average {wrong[0]!r} is not one of: {', '.join(SyncConfig.AVERAGES)} "
                "(sync.average)")
    if len(got) > 1 and args.what != "speed":
        return f"--average {args.average}: {args.what} trains one placement; name one"
    return ""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("speed", "quality", "assign", "curves", "worker"))
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], help="overrides of every variant")
    ap.add_argument("--full-set", action="append", default=[], help="curves: full's alone")
    ap.add_argument("--partial-set", action="append", default=[], help="curves: partial's alone")
    ap.add_argument("--seeds", default="", help="curves: init.seed values, e.g. 1234,1,2")
    ap.add_argument("--average", default="",
                    help="sync.average of the partial runs (default: the job's); speed: a "
                         "comma list, a variant each")
    ap.add_argument("--control", action="store_true",
                    help="curves: full sync against itself regrouped (rounding alone)")
    ap.add_argument("--periods", default="4", help="speed: partial sync's periods H")
    ap.add_argument("--period", type=int, default=4, help="quality: partial sync's period")
    ap.add_argument("--extra-steps", type=int, default=None,
                    help="quality: steps the partial run trains past full's last (default: half "
                    "the job's run.steps)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--launcher", default="", help="instead of mpirun -n RANKS --oversubscribe")
    ap.add_argument("--out", default="runs/psync-quality", help="quality: the runs' directory")
    ap.add_argument("--png", default="", help="quality: the curves (ratrain.compare --png)")
    ap.add_argument("--record", default="")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    bad = _check_averages(args)
    if args.extra_steps is not None and args.extra_steps < 0:
        bad = f"--extra-steps {args.extra_steps}: give 0 or more steps"
    if bad:
        print(f"psync {args.what}: {bad}", file=sys.stderr)
        return 2
    if args.what == "worker":
        worker(args)
        return 0
    if args.what == "assign":
        return assign(args)
    if args.what == "curves":
        return curves(args)
    return (speed if args.what == "speed" else quality)(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
