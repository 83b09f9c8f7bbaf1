"""One rank's pipeline messages during a step: receives posted early, sends in flight.

The executor's point-to-point actions go through a `Mailbox`:

    box.start(actions)            # step start: post the first receive of each direction
    x = box.take(RecvForward, mb) # wait for it (and post the next receive of that direction)
    box.send(SendForward, mb, y)  # hand a message to the engine; the buffer is freed when sent
    box.poll(); box.finish()      # free completed sends; wait for every send (step end)

Receive buffers come from the DDR ledger (`activations.mb<i>.input` for activations, which live
until the micro-batch's backward, `comm.recv_backward` for gradients); a sent buffer is
released when its send completes. Every message is reported to `on_event(name, t0, future)`
for the timeline.
"""

from __future__ import annotations

import time
from collections import deque

from ratrain.lifecycle.schedule import RecvBackward, RecvForward, SendBackward, SendForward

_RECV_TAG = {RecvForward: "activations.mb{mb}.input", RecvBackward: "comm.recv_backward"}


class Mailbox:
    def __init__(self, p2p, ledger, shape, dtype, xp, on_event):
        self.p2p, self.ledger = p2p, ledger
        self.shape, self.dtype, self.xp = shape, dtype, xp
        self.on_event = on_event
        self._irecv = {RecvForward: p2p.irecv_forward, RecvBackward: p2p.irecv_backward}
        self._isend = {SendForward: p2p.isend_forward, SendBackward: p2p.isend_backward}
        self.reset()

    def reset(self) -> None:
        self.order: dict[type, deque] = {RecvForward: deque(), RecvBackward: deque()}
        self.posted: dict[tuple[type, int], tuple] = {}  # (type, mb) -> (future, buffer)
        self.sends: list[tuple] = []  # (future, buffer) in flight

    def start(self, actions) -> None:
        """A step begins: note the order of its receives and post the first of each."""
        self.reset()
        for a in actions:
            if type(a) in self.order:
                self.order[type(a)].append(a.mb)
        for t in self.order:
            self._post_next(t)

    def _post_next(self, t) -> None:
        if not self.order[t]:
            return
        mb = self.order[t].popleft()
        buf = self.ledger.alloc(_RECV_TAG[t].format(mb=mb), self.shape, self.dtype, self.xp,
                                zero=False)
        t0 = time.perf_counter()
        fut = self._irecv[t](out=buf)
        self.on_event(t(mb).name(), t0, fut)
        self.posted[(t, mb)] = (fut, buf)

    def take(self, t, mb: int):
        """The received buffer of (RecvForward | RecvBackward, mb), once it has landed."""
        fut, buf = self.posted.pop((t, mb))
        fut.result()
        self._post_next(t)
        return buf

    def send(self, t, mb: int, arr) -> None:
        """Hand `arr` (ledger-tracked) to the engine as (SendForward | SendBackward, mb)."""
        t0 = time.perf_counter()
        fut = self._isend[t](arr)
        self.on_event(t(mb).name(), t0, fut)
        self.sends.append((fut, arr))

    def poll(self) -> None:
        """Release the buffers of completed sends (cheap when none completed)."""
        if self.sends and self.sends[0][0].done():
            keep = []
            for fut, buf in self.sends:
                if fut.done():
                    fut.result()
                    self.ledger.free(buf)
                else:
                    keep.append((fut, buf))
            self.sends = keep

    def finish(self) -> None:
        """Wait for every send of the step and release its buffer."""
        for fut, buf in self.sends:
            fut.result()
            self.ledger.free(buf)
        self.sends = []


__all__ = ["Mailbox"]
