"""Ring collectives on point-to-point: reduce-scatter, all-gather, and the all-reduce made of
the two (bandwidth-optimal: 2(p-1) messages of n/p bytes). Segment q = [q*n//p, (q+1)*n//p) is
reduced as a left fold over the ranks q+1, q+2, ..., p-1, 0, ..., q and ends on rank q (see
`collectives` for the documented order). Under the link throttle the all-reduce pipelines its
2(p-1) steps by chunks (`_ring_pipelined_op`), its latency runs from when the operation was
posted, and it ends as a throttled message does (`wire`): its last chunk goes out when its slot
starts and a zero-byte end marker when the slot ends."""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np
from mpi4py import MPI

from .arrays import as_ufunc, flat, scratch, segments, work_dtype
from .progress import SPIN_S, Deadline
from .wire import END_MARKER, LOG, exchange_op, log_message

COLL_TAG = 30000  # tag of blocking collectives; the engine gives each op its own tag
MARKER_POLL_S = 5e-5  # between its last chunk and the end marker, land chunks this often


def ring_reduce_scatter_op(w, comm, ufunc, tag, link=None, ledger=None):
    """Reduce-scatter the flat array `w` in place: rank r ends with segment r reduced."""
    p, r = comm.Get_size(), comm.Get_rank()
    b = segments(w.size, p)
    nxt, prv = (r + 1) % p, (r - 1) % p
    with scratch(ledger, "comm.ring", b[1] - b[0] + (w.size % p > 0), w.dtype) as tmp:
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


def _ring_pipelined_op(x, w, comm, ufunc, tag, link, tmps, t_posted):
    """The throttled ring all-reduce with its 2(p-1) steps pipelined by chunks.

    Same messages, values and reduction order as reduce-scatter + all-gather step by step
    (`w` is the work array: `x` itself, or its fp32 copy for fp16), but a chunk of step k+1 goes
    on the wire as soon as the chunk it forwards has landed (and, in the reduce-scatter, been
    added) in step k, instead of after the whole of step k: the link stays busy from the first
    chunk to the last, as a ring on a real network does, and the host's per-step tails (the
    last chunk's copy and add, a neighbour a little behind) no longer add up step after step.
    Receives are posted in message order (MPI matches them in posting order) once the chunk they
    overwrite is consumed; reduce-scatter steps alternate between the two scratch arrays `tmps`.

    Host time is kept off the emulated wire: the first message's latency runs from `t_posted`
    (when the operation was posted; the scratch and the plan are made meanwhile), a chunk is
    reduced while the next one crosses, and the last chunk of the last step goes to MPI when its
    slot starts, so the receiver's copy overlaps the slot; a zero-byte end marker at the slot's
    end (a `Deadline`) completes the operation, never before the model's time.

    One function on purpose: it is one generator whose yield points (waits on the link clock
    and on requests) must live in one frame, and its closures share the send / receive cursors
    and watermarks; split, the state would travel through every helper.
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

    def verb(k):
        return "ring.rs" if k < p - 1 else "ring.ag"

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
    t_start = t_posted  # step 0's data is ready when the operation was posted
    end = None  # release time of the last chunk handed to the link
    started = -1  # the step whose first chunk was handed last
    marker_at = None  # when the end marker is due (the last chunk's slot end), once it is out
    end_req = None  # the receive of the previous rank's end marker

    def post():
        nonlocal ri, end_req
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
            if LOG.on and lo == 0:  # a step's message, logged as the step-by-step ring does
                log_message(f"{verb(k)}.recv", comm, prv, tag, total[k] * arr.itemsize)
            base = b[seg] if arr is x else 0  # all-gather lands in place; reduce-scatter in tmp
            view = arr[base + lo : base + hi]
            posted.append((comm.Irecv([view.view(np.uint8), MPI.BYTE], prv, tag), k, lo, hi))
            ri += 1
        if recvs and ri == len(recvs) and end_req is None:  # after every chunk (MPI's order)
            end_req = comm.Irecv([END_MARKER, MPI.BYTE], prv, tag)

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
    while si < len(sends) or posted or marker_at is not None:
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
                    if LOG.on:
                        log_message(f"{verb(k)}.send", comm, nxt, tag,
                                    (b[seg + 1] - b[seg]) * arr.itemsize)
                else:
                    end = link.reserve(nbytes, after=max(end, t_ready))
                si += 1
                # the last chunk of the last step crosses during its slot (nobody forwards it);
                # any other chunk is handed when its slot ends, and may be forwarded on landing
                early = si == len(sends) and k == K - 1
                yield end - link.transfer_time(nbytes) if early else end
                view = arr[b[seg] + lo : b[seg] + hi]
                send_reqs.append(comm.Isend([view.view(np.uint8), MPI.BYTE], nxt, tag))
                if si == len(sends):
                    marker_at = end
                continue
        if marker_at is not None:  # land what still comes, but send the marker on time
            if posted and link.clock() < marker_at - SPIN_S:
                yield min(marker_at - SPIN_S, link.clock() + MARKER_POLL_S)
                continue
            yield Deadline(marker_at)
            send_reqs.append(comm.Isend([END_MARKER, MPI.BYTE], nxt, tag))
            marker_at = None
        elif posted:
            yield [posted[0][0]]
    yield send_reqs + ([end_req] if end_req is not None else [])


def ring_allreduce_op(buf, comm, op="sum", tag=COLL_TAG, link=None, ledger=None, group=None):
    x = flat(buf)
    p = comm.Get_size()
    if p == 1 or x.size == 0:
        return buf
    ufunc, wd = as_ufunc(op), work_dtype(x.dtype)
    if link is not None and hasattr(link, "resolve"):  # two levels: the one to the next rank
        link = link.resolve(comm, (comm.Get_rank() + 1) % p)
    if link is not None:
        posted = link.clock()  # the latency runs from here, while the scratch is made
        seg = x.size // p + (x.size % p > 0)
        # two scratch segments, allocated apart (two smaller blocks are reused by the allocator
        # where one block of twice the size would be mapped afresh each time)
        with scratch(ledger, "comm.ring", seg, wd) as t0, scratch(ledger, "comm.ring", seg, wd) as t1:
            if wd == x.dtype:
                yield from _ring_pipelined_op(x, x, comm, ufunc, tag, link, (t0, t1), posted)
            else:
                with scratch(ledger, "comm.ring.fp32", x.size, wd) as w:
                    np.copyto(w, x)  # the data to send is ready only now
                    yield from _ring_pipelined_op(x, w, comm, ufunc, tag, link, (t0, t1),
                                                  link.clock())
        return buf
    if wd == x.dtype:
        yield from ring_reduce_scatter_op(x, comm, ufunc, tag, link, ledger)
    else:  # float16: reduce in float32, round this rank's segment once
        b, r = segments(x.size, p), comm.Get_rank()
        with scratch(ledger, "comm.ring.fp32", x.size, wd) as w:
            np.copyto(w, x)
            yield from ring_reduce_scatter_op(w, comm, ufunc, tag, link, ledger)
            x[b[r]:b[r + 1]] = w[b[r]:b[r + 1]]
    yield from ring_allgather_op(x, comm, tag, link)
    return buf


def reduce_scatter_op(buf, comm, op="sum", tag=COLL_TAG, link=None, ledger=None, group=None):
    x = flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    b = segments(x.size, p)
    ufunc, wd = as_ufunc(op), work_dtype(x.dtype)
    if p > 1 and wd == x.dtype:
        yield from ring_reduce_scatter_op(x, comm, ufunc, tag, link, ledger)
    elif p > 1:
        with scratch(ledger, "comm.ring.fp32", x.size, wd) as w:
            np.copyto(w, x)
            yield from ring_reduce_scatter_op(w, comm, ufunc, tag, link, ledger)
            x[b[r]:b[r + 1]] = w[b[r]:b[r + 1]]
    return x[b[r]:b[r + 1]]


def allgather_op(buf, comm, tag=COLL_TAG, link=None, group=None):
    if comm.Get_size() > 1:
        yield from ring_allgather_op(flat(buf), comm, tag, link)
    return buf


__all__ = ["COLL_TAG", "allgather_op", "reduce_scatter_op", "ring_allgather_op", "ring_allreduce_op",
           "ring_reduce_scatter_op"]
