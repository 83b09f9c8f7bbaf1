"""Whole-step speed of two ratrain checkouts, interleaved in one run (an A/B of a change).

    python benchmarks/ab_step.py OLD_TREE NEW_TREE [--precision fp32] [--rounds 15] [--threads 2]
    python benchmarks/ab_step.py . . --old-env RATRAIN_FUSED=0     # one tree, two settings
    python benchmarks/ab_step.py OLD NEW --set model.vocab_size=32000  # the model changed

Each tree gets a worker process of its own (`PYTHONPATH=TREE`) that builds `ratrain.bench`'s
benchmark model through that tree's own code (`runtime_step(bench_config(...))`) and times one
training step per request; the two alternate step by step, so both see the same machine load.
Prints the host's load average, each tree's median step time and the median of the per-round
ratios (new / old: below 1 is faster). Both trees must have `ratrain.bench.runtime_step` and
`bench_config` (every commit since the single-rank benchmark has).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = """
import json, sys, time
from ratrain.bench import bench_config, runtime_step
from ratrain.shim import allocator
allocator.tune()
step, _ = runtime_step(bench_config(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])))
print("ready", flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    step()
    print(repr(time.perf_counter() - t), flush=True)
"""


def worker(tree: str, precision: str, threads: int, extra_env=(), sets=()) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    env.update(kv.split("=", 1) for kv in extra_env)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, precision, str(threads),
                             json.dumps(list(sets))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.abspath(tree))
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"the worker of {tree} did not start (exit {proc.wait()})")
    return proc


def step(proc) -> float:
    proc.stdin.write("step\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the reference checkout (a git worktree)")
    ap.add_argument("new", help="the checkout under test")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "fp16"))
    ap.add_argument("--rounds", type=int, default=15, help="timed steps of each tree")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each tree first")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of each worker")
    ap.add_argument("--old-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the old side only (repeatable)")
    ap.add_argument("--new-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the new side only (repeatable)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                    help="a config override of the benchmark model for both sides (repeatable)")
    ap.add_argument("--record", metavar="NAME", default=None,
                    help="also write docs/records/NAME.json (the shared record format)")
    a = ap.parse_args(argv)
    load0 = os.getloadavg()
    procs = {"old": worker(a.old, a.precision, a.threads, a.old_env, a.sets),
             "new": worker(a.new, a.precision, a.threads, a.new_env, a.sets)}
    times = {k: [] for k in procs}
    try:
        for r in range(a.warmup + a.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for k in order:
                t = step(procs[k])
                if r >= a.warmup:
                    times[k].append(t)
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait()
    ratios = [n / o for n, o in zip(times["new"], times["old"])]
    out = {
        "precision": a.precision, "threads": a.threads, "rounds": a.rounds, "sets": a.sets,
        "load_before": [round(x, 2) for x in load0],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "old_step_s": round(statistics.median(times["old"]), 4),
        "new_step_s": round(statistics.median(times["new"]), 4),
        "new_over_old": round(statistics.median(ratios), 4),
        "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
    }
    print(json.dumps(out))
    if a.record:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from record import write_record  # the shared record writer, beside this script

        figures = {k: v for k, v in out.items() if not isinstance(v, list)}
        figures["ratio_min"], figures["ratio_max"] = out["ratio_range"]
        cmd = "python benchmarks/ab_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
        print("record:", write_record(a.record, cmd, figures, load_before=load0[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
