"""Elastic mode against planted faults: pp 2 x dp 3 of jobs/tiny.yaml under `mpirun --with-ft
ulfm`, one rank killed (or stopped, or raising) at each moment in turn, in a random step, each
run checked against a run resumed from the same step's checkpoint on the shrunk layout.

    python benchmarks/faults_elastic.py --cases 20 --kinds kill [--seed 1] [--tokens PATH]
        [--respawn]

The moments: a step's forward, backward, gradient sync (started, waited), global facts, update,
a view's gather, a checkpoint write (the sharded state gathered block by block) and between
steps (`tests/_faulty.py` plants them). First an uninterrupted run writes a checkpoint every
step; then each case runs, and the steps after its recovery are compared, bit for bit, with a
run resumed from the checkpoint of the step before the redone one on the layout the survivors
went on as (one such run per distinct step, cached). One JSON line per case: where the fault
was, the exit status, the lost ranks, the step redone and how many steps ran twice, the seconds
from the fault to the new job (its ready time, in metrics.jsonl's event) and whether the curves
match; then a summary line. `--respawn`: a spare slot takes each lost rank's place
(`elastic.respawn`), so the run goes on as pp 2 x dp 3 and is compared with a run resumed on
that layout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MPIRUN = str(Path(PY).with_name("mpirun")) if Path(PY).with_name("mpirun").exists() else "mpirun"
WHERE = ("_forward", "_backward", "_sync_grad", "_wait_grad", "_grad_norm", "_update",
         "_materialize_view", "save", "between")
STEPS, PP, DP = 12, 2, 3


def env() -> dict:
    e = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_mpi_yield_when_idle="1", PYTHONPATH=str(ROOT))
    return e


def common(tokens: str, run_dir: str, steps: int = STEPS) -> list[str]:
    sets = [f"data.tokens={tokens}", "data.eval_interval=0", f"parallel.pp={PP}",
            f"run.dir={run_dir}", f"run.steps={steps}", "run.log_interval=100"]
    return ["--config", str(ROOT / "jobs" / "tiny.yaml")] + [x for s in sets for x in ("--set", s)]


def launch(n: int, args: list[str], log: str, ft: bool = False, timeout: int = 600) -> int:
    cmd = [MPIRUN, "--oversubscribe", *(["--with-ft", "ulfm"] if ft else []), "-n", str(n),
           PY, *args]
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(),
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return -9


def losses(run_dir: str) -> dict:
    out = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        d = json.loads(line)
        if "loss" in d:
            out[d["step"]] = (d["loss"], d["grad_norm"])
    return out


def events(run_dir: str) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if '"event"' in x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--kinds", default="kill", help="comma-separated: kill, stop, raise")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens", default="", help="a token file (default: prepare the corpus)")
    ap.add_argument("--timeout", type=float, default=4.0, help="comm.timeout for stop cases")
    ap.add_argument("--respawn", action="store_true", help="elastic.respawn: the layout returns")
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ratrain-elastic-")
    tokens = a.tokens
    if not tokens:
        subprocess.run([PY, "-m", "ratrain.data", "prepare", "--out", f"{work}/train.bin"],
                       check=True, env=env(), stdout=subprocess.DEVNULL)
        tokens = f"{work}/train.bin"
    rng = random.Random(a.seed)
    ref = f"{work}/ref"
    rc = launch(PP * DP, ["-m", "ratrain.train", *common(tokens, ref), "--set",
                          f"parallel.dp={DP}", "--set", "checkpoint.interval=1", "--set",
                          f"checkpoint.keep={STEPS + 1}", "--set", "checkpoint.resume=never"],
                f"{work}/ref.log")
    if rc != 0:
        print(json.dumps({"error": f"the uninterrupted run failed ({rc}): {work}/ref.log"}))
        return 1
    full, resumed, rows = losses(ref), {}, []
    for i in range(a.cases):
        kind = a.kinds.split(",")[i % len(a.kinds.split(","))]
        # the moments in turn (each at least twice in 20 cases), the rank and step at random
        where = WHERE[i % len(WHERE)]
        rank, step = rng.randrange(PP * DP), rng.randrange(2, STEPS - 2)
        run = f"{work}/case{i}"
        sets = ["elastic.enabled=true", f"parallel.dp={DP}", "checkpoint.resume=never",
                f"elastic.respawn={str(a.respawn).lower()}",
                "checkpoint.interval=" + ("3" if where == "save" else "0")]
        if kind == "stop":
            sets.append(f"comm.timeout={a.timeout:g}")
        if where == "save":
            step = 3 * rng.randrange(1, STEPS // 3) - 1  # a step whose checkpoint is written
        args = [str(ROOT / "tests" / "_faulty.py"), f"{kind}:{rank}:{step}:{where}",
                *common(tokens, run)] + [x for s in sets for x in ("--set", s)]
        rc = launch(PP * DP, args, f"{run}.log", ft=True)
        row = {"case": i, "kind": kind, "rank": rank, "step": step + 1, "where": where,
               "exit_status": rc}
        try:
            ev = events(run)[0]
            fault = json.load(open(f"{run}/fault.json"))
            redo = ev["step_redone"]
            key = redo - 1
            if key not in resumed:
                out = f"{work}/resumed{key}"
                shrunk = [f"parallel.dp={DP}", *ev["overrides"]]  # the later one holds
                dp = int([x for x in shrunk if x.startswith("parallel.dp=")][-1].split("=")[1])
                over = [y for x in shrunk for y in ("--set", x)]
                launch(PP * dp, ["-m", "ratrain.train", *common(tokens, out), *over,
                                 "--set", "checkpoint.interval=0", "--set",
                                 f"checkpoint.resume={ref}/checkpoints/ckpt-{key:06d}"],
                       f"{out}.log")
                resumed[key] = losses(out)
            got = losses(run)
            row.update(lost=ev["lost_ranks"], step_redone=redo, layout=ev["layout"],
                       redone_steps=max(0, step + 1 - key),
                       fault_to_ready_s=round(ev["time"] - fault["time"], 3),
                       before_equal=all(got[s] == full[s] for s in range(1, redo)),
                       after_equal=all(got[s] == resumed[key][s] for s in range(redo, STEPS + 1)),
                       finished=rc == 0 and max(got) == STEPS)
        except (OSError, IndexError, KeyError, ValueError) as e:
            row.update(finished=False, error=f"{type(e).__name__}: {e} ({run}.log)")
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = [r for r in rows if r.get("finished") and r.get("after_equal") and r.get("before_equal")]
    times = [r["fault_to_ready_s"] for r in rows if "fault_to_ready_s" in r]
    print(json.dumps({"cases": len(rows), "finished_equal": len(ok),
                      "max_redone_steps": max((r.get("redone_steps", 99) for r in rows), default=0),
                      "median_fault_to_ready_s": statistics.median(times) if times else None,
                      "max_fault_to_ready_s": max(times) if times else None,
                      "kinds": a.kinds, "seed": a.seed, "respawn": a.respawn}), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
