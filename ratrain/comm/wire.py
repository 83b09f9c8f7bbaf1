"""Messages on the wire: send / receive / exchange operations, throttled by the shim's link.

Every byte ratrain moves between ranks goes through `send_op`, `recv_op` or `exchange_op`
(generators driven by `progress.run` or the engine's `Scheduler`). Buffers travel as raw bytes
(`MPI.BYTE`), so float16 needs no MPI datatype. Without a link a message is one Isend / Irecv.
With a link (`ratrain.shim.link.Link`) the sender cuts it into the link's chunks and hands each
to MPI when its slot on the emulated wire ends; the receiver posts one Irecv per chunk, so a
collective can reduce chunk j while chunk j+1 is still on the wire (`on_chunk`). The last chunk
is handed to MPI when its slot *starts*, so that the host's own copy of it overlaps its slot,
and a zero-byte end marker follows when the slot ends (a `progress.Deadline`, met closely): the
message completes at max(model, host) time instead of model + one chunk's host copy, and never
before latency + bytes / bandwidth.

Link levels: a link that can `resolve(comm, peer)` (`topology.NodeLinks`) gives the link a
message to or from `peer` crosses (the intra-node link or the node's interface); both levels cut
messages into the same chunks, so sender and receiver agree on them.

Message order: MPI keeps messages of one (communicator, peer, tag) in order. A throttled message
is several MPI messages posted over time, so throttled sends to the same (communicator, peer,
tag) go one after another (a FIFO per key); receives post all their chunks at once and need none.

`log_messages(True)` (the config's `comm.log_messages`, debug only: the engine sets it) prints
every message (rank, verb, peer, tag, bytes) to stderr, on whichever path carries it: every
sender of messages logs them (`log_exchange`), and no path is chosen by it.
"""

from __future__ import annotations

import sys
from collections import deque

import numpy as np
from mpi4py import MPI

from .progress import Deadline



class _Log:
    on = False  # print every message (`log_messages`)


LOG = _Log()


def log_messages(on: bool) -> None:
    """Print every message of this process to stderr from now on (or no longer)."""
    LOG.on = bool(on)


_send_fifo: dict[tuple, deque] = {}
END_MARKER = np.empty(0, np.uint8)  # the end-of-message marker (zero bytes: one buffer serves all)


def as_bytes(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (what MPI sends)."""
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"communication buffers must be C-contiguous; got an array of shape {arr.shape} with "
            f"strides {arr.strides}: pass np.ascontiguousarray(arr)"
        )
    return arr.reshape(-1).view(np.uint8)


def log_message(verb: str, comm, peer: int, tag: int, nbytes: int) -> None:
    print(
        f"[ratrain.comm] rank {MPI.COMM_WORLD.Get_rank()} {verb} peer={peer} tag={tag} "
        f"bytes={nbytes} comm={comm.Get_name() or hex(comm.py2f())}",
        file=sys.stderr,
        flush=True,
    )


def log_exchange(verb: str, comm, dest, nsend, source, nrecv, tag: int) -> None:
    """Log the messages of one exchange (`nsend` bytes to `dest`, `nrecv` from `source`;
    either side None): `verb`, or `verb.send` / `verb.recv` when there are both."""
    both = nsend is not None and nrecv is not None
    if nsend is not None:
        log_message(f"{verb}.send" if both else verb, comm, dest, tag, nsend)
    if nrecv is not None:
        log_message(f"{verb}.recv" if both else verb, comm, source, tag, nrecv)


def send_op(arr: np.ndarray, dest: int, tag: int, comm, link=None, verb: str = "send"):
    """Send `arr` to `dest` (a rank of `comm`)."""
    yield from exchange_op(arr, dest, None, None, tag, comm, link, verb=verb)


def recv_op(out: np.ndarray, source: int, tag: int, comm, link=None, verb: str = "recv", on_chunk=None):
    """Receive into `out` from `source`; returns `out`. `on_chunk(lo, hi)` gets element ranges."""
    yield from exchange_op(None, None, out, source, tag, comm, link, on_chunk, verb=verb)
    return out


def exchange_op(send, dest, recv, source, tag, comm, link=None, on_chunk=None, verb="sendrecv"):
    """Send `send` to `dest` while receiving `recv` from `source` (either may be None).

    `on_chunk(lo, hi)` is called with element ranges of `recv` as they land, in order.
    """
    sbuf = as_bytes(send) if send is not None else None
    rbuf = as_bytes(recv) if recv is not None else None
    if LOG.on:
        log_exchange(verb, comm, dest, None if sbuf is None else sbuf.size, source,
                     None if rbuf is None else rbuf.size, tag)
    item = recv.itemsize if recv is not None else 1
    slink = rlink = link
    if link is not None and hasattr(link, "resolve"):  # two levels: the link each peer is behind
        slink = link.resolve(comm, dest) if sbuf is not None else None
        rlink = link.resolve(comm, source) if rbuf is not None else None
        link = slink or rlink

    if link is None:  # one MPI message each way
        reqs = []
        if rbuf is not None:
            reqs.append(comm.Irecv([rbuf, MPI.BYTE], source, tag))
        if sbuf is not None:
            reqs.append(comm.Isend([sbuf, MPI.BYTE], dest, tag))
        yield reqs
        if on_chunk is not None and recv is not None and recv.size:
            on_chunk(0, recv.size)
        return

    yield from _throttled_exchange(sbuf, dest, rbuf, source, tag, comm, slink, rlink, on_chunk,
                                   item)


def _throttled_exchange(sbuf, dest, rbuf, source, tag, comm, slink, rlink, on_chunk, item):
    """`exchange_op` through the link throttle: chunks, each released when its slot on the
    emulated wire ends (the last when its slot starts, then the end marker); receives are
    posted for every chunk at once and reported to `on_chunk` in order as they land.
    `slink` / `rlink`: the links of the send and of the receive (the same with one level)."""
    pending: deque = deque()  # (request, lo, hi) of receive chunks, in order, then the end
    link = slink
    if rbuf is not None:
        for lo, hi in rlink.chunks(rbuf.size):
            pending.append((comm.Irecv([rbuf[lo:hi], MPI.BYTE], source, tag), lo // item, hi // item))
        pending.append((comm.Irecv([END_MARKER, MPI.BYTE], source, tag), 0, 0))

    def drain(block: bool):
        while pending and (block or pending[0][0].Test()):
            req, lo, hi = pending[0]
            if block:
                yield [req]
            pending.popleft()
            if on_chunk is not None and hi > lo:
                on_chunk(lo, hi)

    sends = []
    if sbuf is not None:
        posted = link.clock()  # the latency runs from here, even if the FIFO holds us back
        key = (comm.py2f(), dest, tag)
        fifo = _send_fifo.setdefault(key, deque())
        token = object()
        fifo.append(token)
        try:
            if fifo[0] is not token:
                yield lambda: fifo[0] is token
            end = None
            chunks = link.chunks(sbuf.size)
            for i, (lo, hi) in enumerate(chunks):
                end = link.reserve(hi - lo, after=end, t0=posted)
                if i < len(chunks) - 1:
                    yield end
                    sends.append(comm.Isend([sbuf[lo:hi], MPI.BYTE], dest, tag))
                else:  # the last chunk crosses during its slot; the end marker ends the message
                    yield end - link.transfer_time(hi - lo)
                    sends.append(comm.Isend([sbuf[lo:hi], MPI.BYTE], dest, tag))
                    yield Deadline(end)
                    sends.append(comm.Isend([END_MARKER, MPI.BYTE], dest, tag))
                yield from drain(block=False)
        finally:
            fifo.remove(token)
            if not fifo:
                _send_fifo.pop(key, None)
    yield from drain(block=True)
    yield sends


__all__ = ["END_MARKER", "LOG", "as_bytes", "exchange_op", "log_exchange", "log_messages",
           "recv_op", "send_op"]
