#!/usr/bin/env bash
# Issue 10's targets on emulated nodes (docs/history/nodes.md), as root, from the repo root:
#   bash benchmarks/nodes_targets.sh [PART...] [OUT_DIR via OUT=]
# PARTS: train threads comm kill sim (default: all). Each part prints what it measured (exit 1
# when a comparison that claims equality within its tolerance does not hold); raw
# records go to $OUT (default /tmp/nodes-targets). A cluster of 2 nodes x 4 ranks, links shaped
# to 1 Gbit/s, is brought up (name nt) and taken down at the end, whatever happens.
# Env: PY (python), MPIRUN, DATA (token file), STEPS (50), TS (time_scale of the simulator
# check, 4800), ROUNDS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MPIRUN=${MPIRUN:-.venv/bin/mpirun}
DATA=${DATA:-data/stdlib/train.bin}
STEPS=${STEPS:-50}
TS=${TS:-4800}
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-/tmp/nodes-targets}
PARTS=${*:-train threads comm kill sim}
mkdir -p "$OUT"
export MPIRUN PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_osc=^ucx
C="scripts/cluster.sh"
trap '$C down --name nt >/dev/null 2>&1 || true' EXIT
$C down --name nt >/dev/null 2>&1 || true
$C up --nodes 2 --slots 4 --rate 1gbit --name nt
ONE=("$MPIRUN" -n 8 --oversubscribe)
TWO=("$C" run --name nt -- -n 8)
TRAIN=("$PY" -m ratrain.train --config jobs/tiny.yaml --set "data.tokens=$DATA"
       --set data.eval_interval=0 --set run.log_interval=10 --set "run.steps=$STEPS"
       --set checkpoint.interval=0)
load() { echo "# load: $(cut -d' ' -f1-3 /proc/loadavg)"; }
failed=0
cmp_runs() {  # every comparison is reported; one that fails makes the script exit 1 at the end
  local out rc=0
  out=$("$PY" -m ratrain.compare "$1" "$2" --tol "$3" 2>&1) || rc=$?
  echo "$1 vs $2 (tol $3): $(echo "$out" | tr '\n' ' ')"
  if [ "$rc" != 0 ]; then echo "FAILED: $1 vs $2 (tol $3)"; failed=1; fi
}

for part in $PARTS; do
  load
  case $part in
  train)  # tiny at pp 2 x dp 4: 1 x 1, one host, 2 nodes x 4, each placement; three policies
    "$PY" -m ratrain.train --config jobs/tiny.yaml --set "data.tokens=$DATA" \
      --set data.eval_interval=0 --set "run.steps=$STEPS" --set run.log_interval=10 \
      --set checkpoint.interval=0 --set parallel.num_micro_batches=8 --set "run.dir=$OUT/r1x1" | tail -1
    for pl in pp dp; do
      L=(--set parallel.pp=2 --set parallel.dp=4 --set "parallel.placement=$pl")
      "${ONE[@]}" "${TRAIN[@]}" "${L[@]}" --set "run.dir=$OUT/one-$pl" | tail -1
      "${TWO[@]}" "${TRAIN[@]}" "${L[@]}" --set "run.dir=$OUT/two-$pl" | grep -E "^ratrain|^step" | sed -n '1p;$p'
      cmp_runs "$OUT/two-$pl" "$OUT/one-$pl" 0
      cmp_runs "$OUT/two-$pl" "$OUT/r1x1" 1e-5
    done
    for pol in baseline-1f1b megatron-1f1b; do
      "${TWO[@]}" "${TRAIN[@]}" --set parallel.pp=2 --set parallel.dp=4 \
        --set "schedule.policy=$pol" --set "run.dir=$OUT/two-$pol" | tail -1
      cmp_runs "$OUT/two-$pol" "$OUT/two-pp" 0
    done ;;
  threads)  # run.threads 1, 2, 4: 1 rank, and 4 ranks (pp 2 x dp 2)
    for t in 1 2 4; do
      "$PY" -m ratrain.train --config jobs/tiny.yaml --set "data.tokens=$DATA" \
        --set data.eval_interval=0 --set "run.steps=$STEPS" --set run.log_interval=100 \
        --set checkpoint.interval=0 --set "run.threads=$t" --set "run.dir=$OUT/t1-$t" | tail -1
      "$MPIRUN" -n 4 --oversubscribe "${TRAIN[@]}" --set parallel.pp=2 --set parallel.dp=2 \
        --set run.log_interval=100 --set "run.threads=$t" --set "run.dir=$OUT/t4-$t" | tail -1
    done
    for t in 2 4; do cmp_runs "$OUT/t1-$t" "$OUT/t1-1" 0; cmp_runs "$OUT/t4-$t" "$OUT/t4-1" 0; done ;;
  comm)  # 64 MiB all-reduce: 2 nodes x 4 (hier, flat ring, MPI) with the model; one node x 4
    # (INTRA_BW: the model's intra-node rate, default 2e9 B/s ~ the staged one-node figure)
    "${TWO[@]}" "$PY" -m ratrain.comm.bench --op allreduce --algo hier,ring,mpi --sizes 64M \
      --iters 5 --warmup 1 --model --bandwidth 1.25e8 --latency 5e-5 \
      --intra-bandwidth "${INTRA_BW:-2e9}" | tee "$OUT/comm-2nodes.jsonl"
    for mode in "" --shared; do  # private buffers (the runtime's), then buffers in shared memory
      "$MPIRUN" -n 4 --oversubscribe "$PY" -m ratrain.comm.bench --op allreduce --algo hier,mpi \
        --sizes 64M --iters 10 --warmup 2 $mode | tee -a "$OUT/comm-1node.jsonl"
    done ;;
  kill)  # every process of node 2 killed mid-run: the job ends, non-zero, naming the ranks
    "${TWO[@]}" "${TRAIN[@]}" --set parallel.pp=2 --set parallel.dp=4 --set run.steps=100000 \
      --set "run.dir=$OUT/kill" > "$OUT/kill.out" 2> "$OUT/kill.err" & pid=$!
    until grep -q '"step"' "$OUT/kill/metrics.jsonl" 2>/dev/null; do sleep 0.2; done
    t0=$(date +%s.%N)
    $C kill 2 --name nt
    rc=0; wait $pid || rc=$?
    echo "exit $rc after $(echo "$(date +%s.%N) - $t0" | bc) s; $(grep -a 'lost node' "$OUT/kill.err")" ;;
  sim)  # the simulator against the emulated lifecycle job on 2 nodes, each placement
    for pl in pp dp; do
      "${TWO[@]}" "$PY" -m ratrain.runtime.bench time --config jobs/bench-lifecycle.yaml \
        --rounds "$ROUNDS" --steps 4 --set "platform.time_scale=$TS" \
        --set "parallel.placement=$pl" | grep '^{' > "$OUT/sim-$pl.jsonl"
      "$PY" benchmarks/nodes_sim.py --config jobs/bench-lifecycle.yaml --measured "$OUT/sim-$pl.jsonl" \
        --set "platform.time_scale=$TS" --set "parallel.placement=$pl"
    done ;;
  *) echo "unknown part $part (train threads comm kill sim)" >&2; exit 2 ;;
  esac
  load
done
if [ "$failed" != 0 ]; then echo "error: a comparison failed (FAILED lines above)" >&2; exit 1; fi
