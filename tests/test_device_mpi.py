"""Device ranks under MPI: pipeline messages and collectives of device arrays go through host
staging (`runtime.staged`), and a 2 x 2 grid of device ranks matches one host rank, its three
policies bitwise equal (issues 19 and 29's 4-ranks-on-one-GPU check; here on the stand-in, on a
GPU too when there is one, where fp16 and bf16 run cuDNN's fused attention).

    mpirun --oversubscribe -n 4 python -m pytest --with-mpi tests/test_device_mpi.py
"""

from dataclasses import replace

import numpy as np
import pytest

from tests._devices import DEVICES
from tests._executor_util import MODEL, params_digest, same_global_batch, tiny_config, train


def _on(cfg, device):
    return replace(cfg, run=replace(cfg.run, device=device))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_device_grid_matches_one_host_rank_and_policies_are_bitwise_equal(device, precision,
                                                                          mpi_group):
    comm = mpi_group(4)
    fused = device == "gpu" and precision != "fp32"  # cuDNN's attention (auto), deterministic
    model = replace(MODEL, hidden=64) if fused else MODEL  # head size 16 for cuDNN
    out = {}
    for policy in ("baseline-1f1b", "megatron-1f1b", "ratrain"):
        cfg = _on(tiny_config(pp=2, dp=2, m=3, precision=precision, policy=policy, steps=3,
                              model=model), device)
        res, _, ex = train(cfg, comm)
        assert (ex.ctx.kernels.names["attention"] == "cudnn") == fused, ex.ctx.kernels.describe()
        out[policy] = ([(r.loss, r.grad_norm, r.skipped) for r in res],
                       params_digest(ex.final_params))
    first = out["baseline-1f1b"]
    assert all(got == first for got in out.values()), out
    ref, _, _ = train(same_global_batch(tiny_config(pp=2, dp=2, m=3, precision=precision,
                                                    steps=3, model=model)))
    # the fused attention's gradients come back in 16 bits (the tiled path's in fp32)
    tol = {"fp32": 1e-5, "fp16": 5e-3 if fused else 2e-3, "bf16": 2e-2}[precision]
    np.testing.assert_allclose([loss for loss, _, _ in first[0]], [r.loss for r in ref], rtol=tol)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_device_grid_with_graphs_is_bitwise_the_eager_grid(precision, mpi_group):
    """pp 2 x dp 2 on the stand-in with the layers' calls replayed as graphs (run.graphs: on,
    cuDNN's attention counted, the device kernels counted): each policy bitwise the eager run,
    and the policies bitwise one another."""
    comm = mpi_group(4)
    out = {}
    for graphs in ("off", "on"):
        for policy in ("baseline-1f1b", "megatron-1f1b", "ratrain"):
            cfg = tiny_config(pp=2, dp=2, m=3, precision=precision, policy=policy, steps=4)
            cfg = replace(cfg, run=replace(cfg.run, device="standin", devkernels="count",
                                           attention="cudnn-count", graphs=graphs))
            res, _, ex = train(cfg, comm)
            assert (ex.compute.graphs is not None) == (graphs == "on")
            if graphs == "on":  # every layer's calls captured, then replayed
                assert ex.compute.graphs.captures > 0
            out[graphs, policy] = ([(r.loss, r.grad_norm, r.skipped) for r in res],
                                   params_digest(ex.final_params))
    first = out["off", "baseline-1f1b"]
    assert all(got == first for got in out.values()), out
