"""The planner's simulator against a measured emulated job: per policy, the predicted step
(`ratrain.plan.simulate.simulate_config` on the job's config, with the layers the run
recomputed) x the job's time_scale, next to the measured step of
`python -m ratrain.runtime.bench time --config JOB` (its JSON lines).

    python benchmarks/nodes_sim.py --config jobs/bench-lifecycle.yaml --measured runs.jsonl \\
        [--set parallel.placement=dp ...]

Prints one JSON object per policy: measured_s, predicted_s, ratio (predicted / measured).
"""

from __future__ import annotations

import argparse
import json

from ratrain.config import load_config
from ratrain.plan.simulate import simulate_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--measured", required=True, help="JSON lines of runtime.bench time")
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    for line in open(a.measured):
        if not line.startswith("{"):
            continue
        m = json.loads(line)
        cfg = load_config(a.config, [*a.set, f"schedule.policy={m['policy']}"])
        res = simulate_config(cfg, recompute_layers=m["recomputed_per_stage"], steps=3,
                              with_memory=False)
        pred = res.step_s * cfg.platform.time_scale
        print(json.dumps({"policy": m["policy"], "placement": cfg.parallel.placement,
                          "recomputed_per_stage": m["recomputed_per_stage"],
                          "measured_s": m["step_s"], "predicted_s": round(pred, 4),
                          "ratio": round(pred / m["step_s"], 3),
                          "host_busy": m.get("host_busy")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
