"""The paper's four models planned on a mixed cluster (issue 21): half the clusters at MT-3000's
rate and half at `--factor` times it, the planner's partition beside the best symmetric plan on
the same cluster and beside a uniform cluster of the same total compute, all predicted by the
simulator (`ratrain.plan.hetero`; the same as `python -m ratrain.plan --config JOB --mixed F`).

    python benchmarks/hetero_plan.py [--factor 2] [--policies ratrain,baseline-1f1b,megatron-1f1b]
        [--jobs jobs/llama2-7b.yaml,...]

Prints one JSON object per model (its name as `case`), then a summary line.
"""

from __future__ import annotations

import argparse
import json

from ratrain.config import load_config
from ratrain.plan.hetero import candidates, halves, uniform_like
from ratrain.plan.search import POLICY_NAMES
from ratrain.plan.simulate import config_classes

JOBS = ("jobs/llama2-7b.yaml", "jobs/baichuan2-13b.yaml", "jobs/qwen2.5-32b.yaml",
        "jobs/llama2-70b.yaml")


def plan(job: str, factor: float, policies) -> dict:
    cfg = halves(load_config(job), factor)
    world = cfg.parallel.world_size
    classes = config_classes(cfg)
    ranked = [c for c in candidates(cfg, classes, policies) if c.fits]
    sym = next(c for c in ranked if c.symmetric)
    uni = [c for c in candidates(uniform_like(cfg, classes), ("uniform",) * world, policies)
           if c.fits]
    best = ranked[0]
    return {"case": job.split("/")[-1].removesuffix(".yaml"), "clusters": world,
            "mixed_tokens_per_s": round(best.tokens_per_s), "mixed_plan": best.describe(),
            "symmetric_tokens_per_s": round(sym.tokens_per_s), "symmetric_plan": sym.describe(),
            "uniform_tokens_per_s": round(uni[0].tokens_per_s), "uniform_plan": uni[0].describe(),
            "mixed_over_symmetric": round(best.tokens_per_s / sym.tokens_per_s, 3),
            "mixed_over_uniform": round(best.tokens_per_s / uni[0].tokens_per_s, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--jobs", default=",".join(JOBS))
    a = ap.parse_args(argv)
    rows = [plan(j, a.factor, tuple(a.policies.split(","))) for j in a.jobs.split(",")]
    for r in rows:
        print(json.dumps(r), flush=True)
    print(json.dumps({"factor": a.factor,
                      "min_mixed_over_uniform": min(r["mixed_over_uniform"] for r in rows),
                      "min_mixed_over_symmetric": min(r["mixed_over_symmetric"] for r in rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
