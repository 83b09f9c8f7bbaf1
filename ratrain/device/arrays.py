"""Every crossing between host and device memory, written once.

The array module `xp` of a rank is numpy (the host), cupy (a GPU) or the stand-in
(`device.standin`, a CPU device with cupy's rules). Code above asks here instead of testing
which module it holds:

    to_host(a)            a host numpy array of `a` (the same array when it is one already)
    to_device(xp, a)      `a` as an array of `xp` (a copy only when it crosses)
    is_host(xp)           whether `xp` computes on the host (numpy): the one way to ask
    kind_of(xp)           which `run.device` `xp` is: cpu (numpy), gpu (cupy) or standin
    storage_of(a)         the numpy array a stand-in array keeps its values in (in place)
    host_floats(xp, vs)   Python floats of device scalars, all in one download
    module_of(a)          the array module owning `a`
    synchronize(xp)       wait for the device's queued work (nothing on the host)
    stacked_rows(arrays)  arrays that lie back to back as one 2-D view (no copy), or None
    HostStaging(xp)       pinned host buffers and a copy stream: the path of device arrays to
                          MPI (no CUDA-aware MPI is assumed)
"""

from __future__ import annotations

import numpy as np

from ratrain.device.standin import StandinArray, standin


def is_host(xp) -> bool:
    return xp is np


def kind_of(xp) -> str:
    """The `run.device` whose array module `xp` is: "cpu" (numpy), "standin" or "gpu" (cupy)."""
    if xp is np:
        return "cpu"
    return "standin" if xp is standin else "gpu"


def storage_of(a):
    """The numpy array in which a stand-in array keeps its values (the same memory: writes go
    through), for numba-cuda's simulator, which runs device kernels on host arrays in place; a
    numpy array is its own storage; None for anything else (a scalar; a cupy array's values
    are on its card)."""
    if type(a) is StandinArray:
        return a._a
    return a if isinstance(a, np.ndarray) else None


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


def _address(a) -> int:
    if type(a) is StandinArray:
        return a._a.__array_interface__["data"][0]
    if _is_cupy(a):  # pragma: no cover - needs cupy
        return a.data.ptr
    return a.__array_interface__["data"][0]


def stacked_rows(arrays, writeable: bool = False):
    """The rows of 2-D `arrays` (same dtype and width) as one view (sum of their rows, width),
    read-only unless `writeable`, when they lie back to back in memory, each C-contiguous; else
    None. Host or device arrays alike (the stand-in's and cupy's by their device addresses)."""
    a0 = arrays[0]
    if not all(a.flags.c_contiguous and a.ndim == 2 and a.shape[1] == a0.shape[1]
               and a.dtype == a0.dtype for a in arrays):
        return None
    for a, b in zip(arrays[:-1], arrays[1:]):
        if _address(a) + a.nbytes != _address(b):
            return None
    shape = (sum(a.shape[0] for a in arrays), a0.shape[1])
    if type(a0) is StandinArray:
        return StandinArray(np.lib.stride_tricks.as_strided(a0._a, shape, a0.strides,
                                                            writeable=writeable))
    if _is_cupy(a0):  # pragma: no cover - needs cupy
        import cupy  # a cupy array is in hand: cupy is loaded already

        return cupy.lib.stride_tricks.as_strided(a0, shape, a0.strides)
    return np.lib.stride_tricks.as_strided(a0, shape, a0.strides, writeable=writeable)


def synchronize(xp) -> None:
    """Wait until the device has done what was queued on it (the host: nothing to wait for)."""
    if getattr(xp, "__name__", "") == "cupy":  # pragma: no cover - needs cupy
        xp.cuda.get_current_stream().synchronize()


class HostStaging:
    """Host buffers through which a device's arrays reach MPI, and the copies in and out.

    On a GPU the buffers are page-locked (`cupyx.empty_pinned`) and the copies run on a copy
    stream of their own: a download waits for the compute stream's work so far, an upload is
    waited for by the compute stream's later work, so copies overlap compute. On the stand-in
    they are plain counted transfers; on the host no staging is needed (`needed` is False).
    Buffers are pooled by shape and dtype: `take` one, `give` it back when its message is done.
    """

    def __init__(self, xp):
        self.xp = xp
        self._free: dict[tuple, list] = {}
        self._made = 0  # bytes of host buffers made
        self._stream = None
        if getattr(xp, "__name__", "") == "cupy":  # pragma: no cover - needs cupy
            self._stream = xp.cuda.Stream(non_blocking=True)

    @property
    def needed(self) -> bool:
        return self.xp is not np

    @property
    def nbytes(self) -> int:
        """Bytes of host buffers this staging has made (pinned on a GPU)."""
        return self._made

    def take(self, shape, dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        free = self._free.get(key)
        if free:
            return free.pop()
        if self._stream is not None:  # pragma: no cover - needs cupy
            import cupyx  # a GPU rank: cupy is loaded already

            b = cupyx.empty_pinned(key[0], dtype)
        else:
            b = np.empty(key[0], dtype)
        self._made += b.nbytes
        return b

    def give(self, buf: np.ndarray) -> None:
        self._free.setdefault((buf.shape, buf.dtype.str), []).append(buf)

    def download(self, a) -> np.ndarray:
        """A taken host buffer holding device array `a`, complete when this returns (so it may
        go to MPI at once)."""
        host = self.take(a.shape, a.dtype)
        if self._stream is not None:  # pragma: no cover - needs cupy
            self._stream.wait_event(self.xp.cuda.get_current_stream().record())
            a.get(stream=self._stream, out=host)
            self._stream.synchronize()
            return host
        return a.get(out=host)

    def upload(self, host: np.ndarray, a) -> None:
        """Copy host buffer `host` into device array `a`; the compute stream's later work
        waits for the copy. The copy has read `host` when this returns, so the buffer may go
        back to the pool (and to MPI) at once."""
        if self._stream is not None:  # pragma: no cover - needs cupy
            a.set(host, stream=self._stream)
            self.xp.cuda.get_current_stream().wait_event(self._stream.record())
            self._stream.synchronize()
            return
        a.set(host)
