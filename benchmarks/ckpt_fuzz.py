"""The checkpoint corruption fuzzer at length (issue 33): thousands of seeded cases of random
damage to a real run's two committed checkpoints, at 1 x 1 and at pp 2 x dp 2, each judged
in-process (`resume auto` against the oracle of tests/_ckpt_fuzz.py), and every `--every`-th
case also restarted as a trainer process at 1 x 1 (for the pp 2 x dp 2 checkpoints: onto
another layout), compared bitwise with a clean resume from the checkpoint it should take.

    python benchmarks/ckpt_fuzz.py --cases 1000 --every 25 --work /tmp/ckpt-fuzz
    python benchmarks/record.py ckpt-fuzz -- .venv/bin/python benchmarks/ckpt_fuzz.py ...

Prints one JSON object: cases, per layout and in all, with the counts the issue asks for
(tracebacks, wrong-step resumes, resumes from a damaged checkpoint) and the rest (an intact
checkpoint skipped, a message of more than one line, failed restarts), and how the verdicts
fell (resumes by step, refusals). Every failure is printed to stderr with its seed and damages;
exit 1 when there is any.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests._ckpt_fuzz and tests.test_checkpoint_fuzz

from ratrain.config import load_config  # noqa: E402 - after the path above
from tests import _ckpt_fuzz as fz  # noqa: E402
from tests.test_checkpoint_fuzz import fuzz_dir, pristine_of, write_job  # noqa: E402

KINDS = {"traceback": "tracebacks", "resumes at step": "wrong_step",
         "finished verdict": "wrong_step", "resumed at step": "wrong_step",
         "resumed from the damaged": "damaged_resumes", "skipped the intact": "skipped_intact",
         "more than one line": "multi_line"}


def kind_of(failure: str) -> str:
    return next((k for needle, k in KINDS.items() if needle in failure), "other_failures")


def setup(work: str) -> dict:
    """The job, and per layout: the pristine run (checkpoints 2 and 4) and its checkpoints."""
    job = write_job(work)
    p = fz.train(job, f"{work}/run1")
    assert p.returncode == 0, p.stderr
    p = fz.train(job, f"{work}/run4", "parallel.pp=2", "parallel.dp=2", "run.steps=4", n=4)
    assert p.returncode == 0, p.stderr
    return {"job": job, "1x1": fuzz_dir(f"{work}/run1", f"{work}/pristine1"),
            "pp2xdp2": f"{work}/run4"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--every", type=int, default=25, help="restart the trainer every N cases")
    ap.add_argument("--seed", type=int, default=33)
    ap.add_argument("--work", default="/tmp/ratrain-ckpt-fuzz")
    args = ap.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    t0 = time.perf_counter()
    runs = setup(args.work)
    job = runs["job"]
    cfg = load_config(job, [])

    @functools.cache
    def reference(layout: str, name: str) -> dict:
        """The final state of a clean resume at 1 x 1 from the pristine checkpoint `name`."""
        out = f"{args.work}/clean-{layout}-{name}"
        p = fz.train(job, out, f"checkpoint.resume={runs[layout]}/checkpoints/{name}")
        assert p.returncode == 0, p.stderr
        return fz.final_state(fz.checkpoints(f"{out}/checkpoints")[0])

    pristine = {lay: pristine_of(f"{runs[lay]}/checkpoints") for lay in ("1x1", "pp2xdp2")}
    counts = {lay: Counter() for lay in pristine}
    for i in range(args.cases):
        layout = ("1x1", "pp2xdp2")[i % 2]
        seed = args.seed * 1_000_003 + i
        work = f"{args.work}/case"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(runs[layout], work, ignore=shutil.ignore_patterns(".ratrain.lock"))
        case = fz.Case(seed)
        fz.damage(random.Random(seed), f"{work}/checkpoints", pristine[layout], case)
        fz.judge(f"{work}/checkpoints", f"{runs[layout]}/checkpoints", case, cfg)
        c = counts[layout]
        c["cases"] += 1
        c[case.outcome.replace(" ", "_") or "none"] += 1
        failure = case.failure
        if not failure and i % args.every == 0:
            c["restarts"] += 1
            why = fz.restart(job, work, case, functools.partial(reference, layout))
            failure = f"restart: {why}" if why else ""
        if failure:
            c[kind_of(failure)] += 1
            print(f"FAILED {layout} seed {seed}: {case.damages}: {failure}", file=sys.stderr)
    total = sum(counts.values(), Counter())
    figures = {"cases": total["cases"], "restarts": total["restarts"],
               "tracebacks": total["tracebacks"], "wrong_step": total["wrong_step"],
               "damaged_resumes": total["damaged_resumes"],
               "skipped_intact": total["skipped_intact"], "multi_line": total["multi_line"],
               "other_failures": total["other_failures"], "refusals": total["refuse"],
               "resumes": total["resume_2"] + total["resume_4"],
               "seconds": round(time.perf_counter() - t0, 1),
               "layouts": {lay: dict(sorted(c.items())) for lay, c in counts.items()}}
    print(json.dumps(figures))
    bad = sum(total[k] for k in set(KINDS.values()) | {"other_failures"})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
