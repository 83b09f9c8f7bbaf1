"""Compare the loss curves of two runs.

    python -m ratrain.compare RUN_A RUN_B [--tol T] [--prefix] [--png FILE] [--key loss]
        [--after F] [--final-tol T] [--worse-only] [--time-to-final] [--min-speedup S]
        [--step-efficiency]

RUN_A / RUN_B are run directories (holding `metrics.jsonl`) or metrics files, read by
`metrics.read_curve`. The relative deviation of a step is |a - b| / max(|b|, tiny). Prints
`max_rel_dev=<float> steps=<n>` over the steps both hold and exits 1 when the maximum is over
`--tol`, when a step of either run is missing from the other (a run that stopped early, a gap),
or when either holds a NaN (two runs that both diverged are not equal). `--prefix` compares the
steps up to the shorter run's last (a run stopped on purpose against a longer one). Bad input
(a missing or damaged file): exit 2.

A run that is not meant to be equal (partial synchronization against full, `sync.mode`) is
judged by its eval curve: `--after F` counts only the steps after the first fraction F of RUN_B's
(training settles first), `--final-tol T` holds the last shared step to T (`final_rel_dev=`),
`--worse-only` judges only the steps where RUN_A is worse (higher: a loss) than RUN_B (a
partial run that is ahead is not a loss of quality; `best_rel_dev=` says by how much it was
ahead at most), and `--time-to-final` prints how long each run took (wall clock, its records' `elapsed_s`) to
reach RUN_B's final value (`time_to_final_a=`, `time_to_final_b=`, `speedup=` b over a; lower
is better, as for a loss; a run that never reaches it takes inf), with `--min-speedup S`
failing below S. `--step-efficiency` prints what a step of RUN_A is worth in RUN_B's steps at
their last shared step L (`step_efficiency=`, interpolated between evals): when RUN_A ends
worse, the step at which RUN_B reached RUN_A's value there, over L (0.77: RUN_A's L steps got as
far as RUN_B's first 0.77 L); when it ends better, L over the step at which RUN_A reached RUN_B's
value (over 1). Times its speed-up in steps/s, it is the speed-up to a loss, without a run
trained past the other's end. The recipe (docs/BENCHMARKS.md, "Partial synchronization"):

    python -m ratrain.compare runs/partial runs/full --key eval_loss --tol 0.02 --after 0.2 \
        --final-tol 0.01 --worse-only --time-to-final --min-speedup 1.3 --prefix --png curves.png
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from ratrain.fileio import atomic_path
from ratrain.job.metrics import read_curve


def read_metrics(path: str, key: str = "loss", field: str | None = None) -> dict[int, float]:
    """step -> value of `key` from a run directory (its metrics.jsonl, or eval.jsonl for an
    `eval_*` key) or a metrics file, read by `metrics.read_curve` (a torn last line is left
    out, any other damaged line is an error); `field`: that field of the same records instead
    (`elapsed_s`)."""
    if not os.path.exists(path):
        raise SystemExit(f"error: {path} does not exist (give a run directory or a metrics.jsonl)")
    try:
        out = {int(r["step"]): float(r[field or key]) for r in read_curve(path, key)}
    except KeyError as e:
        raise SystemExit(f"error: {path}: a {key!r} record without {e.args[0]!r}") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if not out:
        raise SystemExit(f"error: {path} holds no records with 'step' and {key!r}")
    return out


def compare(a: dict[int, float], b: dict[int, float],
            worse_only: bool = False) -> tuple[float, list[int], list[float]]:
    """(max relative deviation, the steps both hold, each one's deviation); NaN against
    anything, NaN included, deviates by inf. `worse_only`: a step where `a` is lower than `b`
    deviates by 0."""
    steps = sorted(set(a) & set(b))
    devs = []
    for s in steps:
        x, y = a[s], b[s]
        if math.isnan(x) or math.isnan(y):
            devs.append(math.inf)
        else:
            devs.append(max(x - y, 0.0 if worse_only else y - x) / max(abs(y), 1e-30))
    return (max(devs) if devs else 0.0), steps, devs


def judge(a: dict[int, float], b: dict[int, float], after: float = 0.0,
          worse_only: bool = False) -> tuple[float, int, list[int], list[float]]:
    """(the largest relative deviation of `a` from `b` over the judged steps: those after the
    first fraction `after` of `b`'s, how many they are, then `compare`'s shared steps and their
    deviations: the last is the final one); `worse_only` as `compare`'s. Raises ValueError when
    the runs share no step."""
    worst, steps, devs = compare(a, b, worse_only)
    if not steps:
        raise ValueError("the runs share no steps")
    judged = len(steps)
    if after:
        late = [d for s, d in zip(steps, devs) if s > after * max(b)]
        worst, judged = max(late, default=0.0), len(late)
    return worst, judged, steps, devs


def time_to(curve: dict[int, float], times: dict[int, float], target: float) -> float:
    """Wall-clock seconds (`times` of the same steps) at the first step whose value reaches
    `target` (<=: a loss); inf when none does."""
    return next((times[s] for s in sorted(curve) if curve[s] <= target), math.inf)


def step_to(curve: dict[int, float], target: float) -> float | None:
    """The step at which `curve` first reaches `target` (<=: a loss), linearly interpolated
    between the two records around the crossing (the first record's step when it is already
    there); None when it never does."""
    prev = None
    for s in sorted(curve):
        y = curve[s]
        if math.isnan(y):  # a NaN reaches nothing, and nothing is interpolated across it
            prev = None
            continue
        if y <= target:
            if prev is None or prev[1] == y:
                return float(s)
            return prev[0] + (s - prev[0]) * (prev[1] - target) / (prev[1] - y)
        prev = (s, y)
    return None


def step_efficiency(a: dict[int, float], b: dict[int, float]) -> float:
    """What a step of `a` is worth in `b`'s steps at their last shared step L (a loss: lower is
    further): b's step to a's value at L, over L, when `a` ends worse; L over a's step to b's
    value at L when it ends better; 1 when equal (each gets there by L at the latest; a value
    reached at a curve's first record counts from there: a bound). A NaN at L gets nowhere: 0
    when `a`'s, inf when `b`'s. Raises ValueError when the runs share no step after step 0."""
    last = max(set(a) & set(b), default=0)
    if last <= 0:
        raise ValueError("the runs share no step after step 0")
    ya, yb = a[last], b[last]
    if math.isnan(ya) or math.isnan(yb):
        return 0.0 if math.isnan(ya) else math.inf
    if ya == yb:
        return 1.0
    if ya > yb:  # a is behind: where b was when it had got as far
        return step_to({k: v for k, v in b.items() if k <= last}, ya) / last
    s = step_to({k: v for k, v in a.items() if k <= last}, yb)
    return last / s if s > 0 else math.inf


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


def plot(png: str, a, b, steps, devs, names, key, times=None, signed=False, tol=None,
         after=None) -> None:
    """Draw both curves and their relative difference into the PNG file `png` (`signed`: how
    much worse A is than B, in percent on a linear axis, with the tolerance `tol` and the first
    judged step `after` drawn; else the absolute difference on a log axis); `times`: each run's
    {step: elapsed_s}, for a third panel against the wall clock."""
    try:
        import matplotlib  # optional dependency: only --png needs it

        matplotlib.use("Agg")  # no display: draw into a file
        import matplotlib.pyplot as plt  # after use("Agg"), which must come first
    except ImportError:
        raise SystemExit("error: --png needs matplotlib: pip install matplotlib") from None
    fig, axes = plt.subplots(3 if times else 2, 1, figsize=(8, 9 if times else 6))
    ax1, ax2 = axes[0], axes[1]
    ax1.plot(sorted(a), [a[s] for s in sorted(a)], label=names[0])
    ax1.plot(sorted(b), [b[s] for s in sorted(b)], "--", label=names[1])
    ax1.set_ylabel(key)
    ax1.set_xlabel("step")
    ax1.legend()
    if signed:
        ax2.plot(steps, [100 * (a[s] - b[s]) / max(abs(b[s]), 1e-30) for s in steps], "o-")
        ax2.axhline(0, color="grey", linewidth=0.5)
        if tol is not None:
            ax2.axhline(100 * tol, color="red", linewidth=0.8, linestyle=":")
        if after is not None:
            ax2.axvline(after, color="grey", linewidth=0.8, linestyle=":")
        ax2.set_ylabel(f"{names[0]} worse by (%)", fontsize=8)
    else:
        ax2.semilogy(steps, [max(d, 1e-18) for d in devs])
        ax2.set_ylabel("relative difference")
    ax2.set_xlabel("step")
    if times:
        for curve, t, style, name in ((a, times[0], "-", names[0]), (b, times[1], "--", names[1])):
            ax3 = axes[2]
            ax3.plot([t[s] for s in sorted(curve)], [curve[s] for s in sorted(curve)], style,
                     label=name)
        ax3.axhline(b[max(b)], color="grey", linewidth=0.5)
        ax3.set_ylabel(key)
        ax3.set_xlabel("wall clock (s)")
        ax3.legend()
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
    ap.add_argument("--after", type=float, default=0.0, metavar="F",
                    help="count only the steps after the first fraction F of RUN_B's (0 <= F < 1)")
    ap.add_argument("--final-tol", type=float, default=None, metavar="T",
                    help="fail (exit 1) when the last shared step deviates by more than T")
    ap.add_argument("--worse-only", action="store_true",
                    help="judge only the steps where RUN_A is worse (higher) than RUN_B")
    ap.add_argument("--time-to-final", action="store_true",
                    help="print each run's wall clock to RUN_B's final value and their speed-up")
    ap.add_argument("--step-efficiency", action="store_true",
                    help="print what a step of RUN_A is worth in RUN_B's steps at their last "
                    "shared step (interpolated between evals)")
    ap.add_argument("--min-speedup", type=float, default=None, metavar="S",
                    help="with --time-to-final: fail (exit 1) when the speed-up is below S")
    args = ap.parse_args(argv)
    if not 0.0 <= args.after < 1.0:
        ap.error(f"--after {args.after}: give a fraction in [0, 1)")
    if args.min_speedup is not None and not args.time_to_final:
        ap.error("--min-speedup needs --time-to-final")
    a = read_metrics(args.run_a, args.key)
    b = read_metrics(args.run_b, args.key)
    try:  # the judged steps: after the first fraction --after of RUN_B's
        worst, judged, steps, devs = judge(a, b, args.after, args.worse_only)
    except ValueError:
        print(f"error: {args.run_a} and {args.run_b} share no steps", file=sys.stderr)
        return 2
    print(f"max_rel_dev={worst:.6e} steps={judged}")
    if args.worse_only:  # how far ahead RUN_A was at most (not judged)
        late = [s for s in steps if s > args.after * max(b)]
        best = max((b[s] - a[s]) / max(abs(b[s]), 1e-30) for s in late) if late else 0.0
        print(f"best_rel_dev={max(best, 0.0):.6e}")
    bad = problems(a, b, (args.run_a, args.run_b), args.prefix)
    if args.final_tol is not None:
        print(f"final_rel_dev={devs[-1]:.6e} step={steps[-1]}")
        if not devs[-1] <= args.final_tol:
            bad.append(f"final step over tolerance: {devs[-1]:.3e} > {args.final_tol:.3e}")
    if args.step_efficiency:
        try:
            print(f"step_efficiency={step_efficiency(a, b):.4g}")
        except ValueError as e:
            print(f"error: {args.run_a} and {args.run_b}: {e}", file=sys.stderr)
            return 2
    times = None
    if args.time_to_final:
        times = (read_metrics(args.run_a, args.key, "elapsed_s"),
                 read_metrics(args.run_b, args.key, "elapsed_s"))
        target = b[max(b)]
        ta, tb = time_to(a, times[0], target), time_to(b, times[1], target)
        speedup = tb / ta if ta > 0 else math.inf
        print(f"time_to_final_a={ta:.6g} time_to_final_b={tb:.6g} speedup={speedup:.4g}")
        if args.min_speedup is not None and not speedup >= args.min_speedup:
            bad.append(f"speed-up to {args.run_b}'s final {args.key} {target:.6g}: "
                       f"{speedup:.3f} < {args.min_speedup}")
    if args.png:
        plot(args.png, a, b, steps, devs, (args.run_a, args.run_b), args.key, times,
             args.worse_only, args.tol, args.after * max(b) if args.after else None)
    if args.tol is not None and not worst <= args.tol:
        bad.append(f"over tolerance: {worst:.3e} > {args.tol:.3e}")
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
