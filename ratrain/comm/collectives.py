"""Collectives written on point-to-point only: ring and tree all-reduce, reduce-scatter, all-gather,
broadcast. MPI's own collectives appear here only as the `algo="mpi"` reference for tests and the
benchmark; the runtime never uses them.

All operate in place on C-contiguous numpy arrays of any shape and length, on any number of
ranks. float16 payloads are reduced in float32 (the partial sums travel as float32) and rounded
to float16 once, at the end. The reduction order is fixed, so every rank ends with bitwise the
same result and a rerun gives bitwise the same result again:

ring  (reduce-scatter then all-gather; bandwidth-optimal, 2(p-1) steps)
    The flat buffer of n elements is cut into p segments, segment q = [q*n//p, (q+1)*n//p).
    Segment q is reduced as a left fold over the ranks q+1, q+2, ..., p-1, 0, ..., q
    (x[q+1] + x[q+2] + ... + x[q]), ending on rank q, which then passes it round the ring.
tree  (recursive doubling, i.e. a binomial tree rooted at every rank; log2(p) steps)
    With m = the largest power of two <= p, rank i < p - m first adds rank i + m's data
    (y[i] = x[i] + x[i+m]), then the m ranks sum pairwise over rank order:
    ((y0 + y1) + (y2 + y3)) + ((y4 + y5) + (y6 + y7)) ... (both partners compute the same sum:
    IEEE addition is commutative), and ranks >= m receive the result from rank i - m.
auto  the cheaper of the two under the latency-bandwidth model (`choose_algo`); the choice depends
    only on (bytes, ranks, model), so it is the same on every rank and in every run.

`reference_allreduce(arrays, algo)` computes either order in one process; tests check the MPI
versions against it bitwise.

    allreduce(grad, dp_comm)                        # in place, algo="auto"
    seg = reduce_scatter(buf, comm)                 # view of this rank's reduced segment
    allgather(buf, comm)                            # every rank's segment to every rank
    bcast(buf, comm, root=0)
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from .progress import run as _run
from .wire import LOG_MESSAGES, exchange_op, recv_op, send_op

ALGOS = ("ring", "tree", "auto", "mpi")
COLL_TAG = 30000  # tag of blocking collectives; the engine gives each op its own tag

# Latency-bandwidth model of this host's MPI for `auto` when no link is throttled: measured
# here (2 cores, Open MPI 5 shared memory, 4 ranks): ~20 us per message, ~2 GB/s per stream.
HOST_LATENCY = 20e-6
HOST_BANDWIDTH = 2e9
LINK_POLL_S = 2e-5  # with the throttle on, test requests this often instead of spinning in MPI

_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def _ufunc(op):
    if isinstance(op, str):
        if op not in _OPS:
            raise ValueError(f"op={op!r} is not one of {', '.join(_OPS)}")
        return _OPS[op]
    for name, mpi_op in (("sum", MPI.SUM), ("max", MPI.MAX), ("min", MPI.MIN)):
        if op == mpi_op:
            return _OPS[name]
    if op in _OPS.values():
        return op
    raise ValueError(f"op={op!r}: use 'sum', 'max' or 'min'")


def segments(n: int, p: int) -> list[int]:
    """Bounds of the p segments of n elements: segment q = [b[q], b[q+1]), sizes differ by <= 1."""
    return [q * n // p for q in range(p + 1)]


def work_dtype(dtype) -> np.dtype:
    """The dtype partial results are kept in: float32 for float16, else the payload's own."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def run(op, link=None):
    """Drive a collective in this thread; with a link, poll instead of spinning in MPI."""
    return _run(op, LINK_POLL_S if link is not None else None)


def _flat(buf: np.ndarray) -> np.ndarray:
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"collectives work on numpy arrays, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(f"collective buffer must be C-contiguous (shape {buf.shape}, strides {buf.strides})")
    return buf.reshape(-1)


@contextmanager
def _scratch(ledger, tag: str, n: int, dtype):
    """A temporary array, accounted in the DDR ledger when one is given."""
    arr = ledger.alloc(tag, (n,), dtype, zero=False) if ledger is not None else np.empty(n, dtype)
    try:
        yield arr
    finally:
        if ledger is not None:
            ledger.free(arr)


# --------------------------------------------------------------------------------------------
# The latency-bandwidth model
# --------------------------------------------------------------------------------------------


def model_time(algo: str, nbytes: int, p: int, latency: float, bandwidth: float) -> float:
    """Predicted all-reduce time: ring 2(p-1)(a + n/(pB)); tree (log2 m + 2 [p > m])(a + n/B)."""
    if p == 1:
        return 0.0
    if algo == "ring":
        return 2 * (p - 1) * (latency + nbytes / (p * bandwidth))
    m = 1 << (p.bit_length() - 1)
    steps = int(math.log2(m)) + (2 if p > m else 0)
    return steps * (latency + nbytes / bandwidth)


def choose_algo(nbytes: int, p: int, link=None, latency: float | None = None,
                bandwidth: float | None = None) -> str:
    """`ring` or `tree`, whichever the latency-bandwidth model says is faster."""
    if link is not None:
        latency, bandwidth = link.latency * link.time_scale, link.bandwidth / link.time_scale
    a = HOST_LATENCY if latency is None else latency
    b = HOST_BANDWIDTH if bandwidth is None else bandwidth
    ring, tree = model_time("ring", nbytes, p, a, b), model_time("tree", nbytes, p, a, b)
    return "tree" if tree <= ring else "ring"


# --------------------------------------------------------------------------------------------
# Ring: reduce-scatter + all-gather
# --------------------------------------------------------------------------------------------


def ring_reduce_scatter_op(w, comm, ufunc, tag, link=None, ledger=None):
    """Reduce-scatter the flat array `w` in place: rank r ends with segment r reduced."""
    p, r = comm.Get_size(), comm.Get_rank()
    b = segments(w.size, p)
    nxt, prv = (r + 1) % p, (r - 1) % p
    with _scratch(ledger, "comm.ring", b[1] - b[0] + (w.size % p > 0), w.dtype) as tmp:
        for k in range(p - 1):
            s, q = (r - k - 1) % p, (r - k - 2) % p  # send segment s, receive segment q
            send, recv, acc = w[b[s]:b[s + 1]], tmp[: b[q + 1] - b[q]], w[b[q]:b[q + 1]]

            def add(lo, hi, acc=acc, recv=recv):
                ufunc(acc[lo:hi], recv[lo:hi], out=acc[lo:hi])  # own + received partial

            yield from exchange_op(send if send.size else None, nxt, recv if recv.size else None, prv,
                                   tag, comm, link, add, verb="ring.rs")


def ring_allgather_op(x, comm, tag, link=None):
    """All-gather the flat array `x` in place: rank r contributes segment r."""
    p, r = comm.Get_size(), comm.Get_rank()
    b = segments(x.size, p)
    nxt, prv = (r + 1) % p, (r - 1) % p
    for k in range(p - 1):
        s, q = (r - k) % p, (r - k - 1) % p
        send, recv = x[b[s]:b[s + 1]], x[b[q]:b[q + 1]]
        yield from exchange_op(send if send.size else None, nxt, recv if recv.size else None, prv,
                               tag, comm, link, verb="ring.ag")


def _ring_pipelined_op(x, w, comm, ufunc, tag, link, tmps):
    """The throttled ring all-reduce with its 2(p-1) steps pipelined by chunks.

    Same messages, values and reduction order as reduce-scatter + all-gather step by step
    (`w` is the work array: `x` itself, or its fp32 copy for fp16), but a chunk of step k+1 goes
    on the wire as soon as the chunk it forwards has landed (and, in the reduce-scatter, been
    added) in step k, instead of after the whole of step k: the link stays busy from the first
    chunk to the last, as a ring on a real network does, and the host's per-step tails (the
    last chunk's copy and add, a neighbour a little behind) no longer add up step after step.
    Receives are posted in message order (MPI matches them in posting order) once the chunk they
    overwrite is consumed; reduce-scatter steps alternate between the two scratch arrays `tmps`.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    b = segments(x.size, p)
    nxt, prv = (r + 1) % p, (r - 1) % p
    K = 2 * (p - 1)
    plan = []  # per step: (send array, send segment, recv array, recv segment, acc or None)
    for k in range(K):
        if k < p - 1:  # reduce-scatter on w
            s, q = (r - k - 1) % p, (r - k - 2) % p
            plan.append((w, s, tmps[k % 2], q, w))
        else:  # all-gather on x
            j = k - (p - 1)
            s, q = (r - j) % p, (r - j - 1) % p
            plan.append((x, s, x, q, None))

    def chunks_of(arr, seg):  # element ranges of a segment's message
        n, item = b[seg + 1] - b[seg], arr.itemsize
        return [(lo // item, hi // item) for lo, hi in link.chunks(n * item)] if n else []

    sends = [(k, lo, hi) for k in range(K) for lo, hi in chunks_of(plan[k][0], plan[k][1])]
    recvs = [(k, lo, hi) for k in range(K) for lo, hi in chunks_of(plan[k][2], plan[k][3])]
    # elements of step k's received segment landed and processed, in order (a step with
    # nothing to receive, on fewer elements than ranks, counts as done)
    total = [b[plan[k][3] + 1] - b[plan[k][3]] for k in range(K)]
    done = [0 if total[k] else x.size for k in range(K)]
    posted: deque = deque()  # (request, k, lo, hi) of posted receives, in order
    si = ri = 0  # next send, next receive to post
    send_reqs = []
    # per step, as its chunks land: the watermark and when it was seen (both ascending)
    landed_hi: list[list[int]] = [[] for _ in range(K)]
    landed_t: list[list[float]] = [[] for _ in range(K)]
    t_start = link.clock()
    end = None  # release time of the last chunk handed to the link
    started = -1  # the step whose first chunk was handed last

    def post():
        nonlocal ri
        while ri < len(recvs):
            k, lo, hi = recvs[ri]
            # post once the chunk it may overwrite is consumed: step k reuses step k-2's
            # scratch, and step k-1 runs ahead of it (segments differ by <= 1 element; a step
            # with nothing to receive counts as done)
            if k > 0 and done[k - 1] < min(hi, total[k - 1]):
                break
            if k > 1 and done[k - 2] < total[k - 2]:
                break
            arr, seg = plan[k][2], plan[k][3]
            base = b[seg] if arr is x else 0  # all-gather lands in place; reduce-scatter in tmp
            view = arr[base + lo : base + hi]
            posted.append((comm.Irecv([view.view(np.uint8), MPI.BYTE], prv, tag), k, lo, hi))
            ri += 1

    def land():  # process the receives that have completed, in order
        while posted and posted[0][0].Test():
            _, k, lo, hi = posted.popleft()
            acc = plan[k][4]
            if acc is not None:
                q = plan[k][3]
                a = acc[b[q] : b[q + 1]]
                ufunc(a[lo:hi], plan[k][2][lo:hi], out=a[lo:hi])  # own + received partial
                if k == p - 2 and w is not x:  # this rank's segment is final: round it once
                    x[b[q] + lo : b[q] + hi] = a[lo:hi]
            done[k] = hi
            landed_hi[k].append(hi)
            landed_t[k].append(link.clock())
        post()

    def ready_at(k, hi):  # when the data of step k's send chunk ending at `hi` was seen ready
        if k == 0 or not landed_hi[k - 1]:
            return t_start
        return landed_t[k - 1][bisect.bisect_left(landed_hi[k - 1], hi)]

    post()
    while si < len(sends) or posted:
        land()
        if si < len(sends):
            k, lo, hi = sends[si]
            if k == 0 or done[k - 1] >= hi:  # the data it forwards is here
                arr, seg = plan[k][0], plan[k][1]
                nbytes = (hi - lo) * arr.itemsize
                # slots chain from the data's readiness, not from when this rank woke up, so
                # a late wake-up delays one chunk, not every one after it
                t_ready = ready_at(k, hi)
                if k != started:  # a message's first chunk pays the latency
                    end = link.reserve(nbytes, after=None, t0=t_ready)
                    started = k
                else:
                    end = link.reserve(nbytes, after=max(end, t_ready))
                yield end
                view = arr[b[seg] + lo : b[seg] + hi]
                send_reqs.append(comm.Isend([view.view(np.uint8), MPI.BYTE], nxt, tag))
                si += 1
                continue
        if posted:
            yield [posted[0][0]]
    yield send_reqs


def ring_allreduce_op(buf, comm, op="sum", tag=COLL_TAG, link=None, ledger=None):
    x = _flat(buf)
    p = comm.Get_size()
    if p == 1 or x.size == 0:
        return buf
    ufunc, wd = _ufunc(op), work_dtype(x.dtype)
    if link is not None and not LOG_MESSAGES:
        seg = x.size // p + (x.size % p > 0)
        # two scratch segments, allocated apart (two smaller blocks are reused by the allocator
        # where one block of twice the size would be mapped afresh each time)
        with _scratch(ledger, "comm.ring", seg, wd) as t0, _scratch(ledger, "comm.ring", seg, wd) as t1:
            if wd == x.dtype:
                yield from _ring_pipelined_op(x, x, comm, ufunc, tag, link, (t0, t1))
            else:
                with _scratch(ledger, "comm.ring.fp32", x.size, wd) as w:
                    np.copyto(w, x)
                    yield from _ring_pipelined_op(x, w, comm, ufunc, tag, link, (t0, t1))
        return buf
    if wd == x.dtype:
        yield from ring_reduce_scatter_op(x, comm, ufunc, tag, link, ledger)
    else:  # float16: reduce in float32, round this rank's segment once
        b, r = segments(x.size, p), comm.Get_rank()
        with _scratch(ledger, "comm.ring.fp32", x.size, wd) as w:
            np.copyto(w, x)
            yield from ring_reduce_scatter_op(w, comm, ufunc, tag, link, ledger)
            x[b[r]:b[r + 1]] = w[b[r]:b[r + 1]]
    yield from ring_allgather_op(x, comm, tag, link)
    return buf


def reduce_scatter_op(buf, comm, op="sum", tag=COLL_TAG, link=None, ledger=None):
    x = _flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    b = segments(x.size, p)
    ufunc, wd = _ufunc(op), work_dtype(x.dtype)
    if p > 1 and wd == x.dtype:
        yield from ring_reduce_scatter_op(x, comm, ufunc, tag, link, ledger)
    elif p > 1:
        with _scratch(ledger, "comm.ring.fp32", x.size, wd) as w:
            np.copyto(w, x)
            yield from ring_reduce_scatter_op(w, comm, ufunc, tag, link, ledger)
            x[b[r]:b[r + 1]] = w[b[r]:b[r + 1]]
    return x[b[r]:b[r + 1]]


def allgather_op(buf, comm, tag=COLL_TAG, link=None):
    if comm.Get_size() > 1:
        yield from ring_allgather_op(_flat(buf), comm, tag, link)
    return buf


# --------------------------------------------------------------------------------------------
# Tree: recursive doubling with a fold for non-powers of two
# --------------------------------------------------------------------------------------------


def tree_allreduce_op(buf, comm, op="sum", tag=COLL_TAG, link=None, ledger=None):
    x = _flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1 or x.size == 0:
        return buf
    ufunc, wd = _ufunc(op), work_dtype(x.dtype)
    m = 1 << (p.bit_length() - 1)  # largest power of two <= p
    extra = p - m
    with _scratch(ledger, "comm.tree", x.size, wd) as tmp, \
            _scratch(ledger if wd != x.dtype else None, "comm.tree.fp32", x.size if wd != x.dtype else 0, wd) as w:
        if wd != x.dtype:
            np.copyto(w, x)
        else:
            w = x
        if link is None and not LOG_MESSAGES and w.dtype.char in "fdilq":
            # Fast path for small messages (the same messages, minus per-message overhead):
            # typed buffers, one request list per step.
            if r >= m:
                yield [comm.Isend(w, r - m, tag)]
                yield [comm.Irecv(w, r - m, tag)]
            else:
                if r < extra:
                    yield [comm.Irecv(tmp, r + m, tag)]
                    ufunc(w, tmp, out=w)
                d = 1
                while d < m:
                    yield [comm.Irecv(tmp, r ^ d, tag), comm.Isend(w, r ^ d, tag)]
                    ufunc(w, tmp, out=w)
                    d <<= 1
                if r < extra:
                    yield [comm.Isend(w, r + m, tag)]
        elif r >= m:  # fold in, then wait for the result
            yield from send_op(w, r - m, tag, comm, link, verb="tree.fold")
            yield from recv_op(w, r - m, tag, comm, link, verb="tree.result")
        else:
            if r < extra:
                yield from recv_op(tmp, r + m, tag, comm, link, verb="tree.fold")
                ufunc(w, tmp, out=w)  # y[r] = x[r] + x[r+m]
            d = 1
            while d < m:
                yield from exchange_op(w, r ^ d, tmp, r ^ d, tag, comm, link, verb="tree.step")
                ufunc(w, tmp, out=w)  # same value on both partners: + is commutative
                d <<= 1
            if r < extra:
                yield from send_op(w, r + m, tag, comm, link, verb="tree.result")
        if w is not x:
            np.copyto(x, w, casting="same_kind")
    return buf


def tree_allreduce_blocking(buf, comm, op="sum", tag=COLL_TAG):
    """The tree all-reduce without a link, blocking: same messages and order as
    `tree_allreduce_op`, with one Sendrecv per step (the latency path for small messages)."""
    x = _flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1 or x.size == 0:
        return buf
    ufunc, wd = _ufunc(op), work_dtype(x.dtype)
    w = x if wd == x.dtype else x.astype(wd)
    tmp = np.empty_like(w)
    m = 1 << (p.bit_length() - 1)
    if r >= m:
        comm.Send(w, r - m, tag)
        comm.Recv(w, r - m, tag)
    else:
        if r < p - m:
            comm.Recv(tmp, r + m, tag)
            ufunc(w, tmp, out=w)
        d = 1
        while d < m:
            comm.Sendrecv(w, r ^ d, tag, tmp, r ^ d, tag)
            ufunc(w, tmp, out=w)
            d <<= 1
        if r < p - m:
            comm.Send(w, r + m, tag)
    if w is not x:
        np.copyto(x, w, casting="same_kind")
    return buf


def bcast_op(buf, comm, root=0, tag=COLL_TAG, link=None):
    """Binomial-tree broadcast from `root`."""
    x = _flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    v = (r - root) % p  # rank relative to the root
    mask = 1
    while mask < p:
        if v & mask:
            yield from recv_op(x, (v - mask + root) % p, tag, comm, link, verb="bcast")
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            yield from send_op(x, (v + mask + root) % p, tag, comm, link, verb="bcast")
        mask >>= 1
    return buf


# --------------------------------------------------------------------------------------------
# MPI's own collectives: the reference for tests and the benchmark only
# --------------------------------------------------------------------------------------------

_MPI_OPS = {np.add: MPI.SUM, np.maximum: MPI.MAX, np.minimum: MPI.MIN}


def mpi_allreduce_op(buf, comm, op="sum", **_):
    x = _flat(buf)
    w = x.astype(np.float32) if x.dtype == np.float16 else x
    comm.Allreduce(MPI.IN_PLACE, w, _MPI_OPS[_ufunc(op)])
    if w is not x:
        x[:] = w
    return buf
    yield  # a generator, like the others


def mpi_reduce_scatter_op(buf, comm, op="sum", **_):
    x = _flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    b = segments(x.size, p)
    w = x.astype(np.float32) if x.dtype == np.float16 else x
    out = np.empty(b[r + 1] - b[r], w.dtype)
    comm.Reduce_scatter(w, out, [b[q + 1] - b[q] for q in range(p)], _MPI_OPS[_ufunc(op)])
    x[b[r]:b[r + 1]] = out
    return x[b[r]:b[r + 1]]
    yield


def mpi_allgather_op(buf, comm, **_):
    x = _flat(buf)
    p = comm.Get_size()
    b = segments(x.size, p)
    xb = x.view(np.uint8)
    isz = x.itemsize
    counts = [(b[q + 1] - b[q]) * isz for q in range(p)]
    comm.Allgatherv(MPI.IN_PLACE, [xb, counts, [v * isz for v in b[:-1]], MPI.BYTE])
    return buf
    yield


def mpi_bcast_op(buf, comm, root=0, **_):
    comm.Bcast([_flat(buf).view(np.uint8), MPI.BYTE], root)
    return buf
    yield


# --------------------------------------------------------------------------------------------
# Public, blocking API (the engine runs the same *_op generators without blocking)
# --------------------------------------------------------------------------------------------


def allreduce_op(buf, comm, algo="auto", op="sum", tag=COLL_TAG, link=None, ledger=None):
    """The all-reduce operation (a generator) for `algo`; `auto` resolved here."""
    _ufunc(op)  # a bad op fails here, on every rank count
    if algo == "auto":
        algo = choose_algo(buf.nbytes, comm.Get_size(), link)
    if algo == "ring":
        return ring_allreduce_op(buf, comm, op, tag, link, ledger)
    if algo == "tree":
        return tree_allreduce_op(buf, comm, op, tag, link, ledger)
    if algo == "mpi":
        if link is not None:
            raise ValueError("algo='mpi' cannot run through the link throttle; use ring or tree")
        return mpi_allreduce_op(buf, comm, op)
    raise ValueError(f"algo={algo!r} is not one of {', '.join(ALGOS)}")


def allreduce(buf, comm, algo="auto", op="sum", *, link=None, ledger=None, tag=COLL_TAG):
    """All-reduce `buf` in place over `comm`; returns `buf`."""
    _ufunc(op)
    if algo == "auto":
        algo = choose_algo(buf.nbytes, comm.Get_size(), link)
    if algo == "tree" and link is None and ledger is None and not LOG_MESSAGES and \
            work_dtype(buf.dtype).char in "fdilq":
        return tree_allreduce_blocking(buf, comm, op, tag)
    return run(allreduce_op(buf, comm, algo, op, tag, link, ledger), link)


def reduce_scatter(buf, comm, op="sum", *, algo="ring", link=None, ledger=None, tag=COLL_TAG):
    """Reduce `buf` over `comm`; returns the view of this rank's segment (see `segments`) holding
    its reduced values. The rest of `buf` is scratch afterwards."""
    if algo == "mpi":
        return run(mpi_reduce_scatter_op(buf, comm, op))
    return run(reduce_scatter_op(buf, comm, op, tag, link, ledger), link)


def allgather(buf, comm, *, algo="ring", link=None, tag=COLL_TAG):
    """Fill `buf` in place with every rank's segment (rank q contributes `segments(n, p)[q:q+2]`)."""
    if algo == "mpi":
        return run(mpi_allgather_op(buf, comm))
    return run(allgather_op(buf, comm, tag, link), link)


def bcast(buf, comm, root=0, *, algo="tree", link=None, tag=COLL_TAG):
    """Broadcast `buf` from `root` in place (binomial tree)."""
    if algo == "mpi":
        return run(mpi_bcast_op(buf, comm, root))
    return run(bcast_op(buf, comm, root, tag, link), link)


# --------------------------------------------------------------------------------------------
# The documented orders, in one process (tests compare the MPI versions bitwise with these)
# --------------------------------------------------------------------------------------------


def reference_allreduce(arrays, algo="ring", op="sum"):
    """What `allreduce` returns on every rank when rank i holds `arrays[i]` (same order, same rounding)."""
    ufunc = _ufunc(op)
    p = len(arrays)
    dtype = arrays[0].dtype
    xs = [np.asarray(a).reshape(-1).astype(work_dtype(dtype)) for a in arrays]
    n = xs[0].size
    if p == 1:
        return np.asarray(arrays[0]).copy()
    if algo == "ring":
        out = np.empty(n, xs[0].dtype)
        b = segments(n, p)
        for q in range(p):
            sl = slice(b[q], b[q + 1])
            acc = xs[(q + 1) % p][sl].copy()
            for j in range(2, p + 1):
                acc = ufunc(acc, xs[(q + j) % p][sl])
            out[sl] = acc
    elif algo == "tree":
        m = 1 << (p.bit_length() - 1)
        ys = [ufunc(xs[i], xs[i + m]) if i < p - m else xs[i] for i in range(m)]
        while len(ys) > 1:
            ys = [ufunc(ys[i], ys[i + 1]) for i in range(0, len(ys), 2)]
        out = ys[0]
    else:
        raise ValueError(f"no reference order for algo={algo!r}")
    return out.astype(dtype).reshape(np.shape(arrays[0]))


__all__ = [
    "ALGOS",
    "allgather",
    "allgather_op",
    "allreduce",
    "allreduce_op",
    "bcast",
    "bcast_op",
    "choose_algo",
    "model_time",
    "reduce_scatter",
    "reduce_scatter_op",
    "reference_allreduce",
    "segments",
    "work_dtype",
]
