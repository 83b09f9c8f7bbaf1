#!/usr/bin/env bash
# The main job on one process: sets up .venv, prepares the default corpus (the Python standard
# library's sources, byte-level) on first use and trains jobs/tiny.yaml, printing loss per step.
# Extra arguments go to the trainer, e.g. `scripts/demo.sh --set run.steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m ratrain.train --config jobs/tiny.yaml "$@"
