"""Nodes and the hierarchical collectives: the documented order (a left fold in rank order,
whatever the packing into nodes), runs and placements, the two-level cost model, and under MPI
the shared-memory + chain collectives bitwise equal to the reference for every grouping of the
ranks into nodes (one node, a node per rank, pairs, alternating, uneven), every dtype, sum and
max, directly, through the engine and through the two-level link throttle.

One host stands for several nodes here: a `NodeGroup` takes any node id per member, and its
runs on one "node" share a real shared-memory window (tests/test_cluster.py runs real emulated
nodes).
"""

import time
import zlib

import numpy as np
import pytest

from ratrain.comm import algos, model
from ratrain.comm import collectives as C
from ratrain.comm.engine import CommEngine
from ratrain.comm.hier import NodeGroup
from ratrain.comm.shm import SharedSlots
from ratrain.comm.topology import (
    NodeLinks,
    Topology,
    coords,
    grid,
    host_keys,
    pack_nodes,
    srun_node,
)
from ratrain.shim.link import Levels, Link, Slots

DTYPES = (np.float32, np.float16, np.float64)


def inputs(p, n, dtype, seed=0):
    return [np.random.default_rng(seed * 1000 + q).standard_normal(n).astype(dtype)
            for q in range(p)]


def groupings(p):
    """Ways to put p ranks on nodes (node id per rank)."""
    return {"one node": [0] * p, "a node each": list(range(p)),
            "pairs": [q // 2 for q in range(p)], "alternating": [q % 2 for q in range(p)],
            "uneven": [0] * (p - 1) + [1]}


# -- one process: orders, runs, placement, model --------------------------------------------


def test_reference_hier_is_a_left_fold_in_rank_order():
    xs = [np.full(3, v, np.float32) for v in (1e8, 1.0, -1e8, 1.0)]
    out = C.reference_allreduce(xs, "hier")
    acc = np.float32(1e8)
    for v in (1.0, -1e8, 1.0):
        acc = np.float32(acc + np.float32(v))
    assert np.all(out == acc) and acc == 1.0  # ((1e8 + 1) - 1e8) + 1: the 1 is lost once
    for p in (1, 2, 3, 5):
        ys = inputs(p, 101, np.float16)
        ref = C.reference_allreduce(ys, "hier")
        assert ref.dtype == np.float16
        np.testing.assert_allclose(ref, np.sum(np.array(ys, np.float64), 0), rtol=1e-2, atol=1e-2)


def test_runs_placement_and_packing():
    assert model.runs_of([0, 0, 1, 1]) == [(0, 2), (2, 4)]
    assert model.runs_of([0, 1, 0, 1]) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert model.runs_of([3]) == [(0, 1)]
    # pp: a replica's stages are neighbours; dp: a stage's replicas are
    assert grid(2, 3, "pp").tolist() == [[0, 1], [2, 3], [4, 5]]
    assert grid(2, 3, "dp").tolist() == [[0, 3], [1, 4], [2, 5]]
    for pl in ("pp", "dp"):
        g = grid(3, 4, pl)
        for r in range(4):
            for s in range(3):
                assert coords(int(g[r, s]), 3, 4, pl) == (s, r)
    with pytest.raises(ValueError, match="placement"):
        grid(2, 2, "xy")
    hosts = ["a", "a", "a", "b", "b", "a"]
    assert pack_nodes(hosts) == [0, 0, 0, 1, 1, 0]
    assert pack_nodes(hosts, 2) == [0, 0, 1, 2, 2, 1]  # a host's ranks in nodes of 2


def test_nodes_under_srun_are_the_allocations():
    """`srun -N 2 --ntasks-per-node=2`: on real nodes the allocation's two nodes (srun and MPI's
    shared-memory split agree); a node never spans two shared-memory groups, so on two slurmd
    of one host, where MPI's locality gave groups of 1+1+2 and a window over srun's node fails
    (MPI_ERR_RMA_SHARED, seen in tests/test_slurm.py), the groups stay; mpirun's ranks (their
    daemon's Slurm variables) are grouped by the split alone."""
    srun = [srun_node(r, 4, {"SLURM_PROCID": str(r), "SLURM_STEP_NUM_TASKS": "4",
                             "SLURM_NODEID": str(r // 2)}) for r in range(4)]
    assert srun == ["0", "0", "1", "1"]
    real = [("n1", 0), ("n1", 0), ("n2", 2), ("n2", 2)]  # two real nodes: the same either way
    assert pack_nodes(host_keys(list(zip(real, srun)))) == [0, 0, 1, 1]
    assert pack_nodes(host_keys([(h, None) for h in real])) == [0, 0, 1, 1]
    one_host = [("vm", 0), ("vm", 1), ("vm", 2), ("vm", 2)]  # the split as it came out there
    assert pack_nodes(host_keys(list(zip(one_host, srun)))) == [0, 1, 2, 2]
    # one host, one shared-memory group, two srun nodes: srun's nodes split it
    assert pack_nodes(host_keys(list(zip([("vm", 0)] * 4, srun)))) == [0, 0, 1, 1]
    # under mpirun every rank sees its daemon's SLURM_PROCID (0): not srun's placement
    assert srun_node(1, 4, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
                            "SLURM_NODEID": "0"}) is None
    assert srun_node(0, 4, {}) is None


def test_hier_cost_model():
    n, a_n, a_i, b_i, b_n = 64 << 20, 5e-6, 1e-6, 1e10, 1.25e8
    links = model.Links(a_i, b_i, a_n, b_n)
    fixed, intra, nic = model.hier_terms("allreduce", n, 2, 4, links)
    assert intra == pytest.approx(2 * 3 / 4 * n) and nic == n
    terms = lambda op, R, L: model.hier_terms(op, n, R, L, links)  # noqa: E731
    assert terms("allreduce", 3, 4)[2] == pytest.approx(2 * n)  # interior node
    assert terms("allreduce", 1, 4)[2] == 0.0  # one node: no network
    assert terms("reduce_scatter", 8, 4)[2] == pytest.approx(n)
    assert terms("allgather", 2, 4)[2] == pytest.approx(n / 2)
    assert terms("allreduce", 1, 1) == (0.0, 0.0, 0.0)
    # one round: every stage in a row (fold, hop, fold, hop, copy out); many: the busiest
    # resource per round after the first (a pipeline); checked against the throttle here:
    # 2 nodes x 2 ranks, mt3000 at time_scale 2400, 192 KiB 0.090 s and 1 MiB 0.193 s measured
    ts, k = 2400, 128 << 10
    slow = model.Links(1e-6 * ts, 2.56e10 / ts, 5e-6 * ts, 2.5e10 / ts)
    t = [model.alone(model.hier_terms("allreduce", nb, 2, 2, slow, k), slow)
         for nb in (192 << 10, 1 << 20)]
    assert t[0] == pytest.approx(0.097, rel=0.02) and t[1] == pytest.approx(0.194, rel=0.02)
    # on 2 nodes of 4, a slow network: the interface's n bytes and one round more (the flat
    # ring's busiest link carries 2 (p-1)/p n = 1.75 n)
    t = model.alone(model.hier_terms("allreduce", n, 2, 4, links), links)
    ring = algos.seconds("ring", "allreduce", n, 8, a_n, b_n)
    assert n / b_n < t < 1.05 * n / b_n and ring / t > 1.5
    assert model.hier_chunk_bytes(64 << 20, 4) == 4 << 20  # one node: big rounds
    assert model.hier_chunk_bytes(64 << 20, 4, nodes=2) == 256 << 10  # a short pipeline fill
    assert model.hier_chunk_bytes(100, 4) == 4096


def test_shared_slots_share_a_link_between_two_ranks():
    clock = [0.0]
    book = Slots()
    a, b = (Link(1e6, 0.0, chunk_bytes=1000, clock=lambda: clock[0], shared=book) for _ in "ab")
    ends = [lnk.reserve(1000, after=None) for lnk in (a, b, a, b)]
    assert ends == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3])  # one interface, taken in turn
    t = Levels.from_profile(type("P", (), dict(emulate=True, link_bandwidth=1e6, link_latency=0.0,
                                              time_scale=1.0, intra_bandwidth=None,
                                              intra_latency=None))())
    assert t.level(False).bandwidth == 1e6 and t.level(True).bandwidth == float("inf")
    assert t.intra.chunk_bytes == t.inter.chunk_bytes


# -- MPI ------------------------------------------------------------------------------------


def _check(comm, g, n, dtype, op="sum", seed=0):
    p, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(p, n, dtype, seed)
    ref = C.reference_allreduce(xs, "hier", op)
    buf = xs[r].copy()
    C.allreduce(buf, comm, "hier", op, group=g)
    assert np.array_equal(buf, ref), ("allreduce", n, dtype, op)
    assert len(set(comm.allgather(zlib.crc32(buf.view(np.uint8))))) == 1  # the same everywhere
    b = C.segments(n, p)
    buf = xs[r].copy()
    seg = C.reduce_scatter(buf, comm, op, algo="hier", group=g)
    assert np.array_equal(seg, ref[b[r]:b[r + 1]]), ("reduce_scatter", n, dtype, op)
    full = np.zeros(n, dtype)
    full[b[r]:b[r + 1]] = xs[r][b[r]:b[r + 1]]
    C.allgather(full, comm, algo="hier", group=g)
    want = np.concatenate([xs[q][b[q]:b[q + 1]] for q in range(p)])
    assert np.array_equal(full, want), ("allgather", n, dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("grouping", ["one node", "a node each", "pairs", "alternating", "uneven"])
def test_hier_equals_the_reference_for_every_grouping(size, grouping, mpi_group):
    comm = mpi_group(size)
    nodes = groupings(size)[grouping]
    for chunk, depth in ((4096, 2), (1 << 16, 3)):  # many rounds through a small window / few
        g = NodeGroup(comm, nodes, chunk, depth)
        try:
            for n in (1, 3, 7, 1000, 4099, 70001):
                for dtype in DTYPES:
                    _check(comm, g, n, dtype)
            _check(comm, g, 5000, np.float32, "max")
        finally:
            g.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_in_place_all_reduce_of_shared_arrays(size, mpi_group):
    """One node, buffers in shared memory (NodeGroup.shared_array): the in-place path gives the
    reference's bits, as the staged path does for the same group."""
    comm = mpi_group(size)
    g = NodeGroup(comm, [0] * size, 4096, 2)
    try:
        for n, dtype, op in ((1, np.float32, "sum"), (7, np.float64, "sum"),
                             (300001, np.float32, "sum"), (5003, np.float16, "sum"),
                             (4099, np.float32, "max")):
            xs = inputs(size, n, dtype, seed=n)
            ref = C.reference_allreduce(xs, "hier", op)
            buf = g.shared_array(n, dtype)
            assert g.shared_views(buf) is not None and g.shared_views(buf.copy()) is None
            buf[:] = xs[comm.Get_rank()]
            C.allreduce(buf, comm, "hier", op, group=g)
            assert np.array_equal(buf, ref), (n, dtype, op)
            buf[:] = xs[comm.Get_rank()]
            C.allreduce(buf, comm, "hier", op, group=g)  # reused: the same again
            assert np.array_equal(buf, ref), (n, dtype, op)
    finally:
        g.free()


@pytest.mark.mpi(min_size=4)
def test_packing_does_not_change_a_bit(mpi_group):
    comm = mpi_group(4)
    xs = inputs(4, 100003, np.float32, seed=3)
    outs = []
    for nodes in groupings(4).values():
        g = NodeGroup(comm, nodes, 8192, 3)
        buf = xs[comm.Get_rank()].copy()
        C.allreduce(buf, comm, "hier", group=g)
        g.free()
        outs.append(buf)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("placement", ["pp", "dp"])
@pytest.mark.parametrize("per_node", [None, 1, 2])
def test_topology_nodes_and_engine_collectives(placement, per_node, mpi_group):
    comm = mpi_group(4)
    topo = Topology(comm, 2, 2, placement, per_node, shm_bytes=1 << 16)
    try:
        r = comm.Get_rank()
        assert topo.world_rank(topo.stage, topo.replica) == r
        if per_node is not None:  # one host here: nodes of per_node consecutive ranks
            assert topo.node == r // per_node and topo.local_rank == r % per_node
            assert topo.describe() == f"{4 // per_node} nodes x {per_node} rank" + "s" * (per_node > 1)
        info = comm.allgather((topo.node, topo.local_rank))
        assert sorted(set(info)) == sorted(info)  # a rank's (node, local rank) is unique
        assert topo.group(topo.dp_comm) is topo.dp_group and topo.group(topo.pp_comm) is None
        xs = inputs(2, 3001, np.float32, seed=topo.stage)
        with CommEngine(topo, watchdog_s=60) as eng:
            buf = xs[topo.replica].copy()
            eng.allreduce(buf, topo.dp_comm).result()  # auto: hier on the topology's groups
            assert np.array_equal(buf, C.reference_allreduce(xs, "hier"))
            vec = np.zeros(4)
            vec[r] = r + 1.0
            eng.allreduce(vec, topo.comm).result()
            assert vec.tolist() == [1.0, 2.0, 3.0, 4.0]
    finally:
        topo.free()


@pytest.mark.mpi(min_size=4)
def test_hier_through_the_two_level_throttle(mpi_group):
    """Two nodes of two ranks, a slow shared interface: results exact, and the all-reduce never
    faster than the interface's bytes over its bandwidth (the lower bound cannot flake)."""
    comm = mpi_group(4)
    topo = Topology(comm, 1, 4, "pp", 2, shm_bytes=1 << 16)
    slots = None
    try:
        slots = SharedSlots(topo.node_comm)
        bw, n = 2e7, 100_000  # 20 MB/s per interface, 400 kB of fp32
        levels = Levels(Link(1e9, 0.0, chunk_bytes=16384), Link(bw, 1e-4, chunk_bytes=16384,
                                                                shared=slots))
        links = NodeLinks(levels, topo)
        xs = inputs(4, n, np.float32, seed=5)
        with CommEngine(topo, watchdog_s=60, link=links) as eng:
            buf = xs[topo.replica].copy()
            comm.Barrier()
            t0 = time.perf_counter()
            eng.allreduce(buf, topo.dp_comm).result()
            dt = time.perf_counter() - t0
        assert np.array_equal(buf, C.reference_allreduce(xs, "hier"))
        assert dt >= 4 * n / bw * 0.95  # the interface carries n elements of 4 bytes
    finally:
        if slots is not None:
            slots.free()
        topo.free()
