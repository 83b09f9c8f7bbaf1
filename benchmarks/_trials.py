"""Shared by the fault-trial scripts (signal_trials, disk_trials): a tiny job, launching it at
1 or 4 ranks, its loss curve, and the record (docs/records/NAME.json, the shared format)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MPIRUN = str(Path(PY).parent / "mpirun")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_mpi_yield_when_idle="1",
           PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", OMPI_MCA_osc="^ucx",
           PYTHONHASHSEED="0")
JOB = """model: {{vocab_size: 64, hidden: 32, layers: 4, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}}
parallel: {{micro_batch: 2, num_micro_batches: 2}}
optim: {{lr: 1.0e-2, warmup_steps: 2}}
data: {{tokens: {tokens}, eval_interval: 0}}
checkpoint: {{interval: 5, resume: auto}}
comm: {{timeout: 30}}
run: {{steps: {steps}, log_interval: 1, threads: 1}}
"""


def job(work: Path, steps: int) -> Path:
    """A job file (random tokens, vocabulary 64) under `work`."""
    from ratrain.data import write_tokens

    work.mkdir(parents=True, exist_ok=True)
    tokens = work / "train.bin"
    if not tokens.exists():
        write_tokens(tokens, np.random.default_rng(0).integers(0, 64, 20000), vocab_size=64)
    path = work / "job.yaml"
    path.write_text(JOB.format(tokens=tokens, steps=steps))
    return path


def command(cfg: Path, ranks: int, run_dir: Path, *sets: str) -> list[str]:
    """`python -m ratrain.train` on `ranks` ranks (4: mpirun, pp 2 x dp 2)."""
    cmd = [PY, "-m", "ratrain.train", "--config", str(cfg), "--set", f"run.dir={run_dir}"]
    if ranks > 1:
        cmd = [MPIRUN, "-n", str(ranks), "--oversubscribe", *cmd,
               "--set", "parallel.pp=2", "--set", f"parallel.dp={ranks // 2}"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


def curve(run_dir: Path) -> list:
    """(step, loss, grad_norm) of every step recorded, the last record of each."""
    from ratrain.job.metrics import read_curve

    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_curve(str(run_dir))]


def write_record(name: str, command: str, figures: dict) -> Path:
    """docs/records/NAME.json through the shared writer (benchmarks/record.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from record import write_record as shared  # beside this script

    return shared(name, command, figures, load_before=LOAD_BEFORE)


LOAD_BEFORE = os.getloadavg()[0]
