"""Checkpoints under MPI: save at one pp x dp layout, load at another; collective verdicts.

    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # only when root
    .venv/bin/mpirun --oversubscribe -n 2 .venv/bin/python -m pytest --with-mpi tests/test_checkpoint_mpi.py
    .venv/bin/mpirun --oversubscribe -n 4 .venv/bin/python -m pytest --with-mpi tests/test_checkpoint_mpi.py

Stage ownership is faked with name subsets (`stage_blocks`), ranks laid out as
`arange(world).reshape(dp, pp)` (rank = replica * pp + stage), as `Topology` does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib

import numpy as np
import pytest

from ratrain import checkpoint as ck
from ratrain.config import CheckpointConfig, config_from_dict
from ratrain.exec.spec import model_blocks, stage_blocks

MODEL = {"vocab_size": 32, "hidden": 16, "layers": 4, "heads": 2, "kv_heads": 2, "ffn_hidden": 24}
BUFFER_IDX = {"master": 0, "m": 1, "v": 2}


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def layouts(n):
    """Every (pp, dp) with pp * dp == n and pp <= the model's layers."""
    return [(pp, n // pp) for pp in range(1, n + 1) if n % pp == 0 and pp <= MODEL["layers"]]


def make_cfg(pp, dp, keep=3):
    return config_from_dict(
        {"model": MODEL, "parallel": {"pp": pp, "dp": dp}, "checkpoint": {"keep": keep}}
    )


def value(name, buf, step, shape):
    rng = np.random.default_rng([zlib.crc32(name.encode()), BUFFER_IDX[buf], step])
    return rng.standard_normal(shape, dtype=np.float32)


def stage_names(cfg, stage):
    return [p for b in stage_blocks(cfg.model, cfg.parallel.pp, stage) for p in b.params]


def tensors(cfg, stage, step):
    return {
        k: {p.name: value(p.name, k, step, p.shape) for p in stage_names(cfg, stage)} for k in BUFFER_IDX
    }


@pytest.fixture()
def root():
    comm = world()
    d = comm.bcast(tempfile.mkdtemp(prefix="ckpt-mpi-") if comm.Get_rank() == 0 else None)
    yield d
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


def save(root, step, pp, dp, state=None):
    comm = world()
    rank = comm.Get_rank()
    cfg = make_cfg(pp, dp)
    stage, replica = rank % pp, rank // pp
    return ck.save_checkpoint(
        root,
        step,
        cfg,
        tensors(cfg, stage, step),
        state if state is not None else {"data_position": step},
        stage=stage,
        replica=replica,
        comm=comm,
    )


def same_everywhere(x):
    got = world().allgather(x)
    assert all(g == got[0] for g in got), got
    return got[0]


@pytest.mark.mpi(min_size=2)
def test_save_one_layout_load_every_other(root):
    comm = world()
    n, rank = comm.Get_size(), comm.Get_rank()
    all_names = {p.name for b in model_blocks(make_cfg(1, 1).model) for p in b.params}
    for step, (pp, dp) in enumerate(layouts(n), start=1):
        path = same_everywhere(save(root, step, pp, dp))
        man = ck.read_manifest(path)
        assert [e["file"] for e in man["files"]] == [ck.shard_name(s) for s in range(pp)]
        assert man["topology"]["pp"] == pp and man["topology"]["world_size"] == n
        assert ck.verify_checkpoint(path, comm=comm) == []
        for lpp, ldp in layouts(n):  # resume at every layout of this world
            cfg = make_cfg(lpp, ldp)
            names = [p.name for p in stage_names(cfg, rank % lpp)]
            got = ck.load_checkpoint(path, names)
            assert got["step"] == step and got["state"] == {"data_position": step}
            for p in stage_names(cfg, rank % lpp):
                for buf in BUFFER_IDX:
                    want = value(p.name, buf, step, p.shape)
                    assert np.array_equal(got[buf][p.name].view(np.uint32), want.view(np.uint32))
            covered = comm.allgather(names)
            assert {x for ns in covered for x in ns} == all_names


@pytest.mark.mpi(min_size=2)
def test_damage_gives_the_same_refusal_on_every_rank(root):
    comm = world()
    n = comm.Get_size()
    pp = max(p for p, _ in layouts(n))
    path = save(root, 4, pp, n // pp)
    shard = os.path.join(path, ck.shard_name(pp - 1))
    if comm.Get_rank() == 0:
        with open(shard, "r+b") as f:
            f.seek(3000)
            f.write(b"\x00\x01\x02")
    comm.Barrier()
    problems = same_everywhere(ck.verify_checkpoint(path, comm=comm))
    assert len(problems) == 1 and problems[0].startswith(f"{shard}: checksum mismatch")
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve_resume(CheckpointConfig(resume=path), "x", make_cfg(1, 1).model, comm=comm)
    assert shard in same_everywhere(str(e.value))


@pytest.mark.mpi(min_size=2)
def test_auto_skips_damaged_collectively(root):
    comm = world()
    n = comm.Get_size()
    save(root, 1, n, 1) if n <= MODEL["layers"] else save(root, 1, 1, n)
    path2 = save(root, 2, 1, n)
    if comm.Get_rank() == 0:
        os.unlink(os.path.join(path2, "shard-s000.h5"))
        os.makedirs(os.path.join(root, "ckpt-000003"))  # an interrupted save
    comm.Barrier()
    logs = []
    got = ck.resolve_resume(CheckpointConfig(dir=root), "x", make_cfg(1, 1).model, comm=comm, log=logs.append)
    assert same_everywhere(got) == os.path.join(root, "ckpt-000001")
    if comm.Get_rank() == 0:
        assert "ckpt-000003" in logs[0] and "missing shard" in logs[1]
    else:
        assert logs == []  # only rank 0 logs


@pytest.mark.mpi(min_size=2)
def test_one_failing_rank_commits_nothing(root):
    comm = world()
    n, rank = comm.Get_size(), comm.Get_rank()
    cfg = make_cfg(n, 1) if n <= MODEL["layers"] else make_cfg(1, n)
    pp = cfg.parallel.pp
    t = tensors(cfg, rank % pp, 1)
    if rank == n - 1 and rank // pp == 0:
        name = next(iter(t["m"]))
        t["m"][name] = t["m"][name].astype(np.float64)
    with pytest.raises(ck.CheckpointError) as e:
        ck.save_checkpoint(root, 1, cfg, t, {}, stage=rank % pp, replica=rank // pp, comm=comm)
    msg = same_everywhere(str(e.value))
    assert "not committed" in msg and f"rank {n - 1}" in msg
    assert not ck.is_committed(os.path.join(root, "ckpt-000001"))


@pytest.mark.mpi(min_size=2)
def test_scalar_state_must_agree(root):
    comm = world()
    with pytest.raises(ck.CheckpointError) as e:
        save(root, 1, 1, comm.Get_size(), state={"rank": comm.Get_rank()})
    assert "differs between ranks" in same_everywhere(str(e.value))
