#!/usr/bin/env bash
# The wheels scripts/gpu-check.sh installs on the device machine, which reaches no package index,
# into .whl/ (git-ignored; the device tool's `carry`): for its Python 3.12 on x86_64 Linux, at
# setup.cfg's versions (pytest-mpi from the test extra; nvidia-cudnn-frontend and ml_dtypes from
# the gpu extra), and cuda-bindings with cuda-pathfinder, which the frontend calls and
# gpu-check.sh installs only where the machine lacks them. Each without its dependencies. Prints
# the total, which must stay under the tool's 64 MiB for everything carried (about 20 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
req() {  # req NAME: NAME's requirement line in setup.cfg
  sed -n "s/^ *\($1[=<>~!].*\)$/\1/p" setup.cfg | head -1
}
grep -qx '/.whl/' .gitignore || { echo "error: .whl/ is not git-ignored" >&2; exit 1; }
rm -rf .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "$(req pytest-mpi)" "$(req nvidia-cudnn-frontend)" "$(req ml_dtypes)" \
  "cuda-bindings>=13,<14" cuda-pathfinder
ls -l .whl
du -sh .whl
