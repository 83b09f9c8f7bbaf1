"""Heterogeneous clusters under MPI: what an asymmetric partition computes, and the trainer's
start-up with rank classes.

    mpirun --oversubscribe -n 4 python -m pytest --with-mpi -m mpi tests/test_hetero_mpi.py

An uneven layer split computes exactly what the even one does (the gradient norm's partials are
summed in global block order whatever the split); unequal replica shares change only the order
in which micro-batch gradients are summed, so they agree with equal shares to rounding, and the
three policies stay bitwise equal to each other under both.
"""

import os
from dataclasses import replace

import numpy as np
import pytest
import yaml

from ratrain.train import main
from tests._executor_util import tiny_config, train
from tests._mpi_job import TINY as _TINY
from tests._mpi_job import tiny_job

mpi = pytest.importorskip("mpi4py.MPI")
COMM = mpi.COMM_WORLD
POLICIES = ("baseline-1f1b", "megatron-1f1b", "ratrain")


def layout(cfg, shares=None, layers=None):
    return replace(cfg, parallel=replace(cfg.parallel, replica_shares=shares,
                                         layers_per_stage=layers))


def whole_model(ex, comm):
    """{name: fp32 master} of every stage, gathered (names are unique across stages)."""
    out = {}
    for part in comm.allgather(ex.final_params):
        out.update(part)
    return out


def run(cfg, comm):
    res, _, ex = train(cfg, comm)
    return [(r.loss, r.grad_norm, r.skipped) for r in res], whole_model(ex, comm)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_uneven_layer_split_is_bitwise_the_even_one(precision, mpi_group):
    comm = mpi_group(4)
    base = tiny_config(pp=2, dp=2, m=3, precision=precision, steps=3)
    even = run(base, comm)
    for layers in ((3, 1), (1, 3)):
        got = run(layout(base, layers=layers), comm)
        assert got[0] == even[0], layers
        for name, w in even[1].items():
            assert np.array_equal(got[1][name], w), (layers, name)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("pp,dp,shares", [(1, 4, (5, 4, 2, 1)), (2, 2, (4, 2))])
def test_unequal_shares_agree_with_equal_ones(pp, dp, shares, mpi_group):
    comm = mpi_group(4)
    base = tiny_config(pp=pp, dp=dp, m=3, steps=5)
    ref = run(base, comm)
    got = run(layout(base, shares=shares), comm)
    np.testing.assert_allclose([g[0] for g in got[0]], [r[0] for r in ref[0]], rtol=1e-6)
    np.testing.assert_allclose([g[1] for g in got[0]], [r[1] for r in ref[0]], rtol=1e-6)
    for name, w in ref[1].items():
        np.testing.assert_allclose(got[1][name], w, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_policies_stay_bitwise_equal_under_an_asymmetric_partition(precision, mpi_group):
    comm = mpi_group(4)
    base = layout(tiny_config(pp=2, dp=2, m=3, precision=precision, steps=3),
                  shares=(4, 2), layers=(3, 1))
    out = {pol: run(replace(base, schedule=replace(base.schedule, policy=pol)), comm)
           for pol in POLICIES}
    first = out[POLICIES[0]]
    for pol in POLICIES[1:]:
        assert out[pol][0] == first[0], pol
        for name, w in first[1].items():
            assert np.array_equal(out[pol][1][name], w), (pol, name)


# -- the trainer: rank classes at start-up ------------------------------------------------------

TINY = _TINY.replace("num_micro_batches: 4", "num_micro_batches: 3")


@pytest.fixture()
def job(tmp_path_factory):
    return tiny_job(COMM, tmp_path_factory, "hetero", TINY)


def classes(fast_ranks, slow_ranks, **slow):
    """`platform.classes` as a --set value: rank 0.. fast at twice the slow class's rate."""
    out = [{"name": "fast", "ranks": list(fast_ranks), "compute_flops": 2e9},
           {"name": "slow", "ranks": list(slow_ranks), "compute_flops": 1e9, **slow}]
    return "platform.classes=" + yaml.safe_dump(out, default_flow_style=True).strip()


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        import json

        return [json.loads(line)["loss"] for line in f if line.strip()]


@pytest.mark.mpi(min_size=2)
def test_trainer_resolves_auto_shares_for_the_classes(job):
    n = COMM.size
    args = ["--config", f"{job}/job.yaml", "--set", f"parallel.dp={n}"]
    assert main(args + ["--set", f"run.dir={job}/sym"]) == 0
    rc = main(args + ["--set", f"run.dir={job}/mixed", "--set", "parallel.replica_shares=auto",
                      "--set", classes([0], range(1, n))])
    assert rc == 0
    if COMM.rank == 0:
        with open(f"{job}/mixed/config.yaml") as f:
            resolved = yaml.safe_load(f)["parallel"]["replica_shares"]
        assert sum(resolved) == 3 * n and resolved[0] > max(resolved[1:]), resolved
        np.testing.assert_allclose(losses(f"{job}/mixed"), losses(f"{job}/sym"), rtol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_a_rank_without_a_class_is_refused_on_every_rank(job, capsys):
    n = COMM.size
    rc = main(["--config", f"{job}/job.yaml", "--set", f"parallel.dp={n}",
               "--set", classes([0], range(1, n - 1)) if n > 2 else
               "platform.classes=[{name: fast, ranks: [0]}]", "--set", f"run.dir={job}/bad"])
    assert rc == 2
    if COMM.rank == 0:
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"platform.classes: rank {n - 1}" in err[0], err
        assert "is in no class" in err[0]
    assert not os.path.exists(f"{job}/bad")


@pytest.mark.mpi(min_size=2)
def test_a_stage_over_its_class_cap_is_refused_on_every_rank(job, capsys):
    n = COMM.size
    rc = main(["--config", f"{job}/job.yaml", "--set", f"parallel.dp={n}",
               "--set", classes([0], range(1, n), ddr_bytes=100000),
               "--set", f"run.dir={job}/bad"])
    assert rc == 2
    if COMM.rank == 0:
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "platform.classes[1].ddr_bytes of class slow" in err[0], err
    assert not os.path.exists(f"{job}/bad")
