"""What a rank imports (issue 33): nothing it does not use. numba (about 65 MiB of resident
memory, 110 once a kernel is loaded) only when a fused path is on and used, numba-cuda never
on a CPU rank, HDF5 only to read or write a shard, torch and transformers never."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests._prereq import need

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numba", "llvmlite", "numba.cuda", "h5py", "torch", "transformers", "cupy",
         "matplotlib")
STEPS = """
import dataclasses, json, sys
import ratrain.train  # the command's whole import
before = [m for m in {heavy} if m in sys.modules]
from tests._executor_util import tiny_config, train
cfg = tiny_config(steps=2)
train(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, fused={fused!r})))
print(json.dumps({{"import": before, "steps": [m for m in {heavy} if m in sys.modules]}}))
"""


def _loaded(fused: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RATRAIN_FUSED"}
    p = subprocess.run([sys.executable, "-c", STEPS.format(heavy=HEAVY, fused=fused)],
                       capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_cpu_rank_without_fused_kernels_never_imports_numba_or_hdf5():
    got = _loaded("off")
    assert got == {"import": [], "steps": []}


def test_numba_comes_with_the_first_fused_kernel_and_numba_cuda_never_on_a_cpu_rank():
    need("numba", "the fused kernels")
    got = _loaded("auto")
    assert got["import"] == []  # importing the command loads none of them
    assert got["steps"] == ["numba", "llvmlite"]  # the kernels' compiler, and nothing else
