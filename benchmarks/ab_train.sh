#!/usr/bin/env bash
# Whole training runs of two ratrain trees, interleaved: 4 ranks (pp 2 x dp 2) of jobs/tiny.yaml,
# 40 steps, ROUNDS rounds; prints each tree's per-round median step time (steps 6-40) and the
# median of those. For the cost of the run-level machinery (watchdog, per-step stop agreement).
#   benchmarks/ab_train.sh OLD_TREE NEW_TREE TOKENS [ROUNDS]      e.g. trees from `git archive`
set -euo pipefail
old=$1 new=$2 tokens=$3 rounds=${4:-5}
py=${PYTHON:-python}
mpirun=${MPIRUN:-$(dirname "$(command -v "$py")")/mpirun}
out=$(mktemp -d)
uptime
for r in $(seq "$rounds"); do
  for tree in "$old" "$new"; do
    PYTHONPATH=$tree "$mpirun" -n 4 --oversubscribe "$py" -m ratrain.train --config "$tree/jobs/tiny.yaml" \
      --set parallel.pp=2 --set parallel.dp=2 --set run.steps=40 --set data.eval_interval=0 \
      --set "data.tokens=$tokens" --set checkpoint.resume=never --set checkpoint.interval=0 \
      --set "run.dir=$out/$(basename "$tree")-$r" >/dev/null 2>&1
  done
done
uptime
"$py" - "$out" "$(basename "$old")" "$(basename "$new")" <<'PY'
import glob, json, statistics, sys
out, *trees = sys.argv[1:]
for tree in trees:
    meds = [statistics.median([json.loads(x)["step_time_s"] for x in open(d + "/metrics.jsonl")
                               if '"loss"' in x][5:]) for d in sorted(glob.glob(f"{out}/{tree}-*"))]
    print(tree, "per-round median step (s):", [round(m, 4) for m in meds],
          "median:", round(statistics.median(meds), 4))
PY
rm -rf "$out"
