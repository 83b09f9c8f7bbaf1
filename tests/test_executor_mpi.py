"""The executor under MPI: pp x dp layouts match one rank, policies are bitwise equal (also on
oneMKL in bf16), replicas hold identical weights.

    mpirun --oversubscribe -n 4 python -m pytest --with-mpi tests/test_executor_mpi.py

Each test splits the world into groups of pp * dp ranks (ranks left over sit it out) and
compares against a one-rank run of the same global batch computed locally.
"""


from dataclasses import replace

import numpy as np
import pytest

from tests._executor_util import params_digest, same_global_batch, tiny_config, train
from tests._prereq import need_mkl



@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pp,dp", [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp, dp, mpi_group):
    comm = mpi_group(pp * dp)
    cfg = tiny_config(pp=pp, dp=dp, m=3, policy="ratrain", steps=3)
    res, state, ex = train(cfg, comm)
    ref, ref_state, _ = train(same_global_batch(cfg))
    losses, ref_losses = np.array([r.loss for r in res]), np.array([r.loss for r in ref])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose([r.grad_norm for r in res], [r.grad_norm for r in ref], rtol=1e-4)
    ref_params = dict(ref_state.named("master"))
    for name, w in ex.final_params.items():
        np.testing.assert_allclose(w, ref_params[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # replicas of a stage hold identical weights, and every rank knows the same loss
    hashes = comm.allgather((ex.stage, params_digest(ex.final_params), [r.loss for r in res]))
    for stage, h, ls in hashes:
        assert ls == hashes[0][2]
        assert h == next(h2 for s2, h2, _ in hashes if s2 == stage)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "bf16-mkl"])
def test_policies_bitwise_equal_2x2(precision, mpi_group):
    precision, _, blas = precision.partition("-")  # bf16-mkl: run.blas=mkl, the 16-bit layout
    if blas:
        need_mkl()
    comm = mpi_group(4)
    out = {}
    # the presets, and presets with components switched through the schedule section
    variants = {"baseline-1f1b": {}, "megatron-1f1b": {}, "ratrain": {},
                "baseline-1f1b+update": {"update": "next-step"},
                "baseline-1f1b+shard": {"sync": "layer", "shard_optimizer": True},
                "ratrain-prefetch": {"prefetch": False, "buffers": "resident"}}
    for name, switches in variants.items():
        cfg = tiny_config(pp=2, dp=2, m=3, precision=precision, policy=name.split("+")[0]
                          .removesuffix("-prefetch"), steps=3)
        cfg = replace(cfg, schedule=replace(cfg.schedule, **switches),
                      run=replace(cfg.run, blas=blas or "auto"))
        res, state, ex = train(cfg, comm)
        out[name] = ([(r.loss, r.grad_norm, r.skipped) for r in res],
                     params_digest(ex.final_params))
    first = out["baseline-1f1b"]
    assert all(got == first for got in out.values()), [k for k, v in out.items() if v != first]


@pytest.mark.mpi(min_size=3)
def test_three_stages_fewer_micro_batches_than_stages(mpi_group):
    comm = mpi_group(3)
    cfg = tiny_config(pp=3, dp=1, m=2, precision="fp16", policy="ratrain", steps=2)
    res, state, _ = train(cfg, comm)
    ref, _, _ = train(same_global_batch(cfg))
    np.testing.assert_allclose([r.loss for r in res], [r.loss for r in ref], rtol=1e-3)
