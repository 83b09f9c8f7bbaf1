#!/usr/bin/env bash
# Creates .venv (once) and installs ratrain into it with an MPI that pip provides.
# Idempotent: a second run only re-checks the install. Set RATRAIN_VENV to use another path,
# RATRAIN_EXTRAS to change the extras (default: mpi,test,plot,fast,data); RATRAIN_GPU=1 adds the cupy of the
# machine's CUDA (the gpu or gpu-cuda12 extra).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${RATRAIN_VENV:-.venv}
extras=${RATRAIN_EXTRAS:-mpi,test,plot,fast,data}
if [ "${RATRAIN_GPU:-0}" = 1 ]; then
  # the cupy of this machine's CUDA: the driver's CUDA version, as nvidia-smi reports it
  cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
  case "$cuda" in
    12) extras="$extras,gpu-cuda12" ;;
    13|1[4-9]) extras="$extras,gpu" ;;
    *) echo "RATRAIN_GPU=1: nvidia-smi reports no CUDA 12 or 13 driver (got '${cuda}'); install cupy by hand" >&2; exit 2 ;;
  esac
fi
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp="$venv/.ratrain-installed"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$venv/bin/python" -m pip install -q -e ".[$extras]"
  touch "$stamp"
fi
