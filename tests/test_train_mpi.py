"""The trainer under mpirun: bad input is refused on every rank before any work.

(Layouts against one rank are checked in tests/test_executor_mpi.py.)
"""

import os

import numpy as np
import pytest

from ratrain.train import main
from tests._mpi_job import tiny_job

mpi = pytest.importorskip("mpi4py.MPI")
COMM = mpi.COMM_WORLD

@pytest.fixture()
def job(tmp_path_factory):
    return tiny_job(COMM, tmp_path_factory)


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
def test_a_megatron_prefix_without_its_index_on_every_rank(job, capsys):
    """An int32 Megatron corpus (as Megatron-LM writes it: no sidecar) whose .idx is missing is
    refused on every rank, not read as flat uint16 tokens."""
    if COMM.rank == 0:
        from ratrain.data import sidecar_path, write_tokens

        write_tokens(f"{job}/m.bin", np.arange(20000) % 64, vocab_size=70000)
        os.unlink(f"{job}/m.idx")
        os.unlink(sidecar_path(f"{job}/m.bin"))
    COMM.Barrier()
    rc = main(["--config", f"{job}/job.yaml", "--set", f"parallel.dp={COMM.size}",
               "--set", f"data.tokens={job}/m", "--set", f"run.dir={job}/bad"])
    assert rc == 2
    if COMM.rank == 0:
        assert f"names a Megatron prefix but its index {job}/m.idx does not exist" in \
            capsys.readouterr().err
    assert not os.path.exists(f"{job}/bad")


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
