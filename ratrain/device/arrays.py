"""Every crossing between host and device memory, written once.

The array module `xp` of a rank is numpy (the host), cupy (a GPU) or the stand-in
(`device.standin`, a CPU device with cupy's rules). Code above asks here instead of testing
which module it holds:

    to_host(a)            a host numpy array of `a` (the same array when it is one already)
    to_device(xp, a)      `a` as an array of `xp` (a copy only when it crosses)
    is_host(xp)           whether `xp` computes on the host (numpy)
    host_floats(xp, vs)   Python floats of device scalars, all in one download
    module_of(a)          the array module owning `a`
    synchronize(xp)       wait for the device's queued work (nothing on the host)
    scatter_add(xp, t, i, v)   t[i] += v with repeated indices summed (np.add.at / cupyx)
    HostStaging(xp)       pinned host buffers and a copy stream: the path of device arrays to
                          MPI (no CUDA-aware MPI is assumed)
"""

from __future__ import annotations

import numpy as np

from ratrain.device.standin import StandinArray, standin


def is_host(xp) -> bool:
    return xp is np


def _is_cupy(a) -> bool:
    return type(a).__module__.startswith("cupy")


def module_of(a):
    """numpy, the stand-in or cupy: whichever owns `a` (numpy for scalars and lists)."""
    if type(a) is StandinArray:
        return standin
    if _is_cupy(a):  # pragma: no cover - needs cupy
        import cupy  # only reached with a cupy array, so cupy is loaded already

        return cupy
    return np


def to_host(a, out=None):
    """A host numpy array of `a`: the array itself when it is on the host already (no copy),
    else one download (into `out` when given: a pinned buffer of the same shape)."""
    if type(a) is StandinArray or _is_cupy(a):
        return a.get(out=out)
    if out is not None:
        out[...] = a
        return out
    return np.asarray(a)


def to_device(xp, a, dtype=None):
    """`a` (host or device) as an array of `xp`, of `dtype` when given: no copy where it is
    one already; one upload from the host."""
    if xp is np:
        return np.asarray(to_host(a), dtype=dtype)
    return xp.asarray(a, dtype=dtype)


def host_floats(xp, values) -> list[float]:
    """Python floats of `values` (host scalars, or 0-d device arrays of `xp`): on a device all
    of them in one download (one host sync), never one sync each."""
    values = list(values)
    if xp is np or not values:
        return [float(v) for v in values]
    stacked = xp.stack([xp.asarray(v, dtype=xp.float64).reshape(()) for v in values])
    return to_host(stacked).tolist()


def synchronize(xp) -> None:
    """Wait until the device has done what was queued on it (the host: nothing to wait for)."""
    if getattr(xp, "__name__", "") == "cupy":  # pragma: no cover - needs cupy
        xp.cuda.get_current_stream().synchronize()


def scatter_add(xp, target, index, values) -> None:
    """target[index] += values, with the contributions of a repeated index all added (numpy's
    `add.at`; cupy's atomic `cupyx.scatter_add`)."""
    if getattr(xp, "__name__", "") == "cupy":  # pragma: no cover - needs cupy
        import cupyx  # the cupy module is in use, so cupyx is there too

        cupyx.scatter_add(target, index, values)
    else:
        xp.add.at(target, index, values)


class HostStaging:
    """Host buffers through which device arrays reach MPI, and the copies in and out of them.

    On a GPU the buffers are page-locked (`cupyx.empty_pinned`), so `download`/`upload` are
    asynchronous copies on a copy stream of their own, overlapping the compute stream; `wait()`
    ends them. On the host (numpy) no staging is needed: `download` returns the array itself.
    On the stand-in the copies are plain, counted transfers. Buffers are kept per name and
    reused while shape and dtype match."""

    def __init__(self, xp):
        self.xp = xp
        self._bufs: dict[str, np.ndarray] = {}
        self._stream = None
        if getattr(xp, "__name__", "") == "cupy":  # pragma: no cover - needs cupy
            self._stream = xp.cuda.Stream(non_blocking=True)

    @property
    def needed(self) -> bool:
        return self.xp is not np

    def buffer(self, name: str, shape, dtype) -> np.ndarray:
        b = self._bufs.get(name)
        if b is None or b.shape != tuple(shape) or b.dtype != np.dtype(dtype):
            if self._stream is not None:  # pragma: no cover - needs cupy
                import cupyx  # a GPU rank: cupy is loaded already

                b = cupyx.empty_pinned(tuple(shape), dtype)
            else:
                b = np.empty(tuple(shape), dtype)
            self._bufs[name] = b
        return b

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())

    def download(self, name: str, a) -> np.ndarray:
        """A host array of device array `a` (staged in buffer `name`; `a` itself on the host).
        On a GPU the copy is queued after the work that made `a` and has ended when this
        returns, so the buffer may go to MPI at once."""
        if self.xp is np:
            return a
        host = self.buffer(name, a.shape, a.dtype)
        if self._stream is not None:  # pragma: no cover - needs cupy
            self._stream.wait_event(self.xp.cuda.get_current_stream().record())
            a.get(stream=self._stream, out=host)
            self._stream.synchronize()
            return host
        return a.get(out=host)

    def upload(self, host: np.ndarray, a) -> None:
        """Copy host array `host` into device array `a` (the same array on the host: nothing);
        the compute stream's later work waits for the copy."""
        if self.xp is np:
            if host is not a:
                a[...] = host
            return
        if self._stream is not None:  # pragma: no cover - needs cupy
            a.set(host, stream=self._stream)
            self.xp.cuda.get_current_stream().wait_event(self._stream.record())
            return
        a.set(host)
