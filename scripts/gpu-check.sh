#!/usr/bin/env bash
# Issues 19 and 29's checks on one GPU, in one prepared run of at most 8 minutes, into one report.
#
# On the device machine (its python3 holds cupy, torch with its libcudnn, transformers,
# numba-cuda, mpi4py on Debian's Open MPI; nothing can be fetched there). What its image lacks
# (pytest-mpi, nvidia-cudnn-frontend, ml_dtypes; cuda-bindings where missing) travels as wheels,
# made here once per session:
#     bash scripts/gpu-wheels.sh          # .whl/, about 20 MB, setup.cfg's versions
# then, with the device tool:   run(command="RATRAIN_COMMIT=<git rev-parse --short HEAD here> bash
# scripts/gpu-check.sh", carry=[".whl"], timeout_s=560): the tree's copy there carries a .git that
# named the session's first commit, not the tree's (2026-11-28), so the commit is passed in.
# The wheels go into a scratch directory on PYTHONPATH (--target: no install into the machine's
# Python), without their dependencies.
#
# Steps (each under its own time limit and within the whole run's 8 minutes, each ending in a
# PASS or FAIL line of the report; a step the budget cannot fit any more is a FAIL saying so),
# the issue's figures first, so that a run short of time loses the least:
#   1. the card, cupy, ratrain's device (`open_device("gpu")`)
#   2. cuDNN: the frontend's and libcudnn's versions, and which libcudnn was loaded
#   2b. cuBLAS's GemmEx into fp32 (exec.devgemm: the 16-bit layout's GEMMs, new since the
#      last card) against cupy's fp32 GEMM of the same values (tests/test_devgemm.py)
#   3. speed and memory of the 124M model, interleaved: ratrain bf16, fp16 (cuDNN's fused
#      attention) and fp32 against PyTorch AMP bf16 and fp16 + SDPA and fp32 eager, tokens/s,
#      MFU against the card's dense peaks, ledger against cupy's pool against PyTorch's, and
#      three bf16 trials timed with them: devkernels off, RMSNorm and RoPE on cupy, the head
#      in the host's 16 MiB chunks (a device's are 256 MiB)
#      (benchmarks/gpu.py speed)
#   4. agreement on jobs/tiny.yaml, four runs at once: fp32 CPU vs GPU over 20 steps, fp16 and
#      bf16 vs fp32 on the GPU over 200 (benchmarks/gpu.py agree)
#   5. the fused attention's figures: fwd+bwd at the 124M shapes against PyTorch's SDPA, both
#      deterministic-backward workspace settings, errors against the tiled path in fp32
#      (benchmarks/gpu.py attention)
#   6. 4 ranks on the one GPU, pp 2 x dp 2, fp32, fp16 and bf16 (the 16-bit ones with the fused
#      attention): the three policies bitwise equal, close to 1 x 1 (tests/test_device_mpi.py)
#   7. the fused attention on the card: tests/test_cudnn_sdpa.py (forward and backward against
#      the tiled path, fp16 and bf16, GQA, causal; the backward twice, the same bytes; the
#      workspace within its bound; training steps through the `cudnn` backend)
#   8. HF parity on the GPU: 100 fp32 steps against transformers + torch.optim.AdamW on the card
#      (benchmarks/hf_parity.py --device gpu)
#   9. the device tests on the GPU: tests/test_device.py, test_devkernels.py (numba-cuda kernels
#      on the card, not the simulator)
#  10. the fused kernels against plain cupy (benchmarks/devkernels.py)
#  11. where ratrain's step of the 124M model goes (bf16, fp32): per category with the device
#      synchronized around each call, the host's Python by own time, and the card's kernels by
#      device time under PyTorch's profiler (benchmarks/gpu.py profile)
#  12. the 124M model's GEMM shapes: cupy, ratrain's cast-around GEMM, its layout's GemmEx on
#      16-bit operands, PyTorch (gpu.py gemm)
# RATRAIN_CHECK_ONLY="tests kernels" runs only the steps it names (a rerun after a fix).
# Timings of the whole run on an H200 (2026-11-28, bc289d3 and 2b5c151): speed 54-77 s, agree
# 64, attention 16-34, 4 ranks 22, cudnn-attention 16, hf-parity 39, tests 62, kernels 15,
# profile 24: about 350 s with the machine's own start outside it.
# Every process that computes on the card compiles numba-cuda's kernels on first use (no disk
# cache): that is in each step's time.
# The report is $OUT/gpu-check.txt (or ./gpu-check.txt); figures also go as benchmark records
# to $OUT/records (benchmarks/record.py), to be copied into docs/records/ here.
# A rehearsal on a CPU (every step's plumbing, no figures; cuDNN's graphs built and validated,
# none run): RATRAIN_CHECK_DEVICE=standin PYTHON=.venv/bin/python MPIRUN=.venv/bin/mpirun
# scripts/gpu-check.sh
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
budget=${RATRAIN_CHECK_BUDGET:-470}  # seconds for every step, within the run's 8 minutes

say() { echo "$*" | tee -a "$report"; }

step() {  # step NAME SECONDS COMMAND...: at most SECONDS, and never past the budget
  local name=$1 limit=$2
  shift 2
  if [ -n "${RATRAIN_CHECK_ONLY:-}" ] && [[ " $RATRAIN_CHECK_ONLY " != *" $name "* ]]; then
    return
  fi
  local left=$(( budget - ($(date +%s) - t_start) ))
  if [ "$left" -lt 15 ]; then
    say "FAIL $name (not run: ${left}s left of the ${budget}s budget)"; failed=1; return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  say "== $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >>"$report" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  [ -n "$(tail -c1 "$report")" ] && echo >> "$report"  # a killed step's last line, ended
  if [ $rc -eq 0 ]; then say "PASS $name (${dt}s)"; else say "FAIL $name (exit $rc, ${dt}s)"; failed=1; fi
}

say "ratrain gpu-check, commit ${RATRAIN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$report"
if [ -d .whl ] && [ "$dev" = gpu ]; then
  wheels=(pytest-mpi nvidia-cudnn-frontend ml_dtypes)
  "$py" -c "import cuda.bindings.driver" 2>/dev/null || wheels+=(cuda-bindings cuda-pathfinder)
  site=$(mktemp -d)
  if "$py" -m pip install -q --no-index --find-links .whl --no-deps --target "$site" "${wheels[@]}" >>"$report" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$site"
    say "installed from .whl into $site: ${wheels[*]}"
  else
    say "could not install ${wheels[*]} from .whl"
  fi
fi
step device 30 "$py" -c "
import numpy, ratrain
from ratrain.device import open_device
d = open_device('$dev')
print('numpy', numpy.__version__, 'device', d.describe(),
      'cupy', getattr(d.xp, '__version__', '(stand-in)'))"
step cudnn 20 "$py" -c "
from ratrain.exec import cudnn_sdpa as cs
print('nvidia-cudnn-frontend', cs.frontend().__version__)
try:
    _, version = cs.load()
except cs.CudnnUnavailable as e:  # expected on a CPU rehearsal, a failure on the card
    print(e)
    raise SystemExit(int('$dev' == 'gpu'))
libs = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libcudnn' in l})
print('cuDNN', version, 'from', libs[0] if libs else '?')"
step gemm-ex 25 "$py" -m pytest -q -x --color=no -p no:cacheprovider tests/test_devgemm.py
step speed 150 "$py" benchmarks/record.py gpu-speed -- "$py" benchmarks/gpu.py speed --rounds 5 --steps 2 "${smoke[@]}"
step agree 90 "$py" benchmarks/record.py gpu-agree -- "$py" benchmarks/gpu.py agree "${smoke[@]}"
step attention 60 "$py" benchmarks/record.py gpu-attention -- "$py" benchmarks/gpu.py attention "${smoke[@]}"
step mpi-4-ranks-one-gpu 75 "$mpirun" --oversubscribe -n 4 "$py" -m pytest -q --color=no -p no:cacheprovider \
  --with-mpi -m mpi tests/test_device_mpi.py -k "$([ "$dev" = gpu ] && echo gpu || echo standin)"
step cudnn-attention 60 "$py" -m pytest -q -rs --color=no -p no:cacheprovider tests/test_cudnn_sdpa.py
step hf-parity 50 "$py" benchmarks/record.py gpu-hf-parity -- "$py" benchmarks/hf_parity.py \
  --device "$dev" --steps "$parity_steps" --out "$out/hf-parity"
step tests 110 "$py" -m pytest -q -x --color=no -p no:cacheprovider tests/test_device.py tests/test_devkernels.py
if [ -f benchmarks/devkernels.py ] && [ "$dev" = gpu ]; then
  step kernels 30 "$py" benchmarks/devkernels.py
fi
step profile 90 "$py" benchmarks/gpu.py profile "${smoke[@]}"
step gemm 45 "$py" benchmarks/record.py gpu-gemm -- "$py" benchmarks/gpu.py gemm "${smoke[@]}"
rm -rf "$out/hf-parity"
say "gpu-check: $([ $failed = 0 ] && echo 'every step passed' || echo 'some steps FAILED') in $(( $(date +%s) - t_start ))s; report $report"
exit $failed
