#!/usr/bin/env bash
# The whole test suite: sets up .venv (or $RATRAIN_VENV, as scripts/setup.sh), runs pytest on one process (its files
# shared out over RATRAIN_TEST_WORKERS worker processes, default 2), the 2-node test on emulated
# nodes (as root with network namespaces), then the MPI tests under mpirun at 2, 3 and 4 ranks
# (pytest-mpi). Extra arguments go to every pytest call; a step they select nothing in (pytest's
# exit 5) is not a failure, unless no step selects anything. At the end: every skip and its reason.
# RATRAIN_TEST_TORCH=1 also installs PyTorch, transformers and tokenizers for the reference
# checks, and fails naming the package when that install fails. Under CI (CI=true, .ci/run) or
# RATRAIN_TEST_TORCH=1 a missing prerequisite (torch, transformers, tokenizers, numba, cuDNN's
# frontend, oneMKL, Slurm, namespaces as root) fails its tests; elsewhere they are skipped with
# the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
venv=${RATRAIN_VENV:-.venv}
py=$venv/bin/python
strict=0
if [ "${RATRAIN_TEST_TORCH:-0}" = 1 ] || [[ "${CI:-}" =~ ^(1|true|yes)$ ]]; then strict=1; fi
install() {  # install <import name> <pip requirement>...: once; an error naming it when strict
  local name=$1; shift
  install_if "import $name" "$name" "$@"
}
install_if() {  # install_if <Python that fails without it> <name> <pip requirement>...
  local check=$1 name=$2; shift 2
  "$py" -c "$check" 2>/dev/null && return 0
  "$py" -m pip install -q "$@" && "$py" -c "$check" && return 0
  if [ "$strict" = 1 ]; then
    echo "error: could not install $name ($*); the reference checks need it" >&2
    exit 1
  fi
  echo "warning: could not install $name ($*); its tests will be skipped" >&2
}
if [ "${RATRAIN_TEST_TORCH:-0}" = 1 ]; then
  install torch "torch==2.13.0"
  install transformers transformers
fi
install tokenizers "tokenizers>=0.15"  # the tokenizer tests (transformers brings it too)
# cuDNN's attention graphs, built and validated without a GPU; setup.cfg's pin, without the
# frontend's declared dependencies (nvidia-cutlass-dsl: engines ratrain does not use, 600 MB)
install cudnn --no-deps "$(sed -n 's/^ *\(nvidia-cudnn-frontend==[0-9.]*\) *$/\1/p' setup.cfg | head -1)"
# oneMKL for run.blas: mkl's tests (tests/test_blas.py): setup.cfg's pin, its library alone (the
# sequential layer needs neither intel-openmp nor tbb); the wheel has no module to import
install_if "from ratrain.exec.blas import load_mkl; load_mkl()" mkl --no-deps \
  "$(sed -n 's/^ *\(mkl>=[0-9.]*\) *$/\1/p' setup.cfg | head -1)"
# NVVM and NVRTC for numba-cuda's compiler (tests/test_devcompile.py): setup.cfg's devcompile pins
install_if "from cuda.pathfinder import load_nvidia_dynamic_lib as f; f('nvvm'); f('nvrtc')" \
  "NVVM and NVRTC" $(sed -n '/^devcompile =/,/^[a-z]/s/^ *\(nvidia-[a-z-]*==[0-9.]*\) *$/\1/p' setup.cfg)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_osc=^ucx
export PYTHONHASHSEED=0
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT
selected=0
step() {  # step <name> <command>...: runs a pytest call; exit 5 (nothing selected) passes
  local name=$1 rc=0; shift
  "$@" -rs 2>&1 | tee "$log/$name" || rc=$?  # pipefail: pytest's status (tee's is 0)
  if [ "$rc" = 5 ]; then
    echo "== ($name: no test selected)"
  elif [ "$rc" != 0 ]; then
    exit "$rc"
  else
    selected=1
  fi
}
"$venv/bin/ruff" check ratrain tests benchmarks
# the single-process tests in RATRAIN_TEST_WORKERS processes (pytest-xdist; default 2, 0 = in
# this one), each test file whole on one of them: most tests keep one core busy, and the two
# slowest (the README's commands, the Slurm scripts) take three minutes each
workers=${RATRAIN_TEST_WORKERS:-2}
[[ $workers =~ ^[0-9]+$ ]] || { echo "error: RATRAIN_TEST_WORKERS=$workers: a count (0 = no workers)" >&2; exit 2; }
step single "$py" -m pytest -q -n "$workers" --dist loadfile "$@"
echo "== 2-node test on emulated nodes (scripts/cluster.sh; needs root with network namespaces)"
step cluster "$py" -m pytest -q --cluster tests/test_cluster.py "$@"
for n in 2 3 4; do
  echo "== MPI tests on $n ranks"
  step "mpi$n" "$venv/bin/mpirun" -n "$n" --oversubscribe "$py" -m pytest -q --with-mpi -m mpi \
    -p no:cacheprovider "$@"
done
if [ "$selected" = 0 ]; then
  echo "error: no step selected a test (arguments: $*)" >&2
  exit 5
fi
echo "== skipped tests and why (each step; under mpirun one line per distinct reason)"
for f in single cluster mpi2 mpi3 mpi4; do
  grep -ah '^SKIPPED' "$log/$f" 2>/dev/null | sort -u | sed "s/^/$f: /" || true
done > "$log/skips"
if [ -s "$log/skips" ]; then cat "$log/skips"; else echo "(none)"; fi
