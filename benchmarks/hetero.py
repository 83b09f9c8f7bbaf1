"""Issue 21's targets: plans of one mixed-cluster job, measured interleaved in one run, beside
the simulator's prediction of each.

    python benchmarks/hetero.py --config jobs/mixed.yaml [--plan NAME:KEY=VAL;KEY=VAL ...]
        [--ranks 8] [--rounds 3] [--steps 6] [--skip 2] [--launcher "CMD ..."] [--record NAME]

Each `--plan` is a name and the `--set` overrides that make it from the job (`auto` keys are
resolved by the planner for the ranks' classes, as the trainer does at start-up). Without
`--plan`, the planner's own two, chosen on the ranks where their classes are known (by rank or
by node): its best plan (`asymmetric`) and its best symmetric one (`symmetric`)
(`ratrain.plan.hetero.best_plans`); with `--versus-uniform`, its best plan (`mixed`) and its
best plan for a uniform cluster of the same total compute (`uniform`,
`ratrain.plan.hetero.uniform_like`). The plans run under one `mpirun -n RANKS` (or the
`--launcher` prefix, e.g. `scripts/cluster.sh run --name hx --` for emulated nodes), each a few
steps of the job as the trainer wires it (`runtime.bench`'s `_job_run`: DDR cap, link
throttle, compute and DDR pacing per rank class), in `--rounds` rotated rounds; the median step
gives tokens/s. Printed, one JSON object per plan: its layout, measured and predicted tokens/s
(the simulator's step x time_scale), and their ratio; then a summary with each plan's speed
over the first's (`--record NAME` writes it as docs/records/NAME.json).
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
from record import write_record  # noqa: E402 - after the path above


def plan_sets(spec: str) -> tuple[str, list[str]]:
    name, _, sets = spec.partition(":")
    return name, [s for s in sets.split(";") if s.strip()]


def worker(args) -> None:
    """Every rank: the plans (given, or the planner's for the ranks' classes, found here where
    the classes are known: by rank or by node), run in rotated rounds; rank 0 prints one JSON
    object per plan."""
    from dataclasses import replace

    from mpi4py import MPI  # the benchmark's ranks

    from ratrain.config import load_config
    from ratrain.runtime.bench import job_rounds
    from ratrain.plan.hetero import best_plans, predict, uniform_like
    from ratrain.train.startup import rank_classes

    comm = MPI.COMM_WORLD
    job = json.loads(Path(args.worker).read_text())
    cfgs, classes = {}, {}

    def add(name, cfg, cl=None):
        cfg = replace(cfg, run=replace(cfg.run, steps=args.steps))
        cfg.check_world(comm.Get_size())
        cfgs[name], classes[name] = rank_classes(cfg, comm) if cl is None else (cfg, cl)

    if job["mode"] == "given":
        for name, sets in job["plans"].items():
            add(name, load_config(args.config, sets))
    else:
        base, cl = rank_classes(load_config(args.config, job["sets"]), comm)
        def plans_of(c, classes_):  # planned once, on rank 0, for every rank
            return comm.bcast(best_plans(c, classes_) if comm.Get_rank() == 0 else None)

        best = plans_of(base, cl)
        add("mixed" if job["mode"] == "versus-uniform" else "asymmetric", best["asymmetric"], cl)
        if job["mode"] == "versus-uniform":
            uni, ucl = rank_classes(uniform_like(base, cl), comm)
            add("uniform", plans_of(uni, ucl)["symmetric"], ucl)
        else:
            add("symmetric", best["symmetric"], cl)
    runs = job_rounds(cfgs, comm, args.rounds, args.skip, args.steps)
    if comm.Get_rank() != 0:
        return
    for name, rs in runs.items():
        cfg = cfgs[name]
        p = cfg.parallel
        step = statistics.median(x["step_s"] for x in rs)
        tokens = p.global_batch * cfg.model.seq_len
        pred = predict(cfg, classes[name])
        print(json.dumps({
            "case": name, "pp": p.pp, "dp": p.dp, "placement": p.placement,
            "layers": list(p.layers_per_stage or []), "shares": list(p.shares),
            "policy": cfg.schedule.policy, "step_s": round(step, 4),
            "rounds": [x["step_s"] for x in rs], "tokens_per_s": round(tokens / step, 2),
            "predicted_tokens_per_s": round(pred, 2),
            "measured_over_predicted": round(tokens / step / pred, 3),
            "host_busy": max(x["host_busy"] for x in rs), "overruns": rs[-1]["overruns"],
        }), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--plan", action="append", default=[])
    ap.add_argument("--set", action="append", default=[], help="overrides of every plan")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--launcher", default="", help="instead of mpirun -n RANKS --oversubscribe")
    ap.add_argument("--versus-uniform", action="store_true",
                    help="the planner's plan against a uniform cluster of the same total compute")
    ap.add_argument("--record", default="")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.plan:
        plans = {n: [*args.set, *s] for n, s in map(plan_sets, args.plan)}
        job = {"mode": "given", "plans": plans}
    else:
        job = {"mode": "versus-uniform" if args.versus_uniform else "planner", "sets": args.set}
        plans = ["", ""]  # two: the planner's pair
    load_before = round(os.getloadavg()[0], 2)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    py = sys.executable
    mpirun = os.environ.get("MPIRUN", str(Path(py).with_name("mpirun")))
    launch = (shlex.split(args.launcher) + ["-n", str(args.ranks)] if args.launcher
              else [mpirun, "-n", str(args.ranks), "--oversubscribe"])
    cmd = [*launch, py, str(Path(__file__).resolve()), "--config", args.config,
           "--rounds", str(args.rounds), "--steps", str(args.steps), "--skip", str(args.skip),
           "--worker", f.name]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    os.unlink(f.name)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or len(rows) != len(plans):
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        print(f"error: the measurement exited {out.returncode}", file=sys.stderr)
        return 1
    first = rows[0]
    summary: dict = {}
    for r in rows:
        print(json.dumps(r))
        for k in ("tokens_per_s", "predicted_tokens_per_s", "measured_over_predicted",
                  "host_busy", "step_s"):
            summary[f"{r['case']}.{k}"] = r[k]
        summary[f"{r['case']}.within_10pct"] = abs(r["measured_over_predicted"] - 1) <= 0.1
        summary[f"{r['case']}.plan"] = (f"pp{r['pp']}xdp{r['dp']} {r['placement']} layers "
                                        f"{r['layers'] or 'even'} shares {r['shares']} "
                                        f"{r['policy']}")
    for r in rows[1:]:
        summary[f"{first['case']}_over_{r['case']}"] = round(
            first["tokens_per_s"] / r["tokens_per_s"], 3)
        summary[f"{first['case']}_over_{r['case']}_predicted"] = round(
            first["predicted_tokens_per_s"] / r["predicted_tokens_per_s"], 3)
    print(json.dumps(summary))
    if args.record:
        command = "python benchmarks/hetero.py " + shlex.join(argv if argv is not None
                                                               else sys.argv[1:])
        write_record(args.record, command, summary, load_before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
