"""Stop signals at random moments of a run's life (issue 22's target), as a batch system sends
them: USR1 and TERM, 0.2-5 s after the launch, at 1 rank (to the process) and 4 ranks (pp 2 x
dp 2 under mpirun, the signal sent to mpirun).

    python benchmarks/signal_trials.py --trials 50 [--work /tmp/signal-trials] [--ranks 1 4]

Each trial starts a fresh run (a checkpoint every 5 steps, `checkpoint.resume: auto`), sends the
signal after a random delay, and passes when the run exits 75 (or 0: it had finished) with no
traceback, and the same command run again until it finishes gives the uninterrupted run's loss
curve bitwise (every step once, none lost). A stop before training starts must say that nothing
was trained. Prints one JSON line per trial and writes docs/records/signal_trials.json.
Under mpirun only USR1 is forwarded as a signal: Open MPI's mpirun ends the job itself on TERM
(exit 1), so TERM trials at 4 ranks record what it does (`term_to_mpirun_exit_1`) and are
counted apart; send USR1 to mpirun (the batch scripts forward TERM as USR1).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trials import command, curve, job, run, start, write_record  # noqa: E402

STEPS = 30


def trial(cfg: Path, ranks: int, sig: str, delay: float, run_dir: Path, want: list) -> dict:
    p = start(command(cfg, ranks, run_dir))
    time.sleep(delay)
    p.send_signal(getattr(signal, "SIG" + sig))
    out, err = p.communicate(timeout=600)
    res = {"ranks": ranks, "signal": sig, "delay_s": round(delay, 3), "exit": p.returncode,
           "traceback": "Traceback" in err, "before_training": "nothing was trained" in err}
    resumes = 0
    while resumes < 5:
        r = run(command(cfg, ranks, run_dir))
        resumes += 1
        if r.returncode != 75:
            break
    res["resume_exit"] = r.returncode
    res["bitwise"] = curve(run_dir) == want
    res["ok"] = (res["exit"] in (0, 75) and not res["traceback"] and res["resume_exit"] == 0
                 and res["bitwise"])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50, help="per signal and rank count")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ratrain-signal-trials"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    cfg = job(a.work, STEPS)
    results = []
    for ranks in a.ranks:
        ref = a.work / f"ref-{ranks}"
        r = run(command(cfg, ranks, ref, "checkpoint.resume=never"))
        assert r.returncode == 0, r.stderr[-2000:]
        want = curve(ref)
        for sig in ("USR1", "TERM"):
            for i in range(a.trials):
                res = trial(cfg, ranks, sig, rng.uniform(0.2, 5.0), a.work / f"r{ranks}-{sig}-{i}",
                            want)
                if ranks > 1 and sig == "TERM" and res["exit"] == 1:
                    res["term_to_mpirun_exit_1"] = True
                print(json.dumps(res), flush=True)
                results.append(res)
    figures = {}
    for ranks in a.ranks:
        for sig in ("USR1", "TERM"):
            mine = [r for r in results if r["ranks"] == ranks and r["signal"] == sig]
            key = f"{sig.lower()}_{ranks}r"
            figures[f"{key}_trials"] = len(mine)
            figures[f"{key}_ok"] = sum(r["ok"] for r in mine)
            figures[f"{key}_exit_75_or_0"] = sum(r["exit"] in (0, 75) for r in mine)
            figures[f"{key}_before_training"] = sum(r["before_training"] for r in mine)
            figures[f"{key}_bitwise"] = sum(r["bitwise"] for r in mine)
            figures[f"{key}_exits"] = ",".join(sorted({str(r["exit"]) for r in mine}))
    figures["all_ok"] = all(r["ok"] for r in results)
    write_record("signal_trials", " ".join(["python", "benchmarks/signal_trials.py", *sys.argv[1:]]),
                 figures)
    print(json.dumps(figures))
    return 0 if figures["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
