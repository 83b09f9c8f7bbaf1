#!/usr/bin/env bash
# Creates .venv (once) and installs ratrain into it with an MPI that pip provides.
# Idempotent: a second run only re-checks the install. Set RATRAIN_VENV to use another path,
# RATRAIN_EXTRAS to change the extras (default: mpi,test,plot,fast).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${RATRAIN_VENV:-.venv}
extras=${RATRAIN_EXTRAS:-mpi,test,plot,fast}
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
