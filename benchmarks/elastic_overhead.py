"""What elastic mode costs when nothing fails: pp 2 x dp 3 of jobs/tiny.yaml (the ratrain policy,
its optimizer state sharded, so the peer copies run), elastic off and on, interleaved rounds.

    python benchmarks/elastic_overhead.py --rounds 5 --steps 40 [--tokens PATH]

Each round runs both (the order alternating); a run's step time is the median of its steps
after the first 5. Prints one JSON line per round and a summary: the median over rounds of
on / off (target <= 1.03), and the peak DDR bytes of both (the ledger counts the copies), with
the losses of both compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile

from faults_elastic import PP, common, launch, losses


def step_time(run_dir: str) -> tuple[float, int]:
    recs = [json.loads(x) for x in open(f"{run_dir}/metrics.jsonl") if '"loss"' in x]
    return (statistics.median(r["step_time_s"] for r in recs[5:]),
            max(r["peak_ddr_bytes"] for r in recs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dp", type=int, default=3)
    ap.add_argument("--tokens", required=True)
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ratrain-elastic-cost-")
    ratios, same = [], True
    peaks = {}
    for r in range(a.rounds):
        got = {}
        for which in (("off", "on") if r % 2 == 0 else ("on", "off")):
            run = f"{work}/{which}{r}"
            sets = [f"parallel.dp={a.dp}", "checkpoint.interval=0", "checkpoint.resume=never",
                    f"elastic.enabled={'true' if which == 'on' else 'false'}"]
            args = ["-m", "ratrain.train", *common(a.tokens, run, a.steps)]
            args += [x for s in sets for x in ("--set", s)]
            rc = launch(PP * a.dp, args, f"{run}.log", ft=which == "on")
            if rc != 0:
                print(json.dumps({"error": f"{which} round {r} failed ({rc}): {run}.log"}))
                return 1
            got[which] = step_time(run)
            peaks[which] = got[which][1]
        same = same and losses(f"{work}/on{r}") == losses(f"{work}/off{r}")
        ratio = got["on"][0] / got["off"][0]
        ratios.append(ratio)
        print(json.dumps({"round": r, "off_step_s": round(got["off"][0], 4),
                          "on_step_s": round(got["on"][0], 4), "ratio": round(ratio, 4)}),
              flush=True)
    print(json.dumps({"rounds": a.rounds, "median_ratio": round(statistics.median(ratios), 4),
                      "peak_ddr_off": peaks["off"], "peak_ddr_on": peaks["on"],
                      "losses_equal": same, "dp": a.dp, "steps": a.steps}), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
