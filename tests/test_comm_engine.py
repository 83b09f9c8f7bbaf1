"""The communication engine: futures, errors surfacing, overlap, the watchdog."""

import time

import numpy as np
import pytest
from mpi4py import MPI

from ratrain.comm import collectives as C
from ratrain.comm.engine import CommEngine, CommTimeout, EngineClosed
from ratrain.shim.link import Link


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


# -- one process (COMM_SELF: messages to oneself) -------------------------------------------------


def test_results_and_errors_surface_in_the_caller():
    with CommEngine(MPI.COMM_SELF, watchdog_s=30) as eng:
        assert eng.submit(lambda a, b: a + b, 2, 3).result() == 5

        def bad():
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom") as e:
            eng.submit(bad, name="bad-op").result()
        assert any("bad-op #2" in n for n in e.value.__notes__)

        def bad_gen():
            yield [MPI.COMM_SELF.Isend(np.zeros(1), 0, 5), MPI.COMM_SELF.Irecv(np.zeros(1), 0, 5)]
            raise KeyError("late")

        with pytest.raises(KeyError, match="late"):
            eng.submit(bad_gen).result()
        assert eng.submit(lambda: "still fine").result() == "still fine"
    with pytest.raises(EngineClosed):
        eng.submit(lambda: 1).result()


def _overlapped_send_recv(link, n):
    """Best of 3 times of a throttled message to oneself while the caller sleeps as long."""
    x = np.arange(n // 4, dtype=np.float32)
    best = np.inf
    with CommEngine(MPI.COMM_SELF, watchdog_s=30, link=link) as eng:
        for _ in range(3):  # best of 3: the machine is shared
            out = np.empty_like(x)
            t0 = time.perf_counter()
            fr = eng.recv(out, 0, tag=3)
            fs = eng.send(x, 0, tag=3)
            time.sleep(link.message_time(n))  # the caller "computes" meanwhile
            fs.result()
            assert fr.result() is out
            best = min(best, time.perf_counter() - t0)
            assert np.array_equal(out, x)
    return best


def test_send_recv_to_self_through_the_throttle_never_beats_the_link():
    link = Link(1e9, 20e-6)
    n = 8 << 20  # 8.4 ms on the emulated wire
    assert _overlapped_send_recv(link, n) >= link.message_time(n)


@pytest.mark.timing
def test_send_recv_to_self_through_the_throttle_overlaps_with_the_caller():
    link = Link(1e9, 20e-6)
    n = 8 << 20
    best = _overlapped_send_recv(link, n)
    assert best < 1.5 * link.message_time(n) + 0.01, best  # overlapped, not sequential


def test_watchdog_names_the_operation_and_breaks_the_engine():
    eng = CommEngine(MPI.COMM_SELF.Dup(), watchdog_s=0.5)
    fut = eng.recv(np.zeros(4), 0, tag=99)  # nobody sends
    with pytest.raises(CommTimeout, match=r"recv\(from 0, tag 99, 32 B\) #1 did not finish"):
        fut.result(timeout=10)  # the bound: a watchdog that never fired raises TimeoutError
    with pytest.raises(EngineClosed, match="did not finish"):
        eng.submit(lambda: 1).result()
    eng.close(timeout=5)


# -- MPI -----------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_many_collectives_in_flight_at_once(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    with CommEngine(comm, watchdog_s=60) as eng:
        jobs = []
        for i, (n, algo) in enumerate([(5, "tree"), (10_000, "ring"), (1, "ring"), (777, "auto"),
                                       (100_003, "ring"), (64, "tree")]):
            xs = [np.random.default_rng(100 * i + q).standard_normal(n).astype(np.float32) for q in range(p)]
            x = xs[r].copy()
            jobs.append((eng.allreduce(x, comm, algo), x, xs, algo, n))
        for fut, x, xs, algo, n in jobs:
            assert fut.result() is x
            algo = C.choose_algo(x.nbytes, p) if algo == "auto" else algo
            assert x.tobytes() == C.reference_allreduce(xs, algo).tobytes(), (n, algo)
        y = np.zeros(p + 3, np.float64)
        b = C.segments(y.size, p)
        y[b[r]:b[r + 1]] = r + 1
        eng.allgather(y, comm).result()
        assert np.array_equal(y, np.repeat(np.arange(1.0, p + 1), np.diff(b)))
        z = np.full(3, float(r))
        eng.bcast(z, comm, root=p - 1).result()
        assert np.all(z == p - 1)
        w = np.full(2 * p, float(r), np.float32)
        seg = eng.reduce_scatter(w, comm).result()
        assert np.all(seg == sum(range(p)))


@pytest.mark.mpi(min_size=2)
def test_collective_and_messages_progress_together_through_the_link(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    link = Link(5e9, 5e-6, chunk_bytes=1 << 16)
    with CommEngine(comm, watchdog_s=60, link=link) as eng:
        g = np.full(300_000, float(r), np.float32)
        fa = eng.allreduce(g, comm, "ring")
        msg = np.full(50_000, float(r), np.float32)
        inbox = np.empty_like(msg)
        fr = eng.recv(inbox, (r - 1) % p, tag=1)
        fs = eng.send(msg, (r + 1) % p, tag=1)
        fs.result(), fr.result(), fa.result()
    assert np.all(g == sum(range(p))) and np.all(inbox == (r - 1) % p)


@pytest.mark.mpi(min_size=2)
def test_watchdog_fires_when_a_peer_never_joins():
    comm = MPI.COMM_WORLD.Dup()  # left with pending requests on rank 0: not reused
    if comm.Get_rank() == 0:
        eng = CommEngine(comm, watchdog_s=0.5)
        with pytest.raises(CommTimeout, match=r"rank 0: communication op allreduce\(ring.*#1"):
            eng.allreduce(np.ones(1000, np.float32), comm, "ring").result(timeout=10)
        eng.close(timeout=1)
    MPI.COMM_WORLD.Barrier()


def test_a_process_frozen_and_resumed_does_not_blame_its_peers():
    """SIGSTOP then SIGCONT (Open MPI resumes a stopped rank to kill it): the operations that
    waited through the freeze are timed anew, not failed at once with a CommTimeout blaming
    a slow peer; they still fail after comm.timeout of their own."""
    import os
    import signal
    import subprocess
    import sys

    def never():
        yield lambda: False

    eng = CommEngine(MPI.COMM_SELF, watchdog_s=3)
    try:
        fut = eng.submit(never, name="waits")
        time.sleep(0.5)
        # a helper resumes us in 4 s (longer than the timeout); then we stop ourselves
        subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep(4); "
                          f"os.kill({os.getpid()}, signal.SIGCONT)"])
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(1.5)  # resumed: past comm.timeout in wall time, not in time awake
        assert not fut.done()
        with pytest.raises(CommTimeout, match="waits"):
            fut.result(timeout=10)
    finally:
        eng.close(timeout=1)
