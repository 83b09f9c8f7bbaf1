"""The trainer under mpirun: bad input is refused on every rank before any work.

(Layouts against one rank are checked in tests/test_executor_mpi.py.)
"""

import os

import numpy as np
import pytest

from ratrain.train import main

mpi = pytest.importorskip("mpi4py.MPI")
COMM = mpi.COMM_WORLD

TINY = """
model: {vocab_size: 64, hidden: 32, layers: 4, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}
parallel: {micro_batch: 2, num_micro_batches: 4}
optim: {lr: 1.0e-2, warmup_steps: 2}
checkpoint: {resume: never}
run: {steps: 3, log_interval: 1, threads: 1}
"""


def shared_dir(tmp_path_factory, name):
    path = str(tmp_path_factory.mktemp(name)) if COMM.rank == 0 else None
    return COMM.bcast(path, root=0)


@pytest.fixture()
def job(tmp_path_factory):
    d = shared_dir(tmp_path_factory, "job")
    if COMM.rank == 0:
        from ratrain.data import write_tokens

        rng = np.random.default_rng(0)
        write_tokens(os.path.join(d, "t.bin"), rng.integers(0, 64, 20000), vocab_size=64)
        with open(os.path.join(d, "job.yaml"), "w") as f:
            f.write(TINY + f"data: {{tokens: {d}/t.bin}}\n")
    COMM.Barrier()
    return d


@pytest.mark.mpi(min_size=2)
def test_wrong_world_size_is_refused_on_every_rank(job, capsys):
    rc = main(["--config", f"{job}/job.yaml", "--set", f"parallel.dp={COMM.size + 1}",
               "--set", f"run.dir={job}/bad"])
    assert rc == 2
    err = capsys.readouterr().err
    if COMM.rank == 0:
        assert f"world size {COMM.size} != parallel.pp x parallel.dp" in err
    assert not os.path.exists(f"{job}/bad")


@pytest.mark.mpi(min_size=2)
def test_data_error_on_every_rank(job, capsys):
    rc = main(["--config", f"{job}/job.yaml", "--set", f"parallel.dp={COMM.size}",
               "--set", "data.tokens=/nonexistent.bin", "--set", f"run.dir={job}/bad"])
    assert rc == 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_sharded_resume_is_bitwise_exact(job, precision):
    """ratrain at dp > 1 shards optimizer state; its checkpoints gather it block by block and
    a resumed run continues bitwise, also at another layout (baseline, unsharded)."""
    import json

    dp = COMM.size
    common = ["--config", f"{job}/job.yaml", "--set", f"parallel.dp={dp}",
              "--set", f"precision={precision}", "--set", "schedule.policy=ratrain"]
    assert main([*common, "--set", "run.steps=4", "--set", f"run.dir={job}/full-{precision}"]) == 0
    part = ["--set", f"run.dir={job}/part-{precision}", "--set", "checkpoint.interval=2",
            "--set", "checkpoint.resume=auto"]
    assert main([*common, *part, "--set", "run.steps=2"]) == 0
    assert main([*common, *part, "--set", "run.steps=4"]) == 0
    COMM.Barrier()
    if COMM.rank == 0:
        def losses(d):
            with open(f"{d}/metrics.jsonl") as f:
                return [(r["loss"], r["grad_norm"]) for r in map(json.loads, f) if "loss" in r]

        assert losses(f"{job}/part-{precision}") == losses(f"{job}/full-{precision}")
