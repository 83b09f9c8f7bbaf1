"""Compare the loss curves of two runs.

    python -m ratrain.compare RUN_A RUN_B [--tol T] [--prefix] [--png FILE] [--key loss]

RUN_A / RUN_B are run directories (holding `metrics.jsonl`) or metrics files, read by
`metrics.read_curve`. The relative deviation of a step is |a - b| / max(|b|, tiny). Prints
`max_rel_dev=<float> steps=<n>` over the steps both hold and exits 1 when the maximum is over
`--tol`, when a step of either run is missing from the other (a run that stopped early, a gap),
or when either holds a NaN (two runs that both diverged are not equal). `--prefix` compares the
steps up to the shorter run's last (a run stopped on purpose against a longer one). Bad input
(a missing or damaged file): exit 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from ratrain.fileio import atomic_path
from ratrain.job.metrics import read_curve


def read_metrics(path: str, key: str = "loss") -> dict[int, float]:
    """step -> value of `key` from a run directory (its metrics.jsonl, or eval.jsonl for an
    `eval_*` key) or a metrics file, read by `metrics.read_curve` (a torn last line is left
    out, any other damaged line is an error)."""
    if not os.path.exists(path):
        raise SystemExit(f"error: {path} does not exist (give a run directory or a metrics.jsonl)")
    try:
        out = {int(r["step"]): float(r[key]) for r in read_curve(path, key)}
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if not out:
        raise SystemExit(f"error: {path} holds no records with 'step' and {key!r}")
    return out


def compare(a: dict[int, float], b: dict[int, float]) -> tuple[float, list[int], list[float]]:
    """(max relative deviation, the steps both hold, each one's deviation); NaN against
    anything, NaN included, deviates by inf."""
    steps = sorted(set(a) & set(b))
    devs = []
    for s in steps:
        x, y = a[s], b[s]
        if math.isnan(x) or math.isnan(y):
            devs.append(math.inf)
        else:
            devs.append(abs(x - y) / max(abs(y), 1e-30))
    return (max(devs) if devs else 0.0), steps, devs


def problems(a: dict[int, float], b: dict[int, float], names, prefix: bool = False) -> list[str]:
    """Why the two curves are not comparable as whole runs: a step one holds and the other
    does not (with `prefix`: only below the shorter run's last step), a NaN in either."""
    out = []
    last = min(max(a), max(b)) if prefix else math.inf
    for (x, nx), (y, ny) in (((a, names[0]), (b, names[1])), ((b, names[1]), (a, names[0]))):
        gone = sorted(s for s in x if s not in y and s <= last)
        if gone:
            out.append(f"{len(gone)} step(s) of {nx} missing from {ny}: {_steps(gone)}")
    for x, nx in ((a, names[0]), (b, names[1])):
        nan = sorted(s for s, v in x.items() if math.isnan(v))
        if nan:
            out.append(f"NaN in {nx} at step(s) {_steps(nan)}")
    return out


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (f" ... ({len(steps)} in all)" if len(steps) > 5
                                              else "")


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
        "over the steps both hold; exit 1 when over --tol, when a step of either run is missing "
        "from the other, or on a NaN.")
    ap.add_argument("run_a", help="a run directory (holding metrics.jsonl) or a metrics file")
    ap.add_argument("run_b", help="the reference run (the deviation is relative to it)")
    ap.add_argument("--tol", type=float, default=None, help="fail (exit 1) above this max_rel_dev")
    ap.add_argument("--png", default=None, help="draw both curves and their relative difference")
    ap.add_argument("--prefix", action="store_true",
                    help="compare only the steps up to the shorter run's last (one run stopped "
                    "early on purpose)")
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
    bad = problems(a, b, (args.run_a, args.run_b), args.prefix)
    if args.tol is not None and not worst <= args.tol:
        bad.append(f"over tolerance: {worst:.3e} > {args.tol:.3e}")
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
