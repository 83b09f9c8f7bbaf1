"""Memory over a long run (issue 33): each rank's resident set, step by step, from metrics.jsonl
(`rss_bytes_by_rank`, measured at each step's gradient norm), at 1 rank and at pp 2 x dp 2,
`run.trace` off; and with it on, the timeline kept against `run.trace_bytes`.

    python benchmarks/soak.py --steps 20000 --cases 1x1,pp2xdp2,1x1-trace --work /tmp/soak
    python benchmarks/record.py soak -- .venv/bin/python benchmarks/soak.py ...

The job (`--job small`, the default): a 4-layer, hidden-32 model on random tokens, evaluated
and checkpointed every 500 steps (so that the one-time costs, HDF5's import at the first save
among them, come before the base step), so that 20,000 steps take minutes; `--job tiny` runs
jobs/tiny.yaml instead (the issue's soak: 8 layers, hidden 128). Prints one JSON object per
case: every rank's resident MiB at step `--base` (1,000) and at the last step, the largest
growth between them in percent (target: under 5), the ledger's peak; with the trace, the bytes
of timeline kept (events in trace.json x 26) against the bound and the events dropped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _trials import MPIRUN, PY, ROOT as TREE, run  # noqa: E402 - beside this script

SMALL = """model: {{vocab_size: 64, hidden: 32, layers: 4, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}}
parallel: {{micro_batch: 2, num_micro_batches: 2}}
optim: {{lr: 1.0e-3, warmup_steps: 10}}
data: {{tokens: {tokens}, eval_interval: 500, eval_batches: 2}}
checkpoint: {{interval: 500, keep: 1, resume: never}}
run: {{log_interval: 1000, threads: 1}}
"""


def job(work: Path, which: str) -> Path:
    if which == "tiny":
        return TREE / "jobs" / "tiny.yaml"
    import numpy as np

    from ratrain.data import write_tokens

    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in ("t.bin", "t.val.bin"):
        write_tokens(work / name, rng.integers(0, 64, 50000), vocab_size=64)
    path = work / "job.yaml"
    path.write_text(SMALL.format(tokens=work / "t.bin"))
    return path


def soak(cfg: Path, case: str, steps: int, base: int, trace_bytes: int, work: Path) -> dict:
    run_dir = work / case
    shutil.rmtree(run_dir, ignore_errors=True)
    ranks = 4 if case.startswith("pp2xdp2") else 1
    cmd = [PY, "-m", "ratrain.train", "--config", str(cfg), "--set", f"run.dir={run_dir}",
           "--set", f"run.steps={steps}", "--set", "checkpoint.resume=never",
           "--set", "run.log_interval=1000"]
    if ranks > 1:
        cmd = [MPIRUN, "-n", "4", "--oversubscribe", *cmd, "--set", "parallel.pp=2",
               "--set", "parallel.dp=2"]
    trace = case.endswith("-trace")
    if trace:
        cmd += ["--set", "run.trace=true", "--set", f"run.trace_bytes={trace_bytes}"]
    p = run(cmd, timeout=6 * 3600)
    if p.returncode != 0:
        raise SystemExit(f"{case}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    with open(run_dir / "metrics.jsonl") as f:
        recs = {r["step"]: r for r in map(json.loads, f) if "loss" in r}
    first, last = recs[base], recs[max(recs)]
    growth = [100.0 * (b / a - 1.0) for a, b in
              zip(first["rss_bytes_by_rank"], last["rss_bytes_by_rank"])]
    out = {"case": case, "ranks": ranks, "steps": max(recs), "base_step": base,
           "rss_mib_base": [round(b / 2**20, 1) for b in first["rss_bytes_by_rank"]],
           "rss_mib_end": [round(b / 2**20, 1) for b in last["rss_bytes_by_rank"]],
           "growth_pct_max": round(max(growth), 2),
           "ledger_peak_mib": round(max(r["peak_ddr_bytes"] for r in recs.values()) / 2**20, 2)}
    out["rss_mib_base"] = ",".join(map(str, out["rss_mib_base"]))  # records keep scalars
    out["rss_mib_end"] = ",".join(map(str, out["rss_mib_end"]))
    if trace:
        events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
        per_rank: dict[int, int] = {}
        for e in events:
            if e.get("ph") == "X":
                per_rank[e["pid"]] = per_rank.get(e["pid"], 0) + 1
        dropped = sum("oldest events dropped" in e["args"]["name"] for e in events
                      if e.get("name") == "process_name")
        out.update(trace_bytes_bound=trace_bytes,
                   timeline_bytes_kept_max=26 * max(per_rank.values()),
                   ranks_that_dropped=dropped,
                   under_bound=26 * max(per_rank.values()) <= trace_bytes)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--base", type=int, default=1000, help="the step growth is measured from")
    ap.add_argument("--cases", default="1x1,pp2xdp2,1x1-trace")
    ap.add_argument("--trace-bytes", type=int, default=1 << 20)
    ap.add_argument("--job", choices=("small", "tiny"), default="small")
    ap.add_argument("--work", default="/tmp/ratrain-soak")
    args = ap.parse_args(argv)
    work = Path(args.work)
    cfg = job(work, args.job)
    worst = 0.0
    for case in args.cases.split(","):
        row = soak(cfg, case, args.steps, args.base, args.trace_bytes, work)
        print(json.dumps(row), flush=True)
        worst = max(worst, row["growth_pct_max"])
    return 0 if worst < 5.0 else 1


if __name__ == "__main__":
    sys.exit(main())
