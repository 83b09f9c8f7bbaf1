"""Offload to the memory tier under MPI: at pp 2 x dp 2 a run with the activations, the
optimizer moments (fp16: and the masters) or both in the tier is bitwise the run without, under
every policy, fp32 and fp16.

    mpirun --oversubscribe -n 4 python -m pytest --with-mpi tests/test_offload_mpi.py
"""

from dataclasses import replace

import pytest

from ratrain.config import OffloadConfig
from tests._executor_util import params_digest, tiny_config, train


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_offload_is_bitwise_the_run_without_at_pp2_dp2(precision, mpi_group, tmp_path_factory):
    comm = mpi_group(4)
    path = comm.bcast(str(tmp_path_factory.mktemp("tier")) if comm.Get_rank() == 0 else None)
    state = "masters" if precision == "fp16" else "moments"
    variants = {"activations": OffloadConfig(activations="all"),
                "optimizer": OffloadConfig(optimizer=state),
                "both": OffloadConfig(activations="all", optimizer=state)}
    ref = None
    for policy in ("baseline-1f1b", "megatron-1f1b", "ratrain"):
        base = tiny_config(pp=2, dp=2, m=3, precision=precision, policy=policy, steps=2)
        runs = {"none": base} if ref is None else {}
        runs.update({k: replace(base, offload=replace(v, path=path)) for k, v in variants.items()})
        for name, cfg in runs.items():
            res, _, ex = train(cfg, comm)
            got = ([(r.loss, r.grad_norm, r.skipped) for r in res], params_digest(ex.final_params))
            ref = ref or got
            assert got == ref, (policy, name)
