"""A run is bitwise the same however its ranks are packed into nodes, whatever its placement
and its compute threads: pp 2 x dp 2 on 4 ranks as one node, two nodes of two, four nodes of
one (one host cut into the platform's nodes under emulation, with a fast two-level throttle),
under the policy that all-reduces and the one that reduce-scatters and all-gathers.

    mpirun --oversubscribe -n 4 python -m pytest --with-mpi tests/test_nodes_mpi.py
"""

from dataclasses import replace

import pytest

from ratrain.config import PlatformConfig
from tests._executor_util import params_digest, tiny_config, train


def _packed(cfg, per_node, placement, threads):
    # emulation on (so one host is cut into nodes of per_node ranks), links throttled but fast,
    # compute not paced (the host profile has no compute rate)
    plat = PlatformConfig(profile="host", emulate=True, link_bandwidth=1e11, link_latency=0.0,
                          intra_bandwidth=1e12, ranks_per_node=per_node)
    return replace(cfg, platform=plat, parallel=replace(cfg.parallel, placement=placement),
                   run=replace(cfg.run, threads=threads))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("policy", ["baseline-1f1b", "ratrain"])
def test_packing_placement_and_threads_do_not_change_a_bit(policy, mpi_group):
    comm = mpi_group(4)
    base = tiny_config(pp=2, dp=2, m=3, policy=policy, steps=3, micro_batch=3)
    out = {}
    for per_node, placement, threads in ((4, "pp", 1), (2, "pp", 2), (1, "pp", 3),
                                         (2, "dp", 1), (1, "dp", 2)):
        res, _, ex = train(_packed(base, per_node, placement, threads), comm)
        losses = [(r.loss, r.grad_norm) for r in res]
        digests = comm.allgather((ex.stage, params_digest(ex.final_params)))
        out[per_node, placement, threads] = (losses, sorted(set(digests)))
    first = next(iter(out.values()))
    for key, got in out.items():
        assert got == first, key
