#!/usr/bin/env bash
# Issue 5's speed and memory targets on jobs/bench-lifecycle.yaml, every policy in one session
# (python -m ratrain.runtime.bench time --config: the trainer's wiring, DDR cap, link throttle,
# compute and DDR pacing from the job's platform section; random tokens, the same for every
# policy). Prints JSON lines and a summary per part. Usage:
#   scripts/bench-lifecycle.sh [main|memory|sweep|all] [OUT_DIR]      (default: all, runs/bench-lifecycle)
# Env: PY (python), MPIRUN (mpirun), ROUNDS (3), STEPS (5), SWEEP_STEPS (3).
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
OUT=${2:-runs/bench-lifecycle}
PY=${PY:-.venv/bin/python}
MPIRUN=${MPIRUN:-.venv/bin/mpirun}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-5}
SWEEP_STEPS=${SWEEP_STEPS:-3}
JOB=jobs/bench-lifecycle.yaml
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
mkdir -p "$OUT"

bench() {  # bench N ARGS...: one mpirun, every policy (or --policies) in the same session
  local n=$1; shift
  "$MPIRUN" -n "$n" --oversubscribe "$PY" -m ratrain.runtime.bench time --config "$JOB" "$@"
}

summary() {  # summary FILE TITLE
  "$PY" - "$1" "$2" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"== {sys.argv[2]}")
print(f"{'policy':<14} {'pp':>2} {'dp':>2} {'m':>3} {'step s':>7} {'rounds':<24} {'peak MiB':>8} "
      f"{'recomp':>6} {'vs base':>7} {'vs meg':>6} {'ideal s':>7} {'/ideal':>6} {'busy':>5}")
for r in rows:
    print(f"{r['policy']:<14} {r['pp']:>2} {r['dp']:>2} {r['m']:>3} {r['step_s']:>7.3f} "
          f"{str(r['rounds']):<24} {r['peak_ddr_MiB']:>8.2f} {r['recomputed']:>6} "
          f"{r.get('speedup_vs_baseline', 1.0):>7.3f} {r.get('speedup_vs_megatron', 1.0):>6.3f} "
          f"{r['ideal_1f1b_s']:>7.3f} {r['vs_ideal']:>6.3f} {r['host_busy']:>5.2f}")
for r in rows:
    print(f"   {r['policy']:<14} pp{r['pp']} dp{r['dp']} m{r['m']} stage 0 s/step: {r['stage0']}  "
          f"paced compute {r['compute_s']} s, update+view {r['update_view_s']} s")
slow = [r for r in rows if r["host_busy"] > 1.0]
if slow:
    print(f"WARNING: {len(slow)} row(s) with host_busy > 1.0 (worst "
          f"{max(r['host_busy'] for r in slow):.2f}): the host could not keep pace with the "
          "emulated platform, so their step times and ratios measure the host, not the schedule."
          " Rerun when the load average is low, or raise platform.time_scale.")
PYEOF
}

if [[ $PART == main || $PART == all ]]; then
  # the speed target: the job as written, ROUNDS rounds of the three policies (rotated order)
  bench 8 --rounds "$ROUNDS" --steps "$STEPS" --skip 2 | tee "$OUT/main.jsonl"
  summary "$OUT/main.jsonl" "bench-lifecycle.yaml (pp 2 x dp 4, m 4, cap 11.64 MiB)"
fi

if [[ $PART == memory || $PART == all ]]; then
  # the memory target: peaks at the same config without a cap (no recomputation) ...
  bench 8 --set platform.ddr_bytes=21474836480 --steps 3 --skip 1 \
    --policies baseline-1f1b,ratrain | tee "$OUT/memory-nocap.jsonl"
  summary "$OUT/memory-nocap.jsonl" "same config, no binding cap (20 GiB): peak DDR"
  # ... and under the cap at which the baseline must recompute every layer: its own predicted
  # peak with every layer recomputed (one fewer recomputed layer does not fit)
  bench 8 --set schedule.recompute=full --steps 2 --skip 1 --policies baseline-1f1b \
    | tee "$OUT/memory-full.jsonl"
  CAP=$("$PY" -c "import json,sys; r=json.loads(open(sys.argv[1]).readline()); print(int((r['predicted_peak_MiB']+0.01)*2**20))" "$OUT/memory-full.jsonl")
  echo "cap where baseline-1f1b recomputes every layer: $CAP bytes"
  bench 8 --set platform.ddr_bytes="$CAP" --steps 3 --skip 1 --policies baseline-1f1b,ratrain \
    | tee "$OUT/memory-cap.jsonl"
  summary "$OUT/memory-cap.jsonl" "cap $CAP B: layers recomputed"
fi

if [[ $PART == sweep || $PART == all ]]; then
  # the ratios beyond one job: pp {2,4} x dp {1,2} x m {4,8,16}, no binding cap (the job's cap
  # is derived for its own layout; here only placement, sharding and overlap differ)
  : > "$OUT/sweep.jsonl"
  for pp in 2 4; do for dp in 1 2; do for m in 4 8 16; do
    bench $((pp * dp)) --pp $pp --dp $dp --m $m --set platform.ddr_bytes=21474836480 \
      --steps "$SWEEP_STEPS" --skip 1 | tee -a "$OUT/sweep.jsonl"
  done; done; done
  summary "$OUT/sweep.jsonl" "sweep (no binding cap; ideal = (m+p-1)/m x paced compute of the busiest rank)"
fi
