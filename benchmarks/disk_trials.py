"""A disk that fills at a random moment under run.dir (issue 22's target): at 1 rank and at 4
(pp 2 x dp 2 under mpirun), run.dir (checkpoints inside it, the default layout) on a small tmpfs
that a filler takes whole 0.2-5 s after the launch.

    sudo python benchmarks/disk_trials.py --trials 20 [--work /tmp/disk-trials] [--ranks 1 4]

A trial passes when the run exits 5 (or 2: refused at start-up) with exactly one `error:` line
and no traceback, status.json (when the run got that far) names the failure, no line of
metrics.jsonl or eval.jsonl is torn, every committed checkpoint verifies, and, once the filler
is gone, the same command run again until it finishes gives the uninterrupted run's loss curve
bitwise. A run that finished before the disk filled is counted apart (`finished_first`). Needs
root (mount). Prints one JSON line per trial; writes docs/records/disk_trials.json.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trials import command, curve, job, run, start, write_record  # noqa: E402

STEPS = 100
SETS = ("checkpoint.interval=10",)


def fill(mnt: Path) -> None:
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while os.write(fd, b"\0" * (1 << 16)):
            pass
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


def whole(path: Path) -> bool:
    if not path.exists():
        return True
    raw = path.read_bytes()
    try:
        [json.loads(x) for x in raw.splitlines()]
    except ValueError:
        return False
    return raw == b"" or raw.endswith(b"\n")


def trial(cfg: Path, ranks: int, delay: float, mnt: Path, want: list) -> dict:
    from ratrain.checkpoint import list_checkpoints, verify_checkpoint

    run_dir = mnt / "run"
    p = start(command(cfg, ranks, run_dir, *SETS))
    time.sleep(delay)
    fill(mnt)
    out, err = p.communicate(timeout=600)
    ours = [x for x in err.splitlines() if x.startswith("error:")]
    res = {"ranks": ranks, "delay_s": round(delay, 3), "exit": p.returncode,
           "error_lines": len(ours), "traceback": "Traceback" in err,
           "line": ours[0][:160] if ours else ""}
    status = run_dir / "status.json"
    info = json.loads(status.read_text()) if status.exists() else None
    res["status"] = info and {k: info.get(k) for k in ("state", "exit", "step")}
    res["status_names_it"] = info is None and p.returncode == 2 or bool(
        info and info.get("exit") == p.returncode and info.get("why"))
    res["whole_lines"] = whole(run_dir / "metrics.jsonl") and whole(run_dir / "eval.jsonl")
    kept = list_checkpoints(str(run_dir / "checkpoints")) if (run_dir / "checkpoints").exists() else []
    res["checkpoints_verify"] = all(verify_checkpoint(path) == [] for _, path in kept)
    os.unlink(mnt / "filler")
    for _ in range(5):
        r = run(command(cfg, ranks, run_dir, *SETS))
        if r.returncode != 75:
            break
    res["resume_exit"] = r.returncode
    res["bitwise"] = curve(run_dir) == want
    res["finished_first"] = p.returncode == 0
    res["ok"] = (p.returncode in (2, 5) and res["error_lines"] == 1 and not res["traceback"]
                 and res["status_names_it"] and res["whole_lines"] and res["checkpoints_verify"]
                 and r.returncode == 0 and res["bitwise"])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="per rank count")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ratrain-disk-trials"))
    ap.add_argument("--size", default="16m", help="the tmpfs under run.dir")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("disk_trials: needs root (it mounts a small tmpfs under run.dir)")
    rng = random.Random(a.seed)
    cfg = job(a.work, STEPS)
    results = []
    for ranks in a.ranks:
        ref = a.work / f"ref-{ranks}"
        r = run(command(cfg, ranks, ref, *SETS, "checkpoint.resume=never"))
        assert r.returncode == 0, r.stderr[-2000:]
        want = curve(ref)
        for i in range(a.trials):
            mnt = a.work / f"disk-{ranks}-{i}"
            mnt.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={a.size}", "tmpfs", str(mnt)],
                           check=True)
            try:
                res = trial(cfg, ranks, rng.uniform(0.2, 5.0), mnt, want)
            finally:
                subprocess.run(["umount", "-l", str(mnt)])
            print(json.dumps(res), flush=True)
            results.append(res)
    figures = {}
    for ranks in a.ranks:
        mine = [r for r in results if r["ranks"] == ranks]
        valid = [r for r in mine if not r["finished_first"]]
        key = f"{ranks}r"
        figures[f"trials_{key}"] = len(mine)
        figures[f"finished_first_{key}"] = len(mine) - len(valid)
        figures[f"ok_{key}"] = sum(r["ok"] for r in valid)
        figures[f"exit_5_{key}"] = sum(r["exit"] == 5 for r in valid)
        figures[f"exit_2_{key}"] = sum(r["exit"] == 2 for r in valid)
        figures[f"one_line_{key}"] = sum(r["error_lines"] == 1 for r in valid)
        figures[f"tracebacks_{key}"] = sum(r["traceback"] for r in valid)
        figures[f"torn_{key}"] = sum(not r["whole_lines"] for r in valid)
        figures[f"bitwise_{key}"] = sum(r["bitwise"] for r in mine)
    figures["all_ok"] = all(r["ok"] for r in results if not r["finished_first"])
    write_record("disk_trials", " ".join(["python", "benchmarks/disk_trials.py", *sys.argv[1:]]),
                 figures)
    print(json.dumps(figures))
    return 0 if figures["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
