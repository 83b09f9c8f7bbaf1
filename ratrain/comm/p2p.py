"""Pipeline point-to-point: verbs named by direction, no-ops at the pipeline's ends.

    p2p = P2P(topo, engine=engine)          # or engine=None: blocking verbs in this thread
    p2p.send_forward(y)                     # to stage + 1 (nothing on the last stage)
    x = p2p.recv_forward(shape, dtype)      # from stage - 1 (None on the first stage)
    p2p.send_backward(dx)                   # to stage - 1
    dy = p2p.recv_backward(out=buf)         # from stage + 1, into a buffer you own
    fut = p2p.isend_forward(y)              # non-blocking: a Future (needs an engine)

Forward messages use tag 1, backward messages tag 2, on `topo.pp_comm`; MPI keeps the messages
of one direction between two stages in order, so the i-th recv_forward gets the i-th
send_forward. With an engine every verb goes through the engine thread (so it shares the
throttled link with the collectives); blocking verbs wait on the future.
`comm.log_messages` (`wire.log_messages`) logs every message to stderr.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from .collectives import LINK_POLL_S
from .progress import run
from .wire import recv_op, send_op

TAG_FORWARD = 1
TAG_BACKWARD = 2


def _done(value=None) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class P2P:
    def __init__(self, topology, engine=None, link=None, ledger=None):
        self.topo = topology
        self.comm = topology.pp_comm
        self.engine = engine
        self.link = engine.link if engine is not None else link
        self.ledger = ledger

    # -- blocking -----------------------------------------------------------------------------

    def send_forward(self, arr: np.ndarray) -> None:
        self.isend_forward(arr, _blocking=True)

    def send_backward(self, arr: np.ndarray) -> None:
        self.isend_backward(arr, _blocking=True)

    def recv_forward(self, shape=None, dtype=None, *, out=None, tag: str = "comm.recv_forward"):
        """Activations from the previous stage into `out` (or a new array); None on the first stage."""
        return self.irecv_forward(shape, dtype, out=out, tag=tag, _blocking=True)

    def recv_backward(self, shape=None, dtype=None, *, out=None, tag: str = "comm.recv_backward"):
        """Gradients from the next stage into `out` (or a new array); None on the last stage."""
        return self.irecv_backward(shape, dtype, out=out, tag=tag, _blocking=True)

    # -- non-blocking (Futures) ---------------------------------------------------------------

    def isend_forward(self, arr, _blocking=False):
        if self.topo.is_last:
            return None if _blocking else _done()
        return self._send(arr, self.topo.next_rank, TAG_FORWARD, "send_forward", _blocking)

    def isend_backward(self, arr, _blocking=False):
        if self.topo.is_first:
            return None if _blocking else _done()
        return self._send(arr, self.topo.prev_rank, TAG_BACKWARD, "send_backward", _blocking)

    def irecv_forward(self, shape=None, dtype=None, *, out=None, tag="comm.recv_forward", _blocking=False):
        if self.topo.is_first:
            return None if _blocking else _done()
        out = self._out(shape, dtype, out, tag)
        return self._recv(out, self.topo.prev_rank, TAG_FORWARD, "recv_forward", _blocking)

    def irecv_backward(self, shape=None, dtype=None, *, out=None, tag="comm.recv_backward", _blocking=False):
        if self.topo.is_last:
            return None if _blocking else _done()
        out = self._out(shape, dtype, out, tag)
        return self._recv(out, self.topo.next_rank, TAG_BACKWARD, "recv_backward", _blocking)

    # -- plumbing -----------------------------------------------------------------------------

    # The first positional argument of shape may be an array: recv_forward(buf) == recv_forward(out=buf).
    def _out(self, shape, dtype, out, tag):
        if out is None and isinstance(shape, np.ndarray):
            out = shape
        if out is not None:
            return out
        if shape is None or dtype is None:
            raise ValueError("recv needs either out=array or both shape and dtype")
        if self.ledger is not None:
            return self.ledger.alloc(tag, shape, dtype, zero=False)
        return np.empty(shape, dtype)

    def _send(self, arr, peer, tag, verb, blocking):
        if self.engine is not None:
            fut = self.engine.send(arr, peer, tag, self.comm, verb=verb)
            return fut.result() if blocking else fut
        if not blocking:
            raise RuntimeError(f"{verb}: non-blocking verbs need P2P(topology, engine=CommEngine(...))")
        run(send_op(arr, peer, tag, self.comm, self.link, verb), LINK_POLL_S if self.link else None)
        return None

    def _recv(self, out, peer, tag, verb, blocking):
        if self.engine is not None:
            fut = self.engine.recv(out, peer, tag, self.comm, verb=verb)
            return fut.result() if blocking else fut
        if not blocking:
            raise RuntimeError(f"{verb}: non-blocking verbs need P2P(topology, engine=CommEngine(...))")
        return run(recv_op(out, peer, tag, self.comm, self.link, verb), LINK_POLL_S if self.link else None)


__all__ = ["P2P", "TAG_BACKWARD", "TAG_FORWARD"]
