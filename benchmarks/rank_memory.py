"""A rank's whole memory, where it goes (issue 33): every rank of a job samples its own memory
(/proc/self/smaps_rollup) at each phase of its life, with the fused kernels on (the default)
and off (RATRAIN_FUSED=0), beside the ledger's peak and the resident set metrics.jsonl holds.

    python benchmarks/rank_memory.py --ranks 64 --pp 8 --dp 8 --steps 10 --work /tmp/rank-mem
    python benchmarks/record.py rank-memory-64 -- .venv/bin/python benchmarks/rank_memory.py ...

Phases: the interpreter started; `ratrain.train` imported (the command's whole import); MPI
started; the start-up checks done; the rank built (its buffers, its recompute measurement, and
with the fused path on numba imported and its kernels loaded from numba's cache); the steps
done. Per phase the median and the largest over ranks of RSS (what the issue's target counts:
every page the rank maps, shared ones included), PSS (shared pages divided among the processes
that map them: what the host really holds per rank) and anonymous memory (the rank's own heap
and buffers). One JSON object per setting (`case`: fused-on, fused-off), with which heavy
packages the ranks loaded.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEAVY = ("numba", "llvmlite", "numba.cuda", "h5py", "torch", "transformers", "cupy")
FIELDS = {"Rss": "rss", "Pss": "pss", "Anonymous": "anon"}


def smaps() -> dict:
    """This process's memory now, MiB: rss, pss, anon."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k, _, rest = line.partition(":")
            if k in FIELDS:
                out[FIELDS[k]] = int(rest.split()[0]) / 1024
    return out


def probe(out_dir: str, argv: list[str]) -> int:
    """One rank of the job: `python -m ratrain.train argv`, its memory sampled at each phase
    (the trainer's own methods wrapped), written to out_dir/rank-N.json."""
    phases = [("started", smaps())]
    import ratrain.train as command
    from ratrain.train import trainer as T

    phases.append(("imported", smaps()))
    from mpi4py import MPI

    phases.append(("mpi", smaps()))
    build, loop = T.Trainer.__init__, T.Trainer._loop

    def init(self, *a, **k):
        phases.append(("checked", smaps()))
        build(self, *a, **k)
        phases.append(("built", smaps()))

    def run(self):
        code = loop(self)
        phases.append(("stepped", smaps()))
        return code

    T.Trainer.__init__, T.Trainer._loop = init, run
    code = command.main(argv)
    rank = MPI.COMM_WORLD.Get_rank()
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "phases": phases,
                   "modules": [m for m in HEAVY if m in sys.modules]}, f)
    return code


def job(args, fused: str) -> dict:
    import subprocess

    from _trials import ENV, MPIRUN, PY, ROOT  # beside this script

    out = Path(args.work) / f"fused-{fused}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    train = ["--config", args.config, "--set", f"parallel.pp={args.pp}",
             "--set", f"parallel.dp={args.dp}", "--set", f"run.steps={args.steps}",
             "--set", f"run.dir={out}/run", "--set", "checkpoint.interval=0",
             "--set", "checkpoint.resume=never", "--set", "data.eval_interval=0"]
    cmd = [PY, str(HERE / "rank_memory.py"), "probe", str(out), "--", *train]
    if args.ranks > 1:
        cmd = [MPIRUN, "-n", str(args.ranks), "--oversubscribe", "-x", "RATRAIN_FUSED", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600,
                       env=dict(ENV, RATRAIN_FUSED=fused))
    if p.returncode != 0:
        raise SystemExit(f"fused={fused}: exit {p.returncode}\n{p.stderr[-3000:]}")
    ranks = [json.load(open(f)) for f in glob.glob(str(out / "rank-*.json"))]
    with open(out / "run" / "metrics.jsonl") as f:
        last = [json.loads(line) for line in f if '"loss"' in line][-1]
    row = {"case": "fused-on" if fused == "1" else "fused-off", "ranks": len(ranks),
           "steps": last["step"],
           "rss_mib_max": round(max(last["rss_bytes_by_rank"]) / 2**20, 1),
           "rss_mib_median": round(statistics.median(last["rss_bytes_by_rank"]) / 2**20, 1),
           "ledger_peak_mib_max": round(max(last["peak_ddr_bytes_by_rank"]) / 2**20, 2),
           "modules": ",".join(sorted({m for r in ranks for m in r["modules"]})) or "-"}
    for i, (name, _) in enumerate(ranks[0]["phases"]):
        for key in FIELDS.values():
            vals = [r["phases"][i][1][key] for r in ranks]
            row[f"{name}.{key}_mib_median"] = round(statistics.median(vals), 1)
            row[f"{name}.{key}_mib_max"] = round(max(vals), 1)
    return row


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:
        return probe(argv[1], argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--config", default=str(HERE.parent / "jobs" / "tiny.yaml"))
    ap.add_argument("--fused", default="1,0", help="RATRAIN_FUSED settings to run")
    ap.add_argument("--work", default="/tmp/ratrain-rank-memory")
    args = ap.parse_args(argv)
    for fused in args.fused.split(","):
        print(json.dumps(job(args, fused)), flush=True)
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(HERE.parent), str(HERE)]  # this tree's ratrain; _trials beside
    sys.exit(main())
