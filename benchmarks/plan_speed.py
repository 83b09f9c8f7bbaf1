"""How long `python -m ratrain.plan` takes for the paper's four models, without a tier and with
each tier of mt3000 (issue 46: at most 60 s on 2 cores, the output unchanged).

    python benchmarks/plan_speed.py [--tree DIR] [--golden DIR] [--models M,...]
        [--tiers none,host,nvme] [--timeout S]

Each run is `python -m ratrain.plan --config jobs/MODEL.yaml [--tier T]` in its own process, on
the code of `--tree` (default this checkout; a worktree of an older commit gives the figures
before). One JSON object a line per run: `case` (model/tier), `wall_s`, `user_s` (the child's
user CPU seconds: on a shared host it moves less than the wall time), `timed_out`, and with
`--golden DIR` whether the output equals DIR/MODEL-TIER.txt (`same`): every line but the
last, which says how long the planning took, and the config's path reduced to its file name.
The last line sums them up: the slowest run's wall and user seconds, and whether all were the
same. A run past `--timeout` is stopped and counted at the timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama2-7b", "baichuan2-13b", "qwen2.5-32b", "llama2-70b")
TIERS = ("none", "host", "nvme")


def _comparable(text: str) -> list[str]:
    """The planner's output without its timing line, the config's path reduced to its name."""
    lines = text.rstrip("\n").split("\n")
    if lines and lines[-1].startswith("(planned in"):
        lines = lines[:-1]
    if lines and lines[0].startswith("model: "):
        path, _, rest = lines[0][len("model: "):].partition("  ")
        lines[0] = f"model: {Path(path).name}  {rest}"
    return lines


def run(tree: Path, model: str, tier: str, timeout: float) -> tuple[dict, str]:
    """One planner run on `tree`'s code: its figures and its output."""
    cmd = [sys.executable, "-m", "ratrain.plan", "--config", str(tree / "jobs" / f"{model}.yaml")]
    cmd += [] if tier == "none" else ["--tier", tier]
    env = dict(os.environ, PYTHONPATH=str(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                             timeout=timeout)
        text, timed_out = out.stdout, False
        if out.returncode:
            raise SystemExit(f"error: {' '.join(cmd)} exited {out.returncode}: {out.stderr}")
    except subprocess.TimeoutExpired:
        text, timed_out = "", True
    wall = time.perf_counter() - t0
    user = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - before
    return {"case": f"{model}/{tier}", "wall_s": round(wall, 2), "user_s": round(user, 2),
            "timed_out": timed_out}, text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code runs")
    ap.add_argument("--golden", type=Path, default=None,
                    help="a directory of MODEL-TIER.txt outputs to compare with")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tiers", default=",".join(TIERS))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    tiers = [t for t in args.tiers.split(",") if t]
    bad = [m for m in models if not (args.tree / "jobs" / f"{m}.yaml").is_file()]
    bad += [t for t in tiers if t not in TIERS]
    if bad:
        print(f"error: unknown model or tier {', '.join(bad)}: models are the jobs/*.yaml of "
              f"--tree, tiers {', '.join(TIERS)}", file=sys.stderr)
        return 2
    rows = []
    for model in models:
        for tier in tiers:
            row, text = run(args.tree.resolve(), model, tier, args.timeout)
            if args.golden is not None and not row["timed_out"]:
                gold = (args.golden / f"{model}-{tier}.txt").read_text()
                row["same"] = _comparable(text) == _comparable(gold)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {"max_wall_s": max(r["wall_s"] for r in rows),
               "max_user_s": max(r["user_s"] for r in rows),
               "timed_out": sum(r["timed_out"] for r in rows)}
    if args.golden is not None:
        summary["all_same"] = all(r.get("same", False) for r in rows)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
