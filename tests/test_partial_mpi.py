"""Partial synchronization under MPI: the runtime (collectives in the engine, overlapped with
the backward) against a plain reference that runs the replicas one after another in one
process; policies bitwise equal; the replicas' mean at the end of a run.

    mpirun --oversubscribe -n 4 python -m pytest --with-mpi tests/test_partial_mpi.py
"""

from dataclasses import replace

import numpy as np
import pytest

from ratrain.comm.algos import reference as allreduce_reference
from ratrain.config import OffloadConfig, SyncConfig
from ratrain.runtime.rank import build_rank
from tests._executor_util import global_batch, params_digest, tiny_config, train
from tests._partial_ref import Replicas


def partial_config(pp=1, dp=2, policy="baseline-1f1b", period=2, precision="fp32", steps=4,
                   average="after-update"):
    cfg = tiny_config(pp=pp, dp=dp, m=2, precision=precision, policy=policy, steps=steps)
    return replace(cfg, schedule=replace(cfg.schedule, shard_optimizer=False),
                   sync=SyncConfig(mode="partial", period=period, average=average))


def reference(cfg, steps):
    """The replicas of `cfg` one after another in one process (`tests._partial_ref`): each
    replica's results and final whole parameters."""
    m = cfg.parallel.num_micro_batches
    reps = Replicas(cfg)
    results = [[] for _ in range(cfg.parallel.dp)]
    for s in range(steps):
        inputs, targets = global_batch(cfg, s)
        batches = [(inputs[r * m:(r + 1) * m], targets[r * m:(r + 1) * m])
                   for r in range(cfg.parallel.dp)]
        for r, res in enumerate(reps.step(s, batches)):
            results[r].append(res)
    params = [ex.full_params() for ex in reps.executors]
    reps.close()
    return results, params


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("average", SyncConfig.AVERAGES)
@pytest.mark.parametrize("policy", ["baseline-1f1b", "ratrain"])
def test_runtime_is_bitwise_the_reference(policy, average, mpi_group):
    comm = mpi_group(2)
    cfg = partial_config(policy=policy, steps=4, average=average)
    res, _, ex = train(cfg, comm)
    ref, ref_params = reference(cfg, 4)
    mine = ref[ex.replica]
    # each replica's own loss is in the reference; the runtime's is their mean
    np.testing.assert_allclose([r.loss for r in res], [(a.loss + b.loss) / 2
                                                       for a, b in zip(*ref)], rtol=1e-12)
    assert params_digest(ex.final_params) == params_digest(ref_params[ex.replica])
    assert [r.lr for r in res] == [r.lr for r in mine]
    others = comm.allgather(params_digest(ex.final_params))
    assert others[0] != others[1]  # the replicas differ between averages


@pytest.mark.mpi(min_size=2)
def test_offload_under_partial_sync_is_bitwise_the_run_without(mpi_group, tmp_path_factory):
    """The tier's transfers and the averages in one plan: activations and moments in the tier
    change when bytes move, never what partial sync computes."""
    comm = mpi_group(2)
    path = comm.bcast(str(tmp_path_factory.mktemp("tier")) if comm.Get_rank() == 0 else None)
    cfg = partial_config(policy="ratrain", steps=3)
    tiered = replace(cfg, offload=OffloadConfig(activations="all", optimizer="moments",
                                                path=path))
    out = []
    for c in (cfg, tiered):
        res, _, ex = train(c, comm)
        out.append(([(r.loss, r.grad_norm) for r in res], params_digest(ex.final_params)))
    assert out[0] == out[1]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("average", SyncConfig.AVERAGES)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_policies_bitwise_equal_and_the_mean_model(precision, average, mpi_group):
    """pp 2 x dp 2: every policy computes the same partial training; the mean model a
    checkpoint holds (`iter_full_state(mean=True)`) is the replicas' masters summed in the
    runtime's order, divided by dp, the same on both replicas."""
    comm = mpi_group(4)
    out = {}
    for policy in ("baseline-1f1b", "megatron-1f1b", "ratrain"):
        cfg = partial_config(pp=2, dp=2, policy=policy, period=3, precision=precision, steps=3,
                             average=average)
        res, _, ex = train(cfg, comm)
        out[policy] = ([r.loss for r in res], params_digest(ex.final_params))
    assert all(v == out["baseline-1f1b"] for v in out.values()), out
    rank = build_rank(cfg, comm, watchdog_s=60)  # a fresh rank: step 0's masters
    try:
        ex = rank.executor
        m = cfg.parallel.num_micro_batches
        inputs, targets = global_batch(cfg, 0)
        sl = slice(ex.replica * m, (ex.replica + 1) * m)
        ex.run_step(0, (inputs[sl], targets[sl]))
        mine = ex.full_params()
        mean = {n: a.copy() for _, st in ex.iter_full_state(("master",), mean=True)
                for n, a in st["master"].items()}
    finally:
        rank.close()
    every = comm.allgather((ex.stage, mine, params_digest(mean)))
    same = [x for x in every if x[0] == ex.stage]
    assert len({d for _, _, d in same}) == 1  # both replicas: one mean model
    for name, a in mean.items():
        want = allreduce_reference([p[name] for _, p, _ in same], "hier") / 2
        np.testing.assert_array_equal(a, want, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("average", SyncConfig.AVERAGES)
def test_checkpoints_hold_every_replica_and_resume_bitwise(average, tmp_path_factory, capsys):
    """A partial-sync run stopped at a checkpoint and resumed is bitwise the uninterrupted run;
    the checkpoint holds each replica's own state (verified like a shard) and, as its model,
    their mean; a run under full sync resumes from that mean."""
    import json
    import os

    from mpi4py import MPI

    from ratrain.checkpoint import load_checkpoint, newest_committed, verify_checkpoint
    from ratrain.train import main
    from tests._mpi_job import tiny_job

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        pytest.skip("runs at 2 ranks (the trainer takes the world)")
    job = tiny_job(comm, tmp_path_factory, "psync")
    common = ["--config", f"{job}/job.yaml", "--set", "parallel.dp=2", "--set",
              "sync.mode=partial", "--set", "sync.period=3", "--set",
              "schedule.shard_optimizer=false", "--set", f"sync.average={average}"]
    assert main([*common, "--set", "run.steps=4", "--set", f"run.dir={job}/whole"]) == 0
    part = ["--set", f"run.dir={job}/part", "--set", "checkpoint.interval=2",
            "--set", "checkpoint.resume=auto"]
    assert main([*common, *part, "--set", "run.steps=2"]) == 0
    assert main([*common, *part, "--set", "run.steps=4"]) == 0
    comm.Barrier()
    ckpt = newest_committed(f"{job}/part/checkpoints")
    assert verify_checkpoint(ckpt, comm=comm) == []
    if comm.rank == 0:
        def losses(d):
            with open(f"{d}/metrics.jsonl") as f:
                return [(r["loss"], r["grad_norm"]) for r in map(json.loads, f) if "loss" in r]

        assert losses(f"{job}/part") == losses(f"{job}/whole")
        reps = [load_checkpoint(ckpt, replica=r)["master"] for r in range(2)]
        model = load_checkpoint(ckpt, buffers=("master",))["master"]
        assert any(not np.array_equal(reps[0][n], reps[1][n]) for n in model)
        for n, a in model.items():
            np.testing.assert_array_equal(a, (reps[0][n] + reps[1][n]) / 2, err_msg=n)
    # a replica's state missing: the checkpoint is refused, naming the file
    if comm.rank == 0:
        import shutil

        shutil.copytree(ckpt, f"{job}/lost/ckpt-000004")
        os.unlink(f"{job}/lost/ckpt-000004/shard-s000-r001.h5")
    comm.Barrier()
    assert any("shard-s000-r001.h5: missing shard" in p
               for p in verify_checkpoint(f"{job}/lost/ckpt-000004", comm=comm))
    # on under full sync: every replica starts from the checkpoint's model, the mean
    assert main([*common, *part, "--set", "sync.mode=full", "--set", "run.steps=5"]) == 0
