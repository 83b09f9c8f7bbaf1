#!/usr/bin/env bash
# The whole test suite: sets up .venv, runs pytest on one process, the 2-node test on emulated
# nodes (as root with network namespaces; says why it skips otherwise), then the MPI tests under
# mpirun at 2, 3 and 4 ranks (pytest-mpi). Extra arguments go to every pytest call.
# RATRAIN_TEST_TORCH=1 also installs PyTorch + transformers for the reference checks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${RATRAIN_TEST_TORCH:-0}" = 1 ]; then
  .venv/bin/python -c "import torch, transformers" 2>/dev/null ||
    .venv/bin/python -m pip install -q "torch==2.13.0" transformers ||
    .venv/bin/python -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch transformers ||
    echo "warning: could not install torch/transformers; reference tests will be skipped"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_osc=^ucx
export PYTHONHASHSEED=0
.venv/bin/ruff check ratrain tests benchmarks
.venv/bin/python -m pytest -q "$@"
echo "== 2-node test on emulated nodes (scripts/cluster.sh; skipped, with the reason, unless root with network namespaces)"
.venv/bin/python -m pytest -q -rs --cluster tests/test_cluster.py "$@"
for n in 2 3 4; do
  echo "== MPI tests on $n ranks"
  .venv/bin/mpirun -n "$n" --oversubscribe .venv/bin/python -m pytest -q --with-mpi -m mpi \
    -p no:cacheprovider "$@"
done
