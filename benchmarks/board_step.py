"""The board's worth in whole training steps: 4 ranks on one node, with and without it.

    python benchmarks/board_step.py [--rounds 5] [--steps 30] [--skip 5] [--layouts 2x2,1x4]

Trains `jobs/tiny.yaml` under `mpirun -n 4` at each layout (pp x dp), with the compiled small
all-reduce board on and off (`RATRAIN_BOARD=0`: the board alone; the fused kernels stay on),
the two settings interleaved in every round (the order alternates round by round, so both see
the same load). A run's figure is the median `step_time_s` of its steps after `--skip`; each
setting's figure is the median over rounds, and `ratio` is the median of the per-round ratios
(with / without: below 1 the board saves time). Writes `docs/records/board_step.json` (the
shared record format) unless `--no-record`; `--record NAME` names another. Run it on a quiet
host: figures taken beside other work are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TREE = Path(__file__).resolve().parents[1]


def run(layout: str, board: bool, steps: int, run_dir: str, mpirun: str) -> list[float]:
    pp, dp = (int(x) for x in layout.split("x"))
    env = dict(os.environ, RATRAIN_BOARD="1" if board else "0")
    cmd = [mpirun, "-n", str(pp * dp), "--oversubscribe", sys.executable, "-m", "ratrain.train",
           "--config", str(TREE / "jobs/tiny.yaml"), "--set", f"parallel.pp={pp}",
           "--set", f"parallel.dp={dp}", "--set", f"run.steps={steps}",
           "--set", "data.eval_interval=0", "--set", "checkpoint.interval=0",
           "--set", "checkpoint.resume=never", "--set", f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, env=env, cwd=TREE, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x)["step_time_s"] for x in f if '"loss"' in x]


def record(name: str, command: str, figures: dict, load_before: float) -> Path:
    """One record under docs/records/ (the shared writer, benchmarks/record.py)."""
    sys.path.insert(0, str(TREE / "benchmarks"))
    from record import write_record  # beside this script

    return write_record(name, command, figures, load_before=load_before)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="training steps per run")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of a run's median")
    ap.add_argument("--layouts", default="2x2,1x4", help="pp x dp layouts of 4 ranks")
    ap.add_argument("--record", default="board_step", help="the record's name")
    ap.add_argument("--no-record", action="store_true", help="print only")
    a = ap.parse_args(argv)
    if a.steps <= a.skip:
        ap.error(f"--steps={a.steps} must exceed --skip={a.skip}")
    mpirun = os.environ.get("MPIRUN", str(Path(sys.executable).parent / "mpirun"))
    load0 = os.getloadavg()[0]
    figures: dict = {"rounds": a.rounds, "steps": a.steps, "skip": a.skip}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in a.layouts.split(","):
            per = {True: [], False: []}
            for r in range(a.rounds):
                for board in ((True, False) if r % 2 == 0 else (False, True)):
                    times = run(layout, board, a.steps, f"{tmp}/{layout}-{board}-{r}", mpirun)
                    per[board].append(statistics.median(times[a.skip:]))
            on, off = statistics.median(per[True]), statistics.median(per[False])
            ratio = statistics.median(x / y for x, y in zip(per[True], per[False]))
            figures.update({f"pp{layout}_board_step_s": round(on, 5),
                            f"pp{layout}_no_board_step_s": round(off, 5),
                            f"pp{layout}_ratio": round(ratio, 4)})
            print(f"pp x dp = {layout}: with board {on:.5f} s, without {off:.5f} s, "
                  f"ratio {ratio:.4f} ({(1 - ratio) * 100:+.2f}% saved)")
    if not a.no_record:
        cmd = "python benchmarks/board_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
        print("record:", record(a.record, cmd.strip(), figures, load0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
