#!/usr/bin/env bash
# Issue 19's checks on one GPU, in one prepared run of at most 8 minutes, into one report file.
#
# On the device machine (its python3 holds cupy, torch, transformers, numba-cuda, mpi4py on
# Debian's Open MPI; nothing can be fetched there). pytest-mpi is not in its image: carry it,
# once per session, from here:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl pytest-mpi
# then, with the device tool:   run(command="bash scripts/gpu-check.sh", carry=[".whl"], timeout_s=560)
#
# Steps (each under its own time limit, each ending in a PASS or FAIL line of the report):
#   1. the card, cupy, ratrain's device (`open_device("gpu")`)
#   2. the device tests on the GPU: tests/test_device.py, test_devkernels.py (numba-cuda kernels
#      on the card, not the simulator), test_gpu_bench.py
#   3. 4 ranks on the one GPU, pp 2 x dp 2: the three policies bitwise equal, close to 1 x 1
#      (tests/test_device_mpi.py under mpirun)
#   4. agreement: jobs/tiny.yaml fp32 CPU vs GPU over 20 steps, fp16 vs fp32 over 200
#      (benchmarks/gpu.py agree)
#   5. HF parity on the GPU: 100 fp32 steps against transformers + torch.optim.AdamW on the card
#      (benchmarks/hf_parity.py --device gpu)
#   6. speed and memory of the 124M model against PyTorch, interleaved (benchmarks/gpu.py speed)
#   7. the fused kernels against plain cupy (benchmarks/devkernels.py)
# The report is $OUT/gpu-check.txt (or ./gpu-check.txt); figures also go as benchmark records
# to $OUT/records (benchmarks/record.py), to be copied into docs/records/ here.
# A rehearsal on a CPU (every step's plumbing, no figures): RATRAIN_CHECK_DEVICE=standin
# PYTHON=.venv/bin/python MPIRUN=.venv/bin/mpirun scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
report="$out/gpu-check.txt"
export RATRAIN_RECORDS="$out/records" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONHASHSEED=0 RATRAIN_TEST_TORCH=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx
py=${PYTHON:-python3}
mpirun=${MPIRUN:-mpirun}
dev=${RATRAIN_CHECK_DEVICE:-gpu}
# numba-cuda's kernels (ratrain.exec.devkernels) on the GPU; a CPU rehearsal runs its simulator
export NUMBA_ENABLE_CUDASIM=$([ "$dev" = gpu ] && echo 0 || echo 1)
smoke=()
parity_steps=100
if [ "$dev" != gpu ]; then smoke=(--device "$dev" --smoke); parity_steps=5; fi
mkdir -p "$RATRAIN_RECORDS"
: > "$report"
failed=0
t_start=$(date +%s)

say() { echo "$*" | tee -a "$report"; }

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  say "== $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >>"$report" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then say "PASS $name (${dt}s)"; else say "FAIL $name (exit $rc, ${dt}s)"; failed=1; fi
}

say "ratrain gpu-check, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$report"
if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --find-links .whl pytest-mpi >>"$report" 2>&1 || say "could not install pytest-mpi from .whl"
fi
step device 30 "$py" -c "
import numpy, ratrain
from ratrain.device import open_device
d = open_device('$dev')
print('numpy', numpy.__version__, 'device', d.describe(),
      'cupy', getattr(d.xp, '__version__', '(stand-in)'))"
step tests 150 "$py" -m pytest -q -x --color=no -p no:cacheprovider tests/test_device.py tests/test_devkernels.py \
  tests/test_gpu_bench.py
step mpi-4-ranks-one-gpu 60 "$mpirun" --oversubscribe -n 4 "$py" -m pytest -q --color=no -p no:cacheprovider \
  --with-mpi -m mpi tests/test_device_mpi.py
step agree 70 "$py" benchmarks/record.py gpu-agree -- "$py" benchmarks/gpu.py agree "${smoke[@]}"
step hf-parity 50 "$py" benchmarks/record.py gpu-hf-parity -- "$py" benchmarks/hf_parity.py \
  --device "$dev" --steps "$parity_steps" --out "$out/hf-parity"
step speed 90 "$py" benchmarks/record.py gpu-speed -- "$py" benchmarks/gpu.py speed --rounds 5 --steps 3 "${smoke[@]}"
if [ -f benchmarks/devkernels.py ] && [ "$dev" = gpu ]; then
  step kernels 30 "$py" benchmarks/devkernels.py
fi
rm -rf "$out/hf-parity"
say "gpu-check: $([ $failed = 0 ] && echo 'every step passed' || echo 'some steps FAILED') in $(( $(date +%s) - t_start ))s; report $report"
exit $failed
