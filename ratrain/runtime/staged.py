"""The communication engine of a rank whose arrays live on a device: MPI sees host buffers.

No CUDA-aware MPI is assumed. `StagedEngine(engine, staging)` has the engine's verbs
(`allreduce`, `reduce_scatter`, `allgather`, `send`, `recv`; everything else passes through)
and takes device arrays: each message is downloaded into a pooled host buffer
(`device.HostStaging`: pinned, on a copy stream, on a GPU), the engine runs it on that buffer
exactly as it runs a CPU rank's (so the reduction order, hence every bit of the result, is the
CPU path's), and the result is uploaded into the device array when the caller takes the
future's result (`StagedFuture.result`, on the caller's thread: the device is never touched
from the engine's thread). Host arrays (the step's facts vector) go straight through.
"""

from __future__ import annotations

import numpy as np


class StagedFuture:
    """The engine's future for a staged message; `result()` also finishes the staging once
    (uploads a received or reduced buffer, returns the host buffer to the pool)."""

    def __init__(self, inner, host, dev, back: bool, staging):
        self._inner, self._host, self._dev = inner, host, dev
        self._back, self._staging, self._finished = back, staging, False

    def done(self) -> bool:
        return self._inner.done()

    def add_done_callback(self, fn) -> None:
        self._inner.add_done_callback(lambda _f: fn(self))

    def exception(self, timeout=None):
        return self._inner.exception(timeout)

    def result(self, timeout=None):
        value = self._inner.result(timeout)
        if not self._finished:
            self._finished = True
            if self._back:
                self._staging.upload(self._host, self._dev)
            self._staging.give(self._host)
        return self._dev if value is self._host else value


class StagedEngine:
    def __init__(self, engine, staging):
        self.engine, self.staging = engine, staging

    def __getattr__(self, name):  # link, attach, close, submit, ...: the engine's own
        return getattr(self.engine, name)

    def _staged(self, op, buf, *args, download: bool = True, back: bool = True, **kwargs):
        if isinstance(buf, np.ndarray):  # a host array: nothing to stage
            return op(buf, *args, **kwargs)
        host = (self.staging.download(buf) if download
                else self.staging.take(buf.shape, buf.dtype))
        return StagedFuture(op(host, *args, **kwargs), host, buf, back, self.staging)

    def allreduce(self, buf, *args, **kwargs):
        return self._staged(self.engine.allreduce, buf, *args, **kwargs)

    def reduce_scatter(self, buf, *args, **kwargs):
        return self._staged(self.engine.reduce_scatter, buf, *args, **kwargs)

    def allgather(self, buf, *args, **kwargs):
        return self._staged(self.engine.allgather, buf, *args, **kwargs)

    def send(self, arr, *args, **kwargs):
        return self._staged(self.engine.send, arr, *args, back=False, **kwargs)

    def recv(self, out, *args, **kwargs):
        return self._staged(self.engine.recv, out, *args, download=False, **kwargs)


__all__ = ["StagedEngine", "StagedFuture"]
