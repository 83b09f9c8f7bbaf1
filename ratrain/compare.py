"""Compare the loss curves of two runs.

    python -m ratrain.compare RUN_A RUN_B [--tol T] [--png FILE] [--key loss]

RUN_A / RUN_B are run directories (holding `metrics.jsonl`) or metrics files. Steps present in
both are compared; the relative deviation of a step is |a - b| / max(|b|, tiny). Prints
`max_rel_dev=<float> steps=<n>` and exits 1 when the maximum is over `--tol`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from ratrain.fileio import atomic_path


def read_metrics(path: str, key: str = "loss") -> dict[int, float]:
    """step -> value of `key` from a run directory (its metrics.jsonl, or eval.jsonl for an
    `eval_*` key) or a metrics file."""
    if os.path.isdir(path):
        path = os.path.join(path, "eval.jsonl" if key.startswith("eval_") else "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"error: {path} does not exist (give a run directory or a metrics.jsonl)")
    out: dict[int, float] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise SystemExit(f"error: {path}:{lineno} is not a JSON object") from None
            if "step" not in rec or key not in rec:
                continue  # eval or summary records
            out[int(rec["step"])] = float(rec[key])  # a resumed run's later record wins
    if not out:
        raise SystemExit(f"error: {path} holds no records with 'step' and {key!r}")
    return out


def compare(a: dict[int, float], b: dict[int, float]) -> tuple[float, list[int], list[float]]:
    steps = sorted(set(a) & set(b))
    devs = []
    for s in steps:
        x, y = a[s], b[s]
        if math.isnan(x) or math.isnan(y):
            devs.append(0.0 if math.isnan(x) and math.isnan(y) else math.inf)
        else:
            devs.append(abs(x - y) / max(abs(y), 1e-30))
    return (max(devs) if devs else 0.0), steps, devs


def plot(png: str, a, b, steps, devs, names, key) -> None:
    """Draw both curves and their relative difference into the PNG file `png`."""
    try:
        import matplotlib  # optional dependency: only --png needs it

        matplotlib.use("Agg")  # no display: draw into a file
        import matplotlib.pyplot as plt  # after use("Agg"), which must come first
    except ImportError:
        raise SystemExit("error: --png needs matplotlib: pip install matplotlib") from None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(sorted(a), [a[s] for s in sorted(a)], label=names[0])
    ax1.plot(sorted(b), [b[s] for s in sorted(b)], "--", label=names[1])
    ax1.set_ylabel(key)
    ax1.legend()
    ax2.semilogy(steps, [max(d, 1e-18) for d in devs])
    ax2.set_ylabel("relative difference")
    ax2.set_xlabel("step")
    fig.tight_layout()
    with atomic_path(png, durable=False) as tmp:  # a plot: no fsync
        fig.savefig(tmp, dpi=100, format="png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ratrain.compare",
        description="Compare the loss curves of two runs: prints max_rel_dev=<float> steps=<n> "
        "over the steps both hold; exit 1 when over --tol.")
    ap.add_argument("run_a", help="a run directory (holding metrics.jsonl) or a metrics file")
    ap.add_argument("run_b", help="the reference run (the deviation is relative to it)")
    ap.add_argument("--tol", type=float, default=None, help="fail (exit 1) above this max_rel_dev")
    ap.add_argument("--png", default=None, help="draw both curves and their relative difference")
    ap.add_argument("--key", default="loss",
                    help="metric to compare (default: loss; eval_loss: the evals)")
    args = ap.parse_args(argv)
    a = read_metrics(args.run_a, args.key)
    b = read_metrics(args.run_b, args.key)
    worst, steps, devs = compare(a, b)
    if not steps:
        print(f"error: {args.run_a} and {args.run_b} share no steps", file=sys.stderr)
        return 2
    print(f"max_rel_dev={worst:.6e} steps={len(steps)}")
    if args.png:
        plot(args.png, a, b, steps, devs, (args.run_a, args.run_b), args.key)
    if args.tol is not None and not worst <= args.tol:
        print(f"over tolerance: {worst:.3e} > {args.tol:.3e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
