"""Ring / tree collectives on point-to-point: exact reduction orders, equal on every rank and run.

Single-process tests check the documented orders, the model and the helpers; the MPI tests run
under `mpirun -n K python -m pytest --with-mpi tests/test_comm_*.py` for any K >= 2.
"""

import time
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from ratrain.comm import collectives as C
from ratrain.comm import algos
from ratrain.comm.bench import pattern
from ratrain.shim.ledger import Ledger
from ratrain.shim.link import Link

LENGTHS = [1, 2, 3, 5, 7, 13, 64, 1000, 4099, 65537]  # includes primes and n < ranks
TOL = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


def inputs(p, n, dtype, seed=0):
    """Every rank's input, the same in every process."""
    return [np.random.default_rng(seed * 1000 + q).standard_normal(n).astype(dtype) for q in range(p)]


def same_on_all_ranks(comm, arr) -> bool:
    digests = comm.allgather(zlib.crc32(np.ascontiguousarray(arr).view(np.uint8)))
    return len(set(digests)) == 1


# -- single process: orders, model, helpers -------------------------------------------------------


def test_segments_cover_any_length():
    for n in (0, 1, 5, 7, 100):
        for p in (1, 2, 3, 8):
            b = C.segments(n, p)
            assert b[0] == 0 and b[-1] == n and len(b) == p + 1
            sizes = np.diff(b)
            assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1


@pytest.mark.parametrize("algo", ["ring", "tree"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_reference_orders_match_a_float64_sum(algo, p):
    xs = inputs(p, 1001, np.float32)
    ref = C.reference_allreduce(xs, algo)
    assert ref.dtype == np.float32
    np.testing.assert_allclose(ref, np.sum(np.array(xs, np.float64), 0), rtol=1e-5, atol=1e-5)


def test_reference_ring_order_is_the_documented_fold():
    # segment q is x[q+1] + x[q+2] + ... + x[q] (left fold): visible with non-associative values
    p, n = 3, 3
    xs = [np.full(n, v, np.float32) for v in (1e8, 1.0, -1e8)]
    out = C.reference_allreduce(xs, "ring")
    b = C.segments(n, p)
    for q in range(p):
        acc = np.float32(xs[(q + 1) % p][0])
        for j in range(2, p + 1):
            acc = np.float32(acc + xs[(q + j) % p][0])
        assert np.all(out[b[q]:b[q + 1]] == acc)


def test_model_and_auto_choice():
    a, bw = 20e-6, 1e9
    assert algos.seconds("ring", "allreduce", 64 << 20, 4, a, bw) == pytest.approx(
        6 * (a + (16 << 20) / bw))
    assert algos.seconds("tree", "allreduce", 8, 4, a, bw) == pytest.approx(2 * (a + 8 / bw))
    assert algos.seconds("tree", "allreduce", 8, 5, a, bw) == pytest.approx(4 * (a + 8 / bw))
    assert algos.seconds("ring", "reduce_scatter", 64 << 20, 4, a, bw) == pytest.approx(
        3 * (a + (16 << 20) / bw))
    assert C.choose_algo(8, 8) == "tree"
    assert C.choose_algo(64 << 20, 8) == "ring"
    # p=2: same bytes, fewer steps
    assert algos.choose("allreduce", 64 << 20, 2, grouped=False, latency=a, bandwidth=bw) == "tree"
    link = Link(1e9, 1e-3)  # very slow latency: tree up to larger sizes
    assert C.choose_algo(1 << 20, 8, link) == "tree"


def test_single_rank_and_bad_input():
    c = MPI.COMM_SELF
    x = np.arange(5, dtype=np.float32)
    for algo in ("ring", "tree", "mpi", "auto"):
        assert np.array_equal(C.allreduce(x.copy(), c, algo), x)
    with pytest.raises(ValueError, match="C-contiguous"):
        C.allreduce(np.zeros((4, 4), np.float32)[:, 1], c, "ring")
    with pytest.raises(ValueError, match="algo='nope'"):
        C.allreduce(x, c, "nope")
    with pytest.raises(ValueError, match="op="):
        C.allreduce(x, c, "ring", op="prod")


# -- MPI -----------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["ring", "tree"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_allreduce_exact_order_identical_everywhere_and_rerun(comm, algo, dtype):
    p, r = comm.Get_size(), comm.Get_rank()
    for n in LENGTHS:
        xs = inputs(p, n, dtype, seed=n)
        x = xs[r].copy()
        assert C.allreduce(x, comm, algo) is x
        ref = C.reference_allreduce(xs, algo)
        assert x.tobytes() == ref.tobytes(), f"n={n}: not the documented {algo} order"
        np.testing.assert_allclose(x.astype(np.float64), np.sum(np.array(xs, np.float64), 0),
                                   rtol=TOL[dtype], atol=TOL[dtype] * p)
        assert same_on_all_ranks(comm, x)
        again = xs[r].copy()
        C.allreduce(again, comm, algo)
        assert again.tobytes() == x.tobytes()


@pytest.mark.mpi(min_size=2)
def test_shapes_auto_mpi_and_ops(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(p, 6 * 7, np.float32, seed=3)
    x = xs[r].reshape(6, 7).copy()
    C.allreduce(x, comm)  # auto
    algo = C.choose_algo(x.nbytes, p)
    assert x.tobytes() == C.reference_allreduce(xs, algo).tobytes()
    y = xs[r].copy()
    C.allreduce(y, comm, "mpi")
    np.testing.assert_allclose(y, x.reshape(-1), rtol=1e-5, atol=1e-5)
    for op, f in (("max", np.max), ("min", np.min)):
        for algo in ("ring", "tree"):
            z = xs[r].copy()
            C.allreduce(z, comm, algo, op=op)
            assert np.array_equal(z, f(np.array(xs), 0))


@pytest.mark.mpi(min_size=2)
def test_large_and_prime_lengths_exact(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    for n, dtype, algo in ((10**7, np.float32, "ring"), (1_000_003, np.float16, "ring"),
                           (100_003, np.float32, "tree")):
        x = pattern(r, n, dtype)  # small integers: every order gives the exact sum
        C.allreduce(x, comm, algo)
        want = sum(pattern(q, n, np.float64) for q in range(p))
        assert np.array_equal(x.astype(np.float64), want), (n, dtype, algo)
        assert same_on_all_ranks(comm, x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_reduce_scatter_allgather_bcast(comm, dtype):
    p, r = comm.Get_size(), comm.Get_rank()
    for n in (1, 3, p + 1, 1000, 4099):
        xs = inputs(p, n, dtype, seed=7 + n)
        b = C.segments(n, p)
        seg = C.reduce_scatter(xs[r].copy(), comm)
        assert seg.tobytes() == C.reference_allreduce(xs, "ring")[b[r]:b[r + 1]].tobytes()
        ag = np.zeros(n, dtype)
        ag[b[r]:b[r + 1]] = xs[r][b[r]:b[r + 1]]
        C.allgather(ag, comm)
        assert ag.tobytes() == np.concatenate([xs[q][b[q]:b[q + 1]] for q in range(p)]).tobytes()
        for root in {0, p - 1, 1 % p}:
            bc = xs[r].copy()
            C.bcast(bc, comm, root)
            assert bc.tobytes() == xs[root].tobytes()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["ring", "tree"])
def test_throttled_and_ledger_accounted_runs_give_the_same_bits(comm, algo):
    p, r = comm.Get_size(), comm.Get_rank()
    link = Link(2e10, 1e-6, chunk_bytes=4096)  # fast, but many chunks per message
    ledger = Ledger(rank=r)
    for n, dtype in ((3, np.float32), (5000, np.float32), (5001, np.float16)):
        xs = inputs(p, n, dtype, seed=11)
        x = xs[r].copy()
        C.allreduce(x, comm, algo, link=link, ledger=ledger)
        assert x.tobytes() == C.reference_allreduce(xs, algo).tobytes()
        assert ledger.current == 0  # scratch freed
    tags = ledger.peak_by_tag()
    assert any(t.startswith("comm.") for t in tags)
    if algo == "ring":
        assert tags["comm.ring"] == 2 * -(-5001 // p) * 4  # two float32 segments (pipelined)
        assert tags["comm.ring.fp32"] == 5001 * 4
    assert link.bytes_sent > 0


@pytest.mark.mpi(min_size=2)
def test_pipelined_ring_matches_the_reference_on_awkward_sizes(comm):
    """The throttled ring runs its steps pipelined by chunks: tiny chunks (many per step, steps
    overlapping), fewer elements than ranks (empty segments), uneven segments, fp16."""
    p, r = comm.Get_size(), comm.Get_rank()
    link = Link(5e10, 0.0, chunk_bytes=64)
    for n, dtype in ((1, np.float32), (2, np.float32), (7, np.float16), (97, np.float32),
                     (1031, np.float16), (4099, np.float64)):
        xs = inputs(p, n, dtype, seed=n)
        x = xs[r].copy()
        C.allreduce(x, comm, "ring", link=link)
        assert x.tobytes() == C.reference_allreduce(xs, "ring").tobytes(), (n, dtype)


def _throttled_ring(mpi_group, runs=3):
    """Throttled float32 ring all-reduces of two chunks per segment on every rank of the world:
    ([seconds from a barrier to the end of each run], the link, elements); checks the bits."""
    comm = mpi_group(MPI.COMM_WORLD.Get_size())
    p, r = comm.Get_size(), comm.Get_rank()
    c = 1 << 16
    link = Link(1e8, 1e-3, chunk_bytes=c)  # 0.66 ms per chunk, 1 ms latency: far slower than the host
    n = 2 * c // 4 * p
    xs = inputs(p, n, np.float32, seed=5)
    took = []
    for _ in range(runs):
        x = xs[r].copy()
        comm.Barrier()
        t0 = time.perf_counter()
        C.allreduce(x, comm, "ring", link=link)
        took.append(time.perf_counter() - t0)
        comm.Barrier()
        assert x.tobytes() == C.reference_allreduce(xs, "ring").tobytes()
    return took, link, n


@pytest.mark.mpi(min_size=2)
def test_throttled_ring_ends_no_sooner_than_its_link_allows(mpi_group):
    """The pipelined ring hands its last chunk to MPI when that chunk's slot starts (the copy
    overlaps the slot) and ends on a zero-byte marker when the slot ends: no rank finishes
    before its link has carried its 2(p-1) messages back to back after one latency."""
    took, link, n = _throttled_ring(mpi_group)
    p = MPI.COMM_WORLD.Get_size()
    floor = link.latency + 2 * (p - 1) * link.transfer_time(n * 4 // p)
    assert min(took) >= floor, (took, floor)


@pytest.mark.timing
@pytest.mark.mpi(min_size=2)
def test_throttled_ring_keeps_to_its_link(mpi_group):
    """... and not much later (the best of 4 runs after a first): the reduction overlaps the
    next chunk's slot and the end needs no copy after the last slot."""
    took, link, n = _throttled_ring(mpi_group, runs=5)
    p = MPI.COMM_WORLD.Get_size()
    floor = link.latency + 2 * (p - 1) * link.transfer_time(n * 4 // p)
    assert min(took[1:]) <= 1.1 * floor + 2e-3, (took, floor)
