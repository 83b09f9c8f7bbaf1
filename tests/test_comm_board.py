"""The reduce board (`comm.board`): small all-reduces of a one-node communicator through shared
memory, bitwise the tree's documented order (`collectives.reference_allreduce(xs, "tree")`).

Single-process tests run the compiled round on planted counters and slots (every rank count,
op and dtype, special values); the MPI tests run the blocking call, the engine's operations in
flight together, the messages beside it, and the board's life with its communicator.
"""

import zlib

import numpy as np
import pytest
from mpi4py import MPI

from ratrain.comm import board
from ratrain.comm import collectives as C
from ratrain.comm.engine import CommEngine
from tests._prereq import missing


@pytest.fixture(autouse=True)
def _board_on():
    """The board is off by default (RATRAIN_BOARD=1 turns it on): these tests turn it on."""
    if not board.available():
        missing(board.why_off())  # a failure under CI when numba is missing
    with board.forced():
        yield


DTYPES = [np.float32, np.float64, np.int32, np.int64]
OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


def inputs(p, n, dtype, seed=0):
    """Every rank's input, the same in every process; floats with NaNs, infinities, signed
    zeros and subnormals among them (max/min pick among them in the tree's order)."""
    out = []
    for q in range(p):
        rng = np.random.default_rng(seed * 1000 + q)
        if np.dtype(dtype).kind == "f":
            x = rng.standard_normal(n).astype(dtype)
            special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-310, -1e-40],
                               dtype)
            k = min(n, 3)
            x[rng.integers(0, n, k)] = rng.choice(special, k)
        else:
            info = np.iinfo(dtype)  # the whole range: sums wrap, as numpy's do
            x = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        out.append(x)
    return out


def digest(a) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8))


# -- one process: the compiled round on planted boards --------------------------------------------


def planted(xs, t, rank=0):
    """Counters and slots as p ranks would leave them having posted round t (rank `rank` not
    yet: the round posts its own x)."""
    p, n = len(xs), xs[0].size
    counters = np.zeros(p * board.LINE // 8, np.int64)[:: board.LINE // 8]
    counters[:] = t
    counters[rank] = t - 1
    slots = np.zeros((p, 2, n + 3), xs[0].dtype)
    for q, x in enumerate(xs):
        slots[q, t & 1, :n] = x
    return counters, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_the_round_folds_in_the_tree_order(dtype, op):
    for p in range(1, 10):
        for n in (1, 2, 7, 33):
            xs = inputs(p, n, dtype, seed=p * 100 + n)
            for t in (1, 2, 7):
                counters, slots = planted(xs, t, rank=p - 1)
                x = xs[p - 1].copy()
                slots[p - 1, t & 1, :n] = 0  # the round writes it
                with np.errstate(all="ignore"):
                    rnd = board._kernel().run_round
                    assert rnd(counters, slots, p - 1, t, x, board.OPCODES[OPS[op]], True, 0)
                    ref = C.reference_allreduce(xs, "tree", op=op)
                assert x.tobytes() == ref.tobytes(), (p, n, t)
                assert counters[p - 1] == t  # posted
                assert np.array_equal(slots[p - 1, t & 1, :n].view(np.uint8), xs[p - 1].view(np.uint8))


def test_the_round_waits_for_every_post_and_reports_when_its_spins_run_out():
    xs = inputs(3, 4, np.float32)
    counters, slots = planted(xs, 5, rank=0)
    counters[2] = 4  # rank 2 has not posted round 5
    x = xs[0].copy()
    assert not board._kernel().run_round(counters, slots, 0, 5, x, 0, True, 0)
    assert not board._kernel().run_round(counters, slots, 0, 5, x, 0, False, 10)
    assert x.tobytes() == xs[0].tobytes() and counters[0] == 5  # posted, nothing folded
    counters[2] = 5
    assert board._kernel().run_round(counters, slots, 0, 5, x, 0, False, 0)
    assert x.tobytes() == C.reference_allreduce(xs, "tree").tobytes()


def test_what_fits():
    x = np.zeros(board.BOARD_BYTES // 4, np.float32)
    assert board.fits(x, np.add) == 0 and board.fits(x, np.minimum) == 2
    assert board.fits(np.zeros(x.size + 1, np.float32), np.add) is None  # too large
    assert board.fits(np.zeros(4, np.float16), np.add) is None  # partials in float32: messages
    assert board.fits(np.zeros((4, 4), np.float32)[:, 0], np.add) is None  # not contiguous
    with board.disabled():  # what fits never depends on this rank's switch ...
        assert board.fits(x, np.add) == 0 and not board.enabled()
        assert not board.usable(object())  # ... whether a board takes the call does
    assert board.enabled() and board.usable(object()) and not board.usable(None)


def test_a_rank_of_its_own_has_no_board():
    assert board.attach(MPI.COMM_SELF) is None
    x = np.ones(3, np.float32)
    assert C.allreduce(x, MPI.COMM_SELF, "tree") is x and np.array_equal(x, np.ones(3))


# -- MPI -----------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_blocking_all_reduce_is_the_tree_order_on_every_rank(comm, dtype):
    p, r = comm.Get_size(), comm.Get_rank()
    for op in OPS:
        for n in (1, 2, 5, 1000, board.BOARD_BYTES // np.dtype(dtype).itemsize):
            xs = inputs(p, n, dtype, seed=n)
            x = xs[r].copy()
            with np.errstate(all="ignore"):
                assert C.allreduce(x, comm, "tree", op=op) is x
                ref = C.reference_allreduce(xs, "tree", op=op)
            assert x.tobytes() == ref.tobytes(), (op, n)
            assert len(set(comm.allgather(digest(x)))) == 1
    assert board.board_of(comm) is not None  # every one of them took the board


@pytest.mark.mpi(min_size=2)
def test_board_and_messages_give_the_same_bits(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    for n in (1, 3, 64, 4099):
        xs = inputs(p, n, np.float32, seed=3 + n)
        a, b = xs[r].copy(), xs[r].copy()
        C.allreduce(a, comm, "tree")
        with board.disabled():
            C.allreduce(b, comm, "tree")
        assert a.tobytes() == b.tobytes()
    # shapes, a ufunc or MPI op, and the sizes that do not fit, all in one go
    big = inputs(p, board.BOARD_BYTES // 4 + 1, np.float32, seed=9)
    for x, op in ((xs[r].reshape(1, -1).copy(), np.add), (xs[r].copy(), MPI.SUM),
                  (big[r].copy(), "sum"), (xs[r].astype(np.float16), "sum")):
        want = C.reference_allreduce([y.astype(x.dtype).reshape(x.shape)
                                      for y in (big if x.size == big[0].size else xs)], "tree")
        C.allreduce(x, comm, "tree", op=op)
        assert x.tobytes() == want.tobytes()


@pytest.mark.mpi(min_size=2)
def test_engine_operations_in_flight_together_take_their_rounds_in_order(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    assert board.attach(comm) is not None
    xss = [inputs(p, n, np.float32, seed=40 + n) for n in (1, 2, 3, 17, 1000, 5, 2, 8)]
    with CommEngine(comm, watchdog_s=60) as eng:
        for _ in range(3):
            bufs = [xs[r].copy() for xs in xss]
            futs = [eng.allreduce(x, comm, "tree") for x in bufs]
            for f in futs:
                f.result()
            for x, xs in zip(bufs, xss):
                assert x.tobytes() == C.reference_allreduce(xs, "tree").tobytes()
            y = xss[3][r].copy()
            C.allreduce(y, comm, "tree")  # a blocking round after the engine's
            assert y.tobytes() == C.reference_allreduce(xss[3], "tree").tobytes()


@pytest.mark.mpi(min_size=2)
def test_the_board_lives_and_dies_with_its_communicator():
    c = MPI.COMM_WORLD.Dup()
    b = board.attach(c)
    assert b is not None and board.attach(c) is b and board.board_of(c) is b
    assert b.nbytes == c.Get_size() * (board.LINE + 2 * board.BOARD_BYTES)
    x = np.full(4, c.Get_rank() + 1.0)
    assert board.allreduce(x, c, "sum")
    assert np.array_equal(x, np.full(4, c.Get_size() * (c.Get_size() + 1) / 2))
    assert not board.allreduce(np.zeros(4, np.float16), c, "sum")  # does not fit: the caller's
    key = id(c)
    c.Free()
    assert key not in board._BOARDS


@pytest.mark.mpi(min_size=2)
def test_a_late_rank_is_waited_for_past_the_spins(comm):
    import time

    p, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(p, 5, np.float64, seed=77)
    for late in range(p):
        x = xs[r].copy()
        if r == late:
            time.sleep(0.05)  # far past the kernel's spins: the others poll from Python
        C.allreduce(x, comm, "tree")
        assert x.tobytes() == C.reference_allreduce(xs, "tree").tobytes()
    with CommEngine(comm, watchdog_s=60) as eng:
        board.attach(comm)
        x = xs[r].copy()
        if r == 0:
            time.sleep(0.05)
        eng.allreduce(x, comm, "tree").result()
        assert x.tobytes() == C.reference_allreduce(xs, "tree").tobytes()


@pytest.mark.mpi(min_size=2)
def test_a_rank_with_the_path_off_leaves_every_rank_on_the_messages():
    c = MPI.COMM_WORLD.Dup()
    p, r = c.Get_size(), c.Get_rank()
    xs = inputs(p, 7, np.float32, seed=5)
    x = xs[r].copy()
    if r == p - 1:
        with board.disabled():  # as RATRAIN_FUSED=0 or no numba on one rank would
            C.allreduce(x, c, "tree")
    else:
        C.allreduce(x, c, "tree")
    assert x.tobytes() == C.reference_allreduce(xs, "tree").tobytes()
    assert board.board_of(c) is None  # agreed on every rank: no board
    c.Free()


@pytest.mark.mpi(min_size=2)
@np.errstate(all="ignore")  # the inputs hold infinities of both signs
def test_the_default_algo_takes_the_board_where_the_model_picks_the_tree(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(p, 3, np.float32, seed=11)
    assert C.choose_algo(xs[0].nbytes, p) == "tree"
    b = board.attach(comm)
    x = xs[r].copy()
    before = b.done
    C.allreduce(x, comm)  # algo="auto"
    assert b.done == before + 1 and x.tobytes() == C.reference_allreduce(xs, "tree").tobytes()
    big = inputs(p, 1 << 20, np.float32, seed=12)  # the model picks the ring: no board round
    x = big[r].copy()
    C.allreduce(x, comm)
    assert b.done == before + 1
    assert x.tobytes() == C.reference_allreduce(big, C.choose_algo(x.nbytes, p)).tobytes()


@pytest.mark.mpi(min_size=2)
def test_the_fast_path_refuses_what_its_kernel_was_not_built_for_and_forgets_freed_boards():
    for _ in range(2):  # a second communicator may get the first one's id: never its plans
        c = MPI.COMM_WORLD.Dup()
        p, r = c.Get_size(), c.Get_rank()
        xs = inputs(p, 4, np.float32, seed=21)
        x = xs[r].copy()
        C.allreduce(x, c, "tree")  # makes the board
        want = C.reference_allreduce(xs, "tree").tobytes()
        assert x.tobytes() == want
        raw = bytearray(4 * 4 + 1)
        odd = np.frombuffer(raw, np.float32, count=4, offset=1)  # unaligned
        assert not odd.flags.aligned
        odd[:] = xs[r]
        assert not board.allreduce(odd, c, "sum")  # not the compiled kernel's kind of array
        C.allreduce(odd, c, "tree")  # the other way: the board, through numba's dispatcher
        assert odd.tobytes() == want
        y = xs[r].copy()
        assert board.allreduce(y, c, "sum") and y.tobytes() == want
        c.Free()
        assert not [k for k in board._PLANS if k[0] == id(c)]


def test_a_blocking_wait_is_bounded():
    from ratrain.comm.progress import wait_for

    with pytest.raises(TimeoutError, match="board round 7 did not finish within comm.timeout=0.05 s"):
        wait_for(lambda: False, 0.05, "board round 7")
    wait_for(lambda: True, 0.0)  # a condition already true never times out


@pytest.mark.mpi(min_size=2)
def test_a_blocking_round_without_its_peers_fails_after_the_limit(comm, monkeypatch):
    """A peer that never posts (stopped, or skipped the call) ends the wait with an error
    naming the round, as the engine's operations do after comm.timeout, never a hang."""
    assert board.attach(comm) is not None
    monkeypatch.setattr(board, "WAIT_S", 0.3)
    if comm.Get_rank() == 0:
        with pytest.raises(TimeoutError, match="rank 0: board all-reduce round 1 did not finish"):
            C.allreduce(np.ones(4), comm, "tree")
    comm.Barrier()
    CommEngine(comm, watchdog_s=7).close()
    assert board.WAIT_S == 7  # the engine bounds blocking rounds by its comm.timeout
