"""How a device kernel is loaded, checked and launched: numba-cuda imported on first use, the
argument checks, block and grid sizes, the launch on cupy's stream or in numba-cuda's simulator,
and the device functions kernels share. The kernels themselves are `exec.devkernels` (the
layers' norms, activations and rotations, AdamW, the gradient norm) and `exec.devloss` (the
head's cross-entropy).

A kernel module's public function takes the array module `xp` (cupy on a GPU; numpy or the
stand-in under the simulator, `NUMBA_ENABLE_CUDASIM=1`, which runs the same kernels on a CPU,
in the tests). It checks its arrays (`check`), allocates its outputs with `xp.empty` (cupy's
pool owns them) or checks the caller's (`out_array`), and launches through `launch`. On a GPU
that is cupy's current stream, the arrays passed by their CUDA array interface (no copy, no
host sync; a bfloat16 array as its bits, which kernels read and write through `ld` and `st`).
Under the simulator host arrays are passed in place (views and aliases included),
and each launch on the stand-in's arrays is counted as one device operation
(`device.standin.COUNTS`, what `benchmarks/launches.py` reports).

Block size: `threads` per block, a power of two (on a GPU 256; 32 under the simulator, one
Python thread per CUDA thread). A kernel module compiles its kernels once per block size, as
`device_functions` does.

A kernel module keeps `cuda` (and the scalar types it uses) as module globals, set from
`load()` when it compiles: the simulator swaps the `cuda` global of a kernel's own module for
its per-thread stand-in.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

from ratrain.device import kind_of, storage_of
from ratrain.device.standin import StandinArray, did
from ratrain.exec.kernels import BF16

# numba.cuda and its scalar types, set by `load()`: module globals, as the simulator swaps the
# `cuda` global of a kernel's module for its per-thread stand-in
cuda = float32 = float64 = None
_SIM = None  # whether numba.cuda is the simulator (set by `load()`)

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
TAKES = (F32, F16, BF16)  # what the kernels load and store (a bfloat16 array as its bits)
GPU_THREADS = 256  # threads per block on a GPU (8 warps)
SIM_THREADS = 32  # under the simulator: one Python thread each
MAX_BLOCKS = 4096  # grid-stride kernels: at most this many blocks, each looping over the rest
EXP_MAX = 88.72283935546875  # the smallest float32 whose expf overflows (log(FLT_MAX) < it)


def numpy_compat(numpy=np) -> list[str]:
    """Aliases numba-cuda's typing registry still names and numpy has removed, put back (the
    names put back): numpy 2.5 dropped `row_stack` (= vstack), and numba-cuda (to 0.30.4)
    registers an overload of it when it compiles its first kernel, failing on a GPU host with
    numpy 2.5 (seen on the device image's numpy 2.5.2, 2026-11-28). Upstream: NVIDIA/numba-cuda
    issue 907, not to be fixed there (the package is in maintenance mode); numba 0.67 guards
    its own copy."""
    added = []
    if not hasattr(numpy, "row_stack"):
        numpy.row_stack = numpy.vstack
        added.append("row_stack")
    return added


@functools.cache
def load():
    """numba.cuda (numba-cuda's, not numba's deprecated built-in target), imported on first use;
    ImportError naming the package when it is missing."""
    global cuda, float32, float64, _SIM
    numpy_compat()
    try:
        # numba-cuda is optional: only GPU hosts and the tests (the test extra) have it
        import numba.cuda as numba_cuda
    except ImportError as e:
        raise ImportError(f"ratrain.exec.devkernels needs numba-cuda (pip install numba-cuda; "
                          f"the test extra installs it): {e}") from e
    if getattr(numba_cuda, "implementation", "") != "NVIDIA":
        raise ImportError("ratrain.exec.devkernels needs numba-cuda (pip install numba-cuda): "
                          "only numba's deprecated built-in numba.cuda is installed")
    try:  # numba-cuda's own config (recent releases), else numba's
        from numba.cuda.core import config
    except ImportError:
        from numba.core import config
    cuda, float32, float64 = numba_cuda, numba_cuda.float32, numba_cuda.float64
    _SIM = bool(config.ENABLE_CUDASIM)
    if not _SIM:
        _compiled_ld_st(numba_cuda)
    return numba_cuda


@functools.cache
def why_off() -> str:
    """Why these kernels cannot run here ("" when numba-cuda imports)."""
    try:
        load()
    except ImportError as e:
        return str(e)
    return ""


def simulated() -> bool:
    """Whether kernels run in numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1 when numba.cuda was
    first imported)."""
    load()
    return _SIM


# --------------------------------------------------------------------------------------------
# Loads and stores: a float16 or float32 element as itself, a bfloat16 one through its bits
# --------------------------------------------------------------------------------------------
# `launch` passes a bfloat16 array as its uint16 view (numba-cuda has no bfloat16 array type,
# and its `cuda.bf16` intrinsics are stubs in the simulator): `ld` widens those bits exactly
# (bits << 16), `st` rounds to nearest even (a NaN becomes the quiet NaN of its sign), as
# ml_dtypes does for finite values and the host's `fused.cast` does for all. Kernels load
# every element they may be given in 16 bits with `ld` and store with `st`. In the simulator
# these Python functions run as they are; on a GPU their overloads (`_compiled_ld_st`) compile
# to a shift and a bit move (`mov.b32`).


def ld(v):
    """fp32 of a loaded element (a uint16: a bfloat16's bits)."""
    if isinstance(v, np.uint16):
        return (np.uint32(v) << np.uint32(16)).view(np.float32)
    return np.float32(v)


def _bf16_bits(b: int) -> int:
    """The bfloat16 bits of the float32 bits `b`: rounded to nearest even, a NaN the quiet NaN
    of its sign."""
    if b & 0x7FFFFFFF > 0x7F800000:
        return ((b >> 16) & 0x8000) | 0x7FC0
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


def st(a, i, v):
    """a[i] = v (fp32), rounded into a's dtype (a uint16 array: bfloat16 bits)."""
    if a.dtype == np.uint16:
        a[i] = _bf16_bits(int(np.float32(v).view(np.uint32)))
    else:
        a[i] = v


def _compiled_ld_st(numba_cuda) -> None:
    """`ld` and `st` for compiled kernels (numba-cuda's `overload`: chosen by the element's
    type, inlined)."""
    from numba.core import types  # numba's, present wherever numba-cuda is
    from numba.cuda.extending import overload

    u16, u32, f32 = numba_cuda.uint16, numba_cuda.uint32, numba_cuda.float32

    @overload(ld, target="cuda", inline="always")
    def _ld(v):
        if v == types.uint16:
            def bf16(v):
                t = numba_cuda.local.array(1, u32)
                t[0] = u32(v) << u32(16)
                return t.view(np.float32)[0]
            return bf16
        return lambda v: f32(v)

    @overload(st, target="cuda", inline="always")
    def _st(a, i, v):
        if a.dtype == types.uint16:
            def bf16(a, i, v):
                t = numba_cuda.local.array(1, f32)
                t[0] = v
                b = t.view(np.uint32)[0]
                if b & u32(0x7FFFFFFF) > u32(0x7F800000):
                    a[i] = u16(((b >> u32(16)) & u32(0x8000)) | u32(0x7FC0))
                else:
                    a[i] = u16((b + u32(0x7FFF) + ((b >> u32(16)) & u32(1))) >> u32(16))
            return bf16

        def same(a, i, v):
            a[i] = v
        return same


def bits(a):
    """A bfloat16 array (numpy's or cupy's) as its uint16 view, what the kernels take; any
    other argument itself."""
    return a.view(np.uint16) if getattr(a, "dtype", None) == BF16 else a


# --------------------------------------------------------------------------------------------
# Launch: one helper for every kernel
# --------------------------------------------------------------------------------------------


def check(xp, *arrays) -> None:
    """One line on a wrong array module or dtype, before any launch."""
    sim = simulated()
    if sim and kind_of(xp) == "gpu":
        raise TypeError("devkernels under the simulator (NUMBA_ENABLE_CUDASIM=1) take numpy "
                        "or stand-in arrays: pass xp=numpy")
    if not sim and xp is np:
        raise TypeError("devkernels on a GPU take cupy arrays: pass xp=cupy (numpy arrays run "
                        "only under NUMBA_ENABLE_CUDASIM=1)")
    for a in arrays:
        if a.dtype not in TAKES:
            raise TypeError(f"devkernels compute float32, float16 and bfloat16 arrays, not "
                            f"{a.dtype}: float64 runs on ratrain.exec.kernels (the reference)")


def block_threads(threads, gpu=GPU_THREADS) -> int:
    if threads is None:
        return SIM_THREADS if simulated() else gpu
    if not (1 <= threads <= 1024 and threads & (threads - 1) == 0):
        raise ValueError(f"threads={threads}: a block is a power of two from 1 to 1024 threads")
    return threads


def grid(n: int, threads: int) -> int:
    """Blocks of a grid-stride kernel over n elements."""
    return max(1, min(-(-n // threads), MAX_BLOCKS))


@functools.lru_cache(maxsize=16)
def _stream(ptr: int):
    return cuda.external_stream(ptr)  # wraps cupy's stream; never owns or destroys it


def launch(kernel, blocks: int, threads: int, xp, *args) -> None:
    """kernel[blocks, threads](*args) on cupy's current stream (a GPU), or in the simulator."""
    if simulated():
        from numba.cuda.simulator.cudadrv.devicearray import (  # the simulator only
            FakeCUDAArray,
        )

        # its device arrays wrap numpy arrays in place (plain numpy arguments would be copied
        # in and back, which loses writes through aliases and refuses strided views); a
        # stand-in array's values are a numpy array (`storage_of`)
        held = [storage_of(a) for a in args]
        held = [h if h is None else bits(h) for h in held]
        kernel[blocks, threads](*[a if h is None else FakeCUDAArray(h) for a, h in zip(args, held)])
        if any(type(a) is StandinArray for a in args):  # a launch of the stand-in's device
            did(getattr(kernel, "__name__", "kernel"),
                (blocks, threads, [a if h is None else h for a, h in zip(args, held)]))
        return
    stream = _stream(xp.cuda.get_current_stream().ptr)
    # ordered on the same stream as the arrays' producers: no host sync (sync=False)
    args = [cuda.as_cuda_array(bits(a), sync=False)
            if hasattr(a, "__cuda_array_interface__") else a for a in args]
    kernel[blocks, threads, stream](*args)


def rows(a):
    """a (..., C) as (R, C) (a view when a is contiguous; a copy of an input otherwise)."""
    return a.reshape(-1, a.shape[-1])


def out_array(out, shape, dtype, xp, any_strides=False):
    """`out` (checked: shape, float32/16, C-contiguous unless the kernel takes `any_strides`, so
    that a 2-D view of it writes through) or a new `dtype` array."""
    if out is None:
        return xp.empty(shape, dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype not in TAKES:
        raise ValueError(f"out: shape {tuple(out.shape)} {out.dtype}, expected {tuple(shape)} "
                         "float32, float16 or bfloat16")
    if not (any_strides or out.flags.c_contiguous):
        raise ValueError("out: must be C-contiguous (a view of it is written)")
    return out


def two_d(name, a):
    if a.ndim != 2:
        raise ValueError(f"{name}: a 2-D (N, F) array (any strides), got shape {tuple(a.shape)}")
    return a


# --------------------------------------------------------------------------------------------
# Device functions the kernels share, compiled once per block size
# --------------------------------------------------------------------------------------------


@functools.cache
def device_functions(TPB: int) -> SimpleNamespace:
    """The device functions the kernels share, for blocks of TPB threads: fexp, flog, fmax,
    block_reduce (kernels of other modules may call them too)."""
    load()
    inf = math.inf

    @cuda.jit(device=True)
    def fexp(v):  # expf; the simulator's math.exp would raise where expf gives inf
        if v >= float32(EXP_MAX):
            return float32(inf)
        return float32(math.exp(v))

    @cuda.jit(device=True)
    def flog(v):  # logf; the simulator's math.log would raise at 0
        if v == float32(0.0):
            return float32(-inf)
        return float32(math.log(v))

    @cuda.jit(device=True)
    def fmax(a, b):  # max that keeps a NaN from either side (numpy's max does)
        if a > b or a != a:
            return a
        return b

    @cuda.jit(device=True)
    def block_reduce(sh, t, v, take_max):
        """The sum (or the max) of every thread's v by a shared-memory tree; every thread gets
        it. Called by all the block's threads alike."""
        sh[t] = v
        cuda.syncthreads()
        s = TPB // 2
        while s > 0:
            if t < s:
                if take_max:
                    sh[t] = fmax(sh[t], sh[t + s])
                else:
                    sh[t] += sh[t + s]
            cuda.syncthreads()
            s //= 2
        total = sh[0]
        cuda.syncthreads()  # all have read sh[0] before the next tree writes sh
        return total

    return SimpleNamespace(fexp=fexp, flog=flog, fmax=fmax, block_reduce=block_reduce)


__all__ = ["EXP_MAX", "F16", "F32", "GPU_THREADS", "MAX_BLOCKS", "SIM_THREADS", "TAKES", "bits",
           "block_threads", "check", "device_functions", "grid", "launch", "ld", "load",
           "numpy_compat", "out_array", "rows", "simulated", "st", "two_d", "why_off"]
