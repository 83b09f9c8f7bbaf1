"""A mixture (data.sources) under mpirun at pp 2 x dp 2: stopped at a random step and resumed,
the losses are bitwise those of the uninterrupted run."""

import json
import random

import numpy as np
import pytest

from ratrain.train import main
from tests._mpi_job import shared_dir

mpi = pytest.importorskip("mpi4py.MPI")
COMM = mpi.COMM_WORLD

JOB = """model: {vocab_size: 64, hidden: 32, layers: 4, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}
parallel: {pp: 2, dp: 2, micro_batch: 2, num_micro_batches: 2}
optim: {lr: 1.0e-2, warmup_steps: 2, decay_steps: 4}
run: {steps: 5, log_interval: 1, threads: 1}
"""


@pytest.mark.mpi(min_size=4)
def test_a_mixture_resumes_bitwise_at_pp2_dp2(tmp_path_factory):
    if COMM.size != 4:
        pytest.skip("the layout is pp 2 x dp 2: 4 ranks")
    d = shared_dir(COMM, tmp_path_factory, "mix")
    k = COMM.bcast(random.randint(1, 4) if COMM.rank == 0 else None)  # where the run stops
    if COMM.rank == 0:
        from ratrain.data import write_tokens

        rng = np.random.default_rng(0)
        srcs = []
        for i, (n, w) in enumerate(((9000, 3), (5000, 2), (7000, 1))):
            write_tokens(f"{d}/s{i}/train.bin", rng.integers(0, 64, n), vocab_size=64)
            srcs.append(f"{{tokens: {d}/s{i}/train.bin, weight: {w}}}")
        with open(f"{d}/job.yaml", "w") as f:
            f.write(JOB + f"data: {{order: shuffled, sources: [{', '.join(srcs)}]}}\n")
    COMM.Barrier()
    common = ["--config", f"{d}/job.yaml"]
    assert main([*common, "--set", f"run.dir={d}/full"]) == 0
    part = [*common, "--set", f"run.dir={d}/part", "--set", "checkpoint.resume=auto",
            "--set", f"checkpoint.interval={k}"]
    assert main([*part, "--set", f"run.steps={k}"]) == 0
    assert main(part) == 0
    COMM.Barrier()
    if COMM.rank == 0:
        def losses(run):
            with open(f"{d}/{run}/metrics.jsonl") as f:
                return [(r["loss"], r["grad_norm"]) for r in map(json.loads, f) if "loss" in r]

        assert losses("part") == losses("full") and len(losses("full")) == 5, f"stopped at {k}"
