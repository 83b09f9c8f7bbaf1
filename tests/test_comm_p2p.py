"""Topology and the pipeline's point-to-point verbs."""

import time

import numpy as np
import pytest
from mpi4py import MPI

from ratrain.comm import wire
from ratrain.comm.engine import CommEngine
from ratrain.comm.p2p import P2P
from ratrain.comm.topology import Topology, coords, grid
from ratrain.shim.ledger import Ledger
from ratrain.shim.link import Link


def test_grid_layout():
    g = grid(pp=3, dp=2)
    assert g.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert coords(4, pp=3) == (1, 1)


def test_topology_asserts_say_what_is_wrong():
    with pytest.raises(AssertionError, match=r"world size 1 != pp x dp = 2 x 1"):
        Topology(MPI.COMM_SELF, 2, 1)
    with pytest.raises(AssertionError, match="pp must be a positive integer"):
        Topology(MPI.COMM_SELF, 0, 1)


def test_single_stage_verbs_are_no_ops():
    topo = Topology(MPI.COMM_SELF, 1, 1)
    p2p = P2P(topo)
    assert topo.is_first and topo.is_last and topo.prev_rank is None and topo.next_rank is None
    assert p2p.send_forward(np.zeros(3)) is None and p2p.recv_forward((3,), np.float32) is None
    assert p2p.send_backward(np.zeros(3)) is None and p2p.recv_backward((3,), np.float32) is None
    with CommEngine(topo, watchdog_s=10) as eng:
        p2p = P2P(topo, engine=eng)
        assert p2p.isend_forward(np.zeros(1)).result() is None
        assert p2p.irecv_backward(out=np.zeros(1)).result() is None
    topo.free()


def layouts(world):
    out = [(world, 1), (1, world)]
    if world % 2 == 0 and world > 2:
        out.append((2, world // 2))
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["blocking", "engine", "engine+link"])
def test_forward_and_backward_chains(mode):
    world = MPI.COMM_WORLD.Get_size()
    for pp, dp in layouts(world):
        topo = Topology(MPI.COMM_WORLD, pp, dp)
        assert topo.world_rank(topo.stage, topo.replica) == MPI.COMM_WORLD.Get_rank()
        assert topo.pp_comm.Get_size() == pp and topo.dp_comm.Get_size() == dp
        eng = None
        if mode != "blocking":
            eng = CommEngine(topo, watchdog_s=60,
                             link=Link(1e10, 1e-6, chunk_bytes=1024) if "link" in mode else None)
        ledger = Ledger(rank=topo.rank)
        p2p = P2P(topo, engine=eng, ledger=ledger)
        shape = (3, 1001)
        # forward: stage 0 starts with its replica id, each stage adds 1
        for mb in range(3):
            x = np.full(shape, float(topo.replica * 100 + mb), np.float32)
            if not topo.is_first:
                x = p2p.recv_forward(shape, np.float32)
                assert ledger.in_use("comm.recv_forward") == x.nbytes
            y = x + 1
            p2p.send_forward(y)
            if not topo.is_first:
                ledger.free(x)
            if topo.is_last:
                assert np.all(y == topo.replica * 100 + mb + pp)
        # backward, non-blocking when an engine is there
        buf = np.empty(shape, np.float16)
        dy = np.full(shape, 1.0, np.float16)
        if not topo.is_last:
            dy = (p2p.irecv_backward(out=buf).result() if eng else p2p.recv_backward(out=buf))
            assert dy is buf
        if eng:
            p2p.isend_backward(dy * 2).result()
        else:
            p2p.send_backward(dy * 2)
        if topo.is_first:
            assert np.all(dy == 2.0 ** (pp - 1))
        if eng:
            eng.close()
        topo.free()


@pytest.mark.mpi(min_size=2)
def test_log_messages_switch(capfd):
    topo = Topology(MPI.COMM_WORLD, MPI.COMM_WORLD.Get_size(), 1)
    p2p = P2P(topo)
    wire.log_messages(True)
    try:
        if not topo.is_first:
            p2p.recv_forward((4,), np.float64)
        p2p.send_forward(np.zeros(4))
    finally:
        wire.log_messages(False)
        topo.free()
    err = capfd.readouterr().err
    r = MPI.COMM_WORLD.Get_rank()
    if not topo.is_last:
        assert f"rank {r} send_forward peer={topo.stage + 1} tag=1 bytes=32" in err
    if not topo.is_first:
        assert f"rank {r} recv_forward peer={topo.stage - 1} tag=1 bytes=32" in err


@pytest.mark.mpi(min_size=2)
def test_throttled_messages_arrive_whole_in_order_and_never_early():
    """The last chunk of a throttled message goes out at its slot's start and a zero-byte end
    marker at its end: messages of every size still arrive intact and in order, and none
    completes before latency + bytes / bandwidth."""
    from ratrain.comm.progress import run

    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    link = Link(1e8, 1e-3, chunk_bytes=4096)  # 100 MB/s, 1 ms: far slower than the host
    sizes = [0, 5, 4096, 70_001]
    if r == 0:
        for n in sizes:
            run(wire.send_op(np.arange(n, dtype=np.uint8), 1, 3, comm, link), 2e-5)
    elif r == 1:
        for n in sizes:
            out = np.zeros(n, np.uint8)
            run(wire.recv_op(out, 0, 3, comm, link), 2e-5)
            assert np.array_equal(out, np.arange(n, dtype=np.uint8))
    comm.Barrier()
    n = 200_000
    model = link.message_time(n)
    # the ranks share one host (mpirun here), so time.perf_counter (CLOCK_MONOTONIC) is one
    # clock for both: the sender says when it posted, the receiver when the message completed
    if r == 0:
        t0 = time.perf_counter()
        run(wire.send_op(np.ones(n, np.uint8), 1, 4, comm, link), 2e-5)
        comm.send(t0, 1, 5)
    elif r == 1:
        out = np.zeros(n, np.uint8)
        run(wire.recv_op(out, 0, 4, comm, link), 2e-5)
        took = time.perf_counter() - comm.recv(source=0, tag=5)
        assert out.all()
        assert took >= model, (took, model)  # unthrottled it would take ~0.1 ms


def test_a_deadline_is_never_met_early():
    from ratrain.comm.progress import Deadline, sleep_until

    for dt in (0.0, 5e-5, 3e-4, 2e-3):
        t = Deadline(time.perf_counter() + dt)
        sleep_until(t)
        assert time.perf_counter() >= t
