#!/usr/bin/env bash
# Correctness runs: jobs/correctness.yaml under baseline-1f1b, megatron-1f1b and ratrain on
# N ranks (default 4), then compare each against the baseline with tolerance 0 (bitwise).
#   scripts/correctness.sh [N] [--set key=value ...]      e.g. scripts/correctness.sh 4 --set precision=fp16
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
n=${1:-4}
shift || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
out=runs/correctness
for policy in baseline-1f1b megatron-1f1b ratrain; do
  .venv/bin/mpirun -n "$n" --oversubscribe .venv/bin/python -m ratrain.train \
    --config jobs/correctness.yaml --set schedule.policy=$policy --set run.dir=$out/$policy "$@"
done
status=0
for policy in megatron-1f1b ratrain; do
  echo "== baseline-1f1b vs $policy"
  .venv/bin/python -m ratrain.compare $out/baseline-1f1b $out/$policy --tol 0 \
    --png $out/baseline-vs-$policy.png || status=1
done
exit $status
