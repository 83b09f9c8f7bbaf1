"""A CPU stand-in for a device array module: numpy underneath, cupy's rules on top.

    from ratrain.device.standin import standin as xp
    a = xp.zeros(4, xp.float32)          # a "device" array (StandinArray)
    np.asarray(a)                        # TypeError, as cupy raises
    a + np.ones(4)                       # TypeError: a host array in a device operation
    h = a.get(); d = xp.asarray(h)       # the explicit transfers: what every boundary must use

Every array the module makes is a `StandinArray` wrapping a numpy array. It refuses what cupy
refuses: implicit conversion to a host array (`np.asarray`, `np.array`, the buffer protocol),
host arrays mixed into its functions, ufuncs, operators and item assignment, and reductions
return 0-d arrays, not host scalars. It allows what cupy allows: `np.*` ufuncs and functions on
device arrays (they dispatch to the device, `__array_ufunc__` / `__array_function__`),
`float(a)`, `int(a)`, `bool(a)`, `a.item()`, `a.tolist()` (host syncs), `a.get()`,
`xp.asnumpy(a)` (downloads) and `xp.asarray(host)`, `a.set(host)` (uploads). Each host sync
and transfer is counted (`COUNTS`), so a test can hold a step to the syncs it needs, and so is
each device operation (`COUNTS["ops"]`: a call that would queue device work on cupy, a ufunc,
operator, reduction, cast, copy, fill, gather or scatter; not a view, nor an `empty`), about a
kernel launch each (a cupy reduction may launch two), the host's cost of a step on a card that
`benchmarks/launches.py` counts; those that convert between dtypes (`astype`, `copyto` and an
assignment across dtypes) are also counted as casts (`COUNTS["casts"]`). The
arithmetic is numpy's, so a run on the stand-in is bitwise the numpy run: the CPU suite runs
every device code path, and a missing transfer fails there as it would on a GPU.

Capture: while `device.standin_graphs.capture` records a call, `did` hands each operation to
its trace, and what cupy refuses while a stream captures is refused (`CaptureError`): a host
sync (`float(a)`, `.get()`, `.item()`), an upload from host memory, and cuBLAS through cupy
(`matmul`, `dot`, `einsum`, ...: cupy's cuBLAS wrappers refuse a capturing stream).
"""

from __future__ import annotations

import collections
import types

import ml_dtypes
import numpy as np

COUNTS: collections.Counter = collections.Counter()  # syncs, downloads, uploads, ops; graphs

# cupy's cuBLAS entries (refused under capture, as cupy's wrappers refuse them)
_CUBLAS = frozenset({"matmul", "dot", "vdot", "inner", "tensordot", "einsum"})


class CaptureError(RuntimeError):
    """What a capturing stream refuses (a host sync, an upload, cupy's cuBLAS)."""


class _Capture:
    """The stand-in's capture state: the trace of the graph being captured or replayed (None:
    neither; `trace.graph` says which graph, `trace.replay` whether it is a replay)."""

    trace = None


def _capturing() -> bool:
    return _Capture.trace is not None and not _Capture.trace.replay


def _refuse_captured(what: str) -> None:
    if _capturing():
        raise CaptureError(f"{what} while a stream captures a graph: cupy refuses it "
                           "(cudaErrorStreamCaptureUnsupported); keep it outside the captured "
                           "call")


def did(name: str, inputs, made=None, ops: int = 1) -> None:
    """Count `ops` device operations `name` just queued on `inputs` (its arguments, arrays and
    host scalars), making `made` (None: it wrote in place); `ops` 0: none. Within a capture or
    a replay they are the graph's, and their signature is recorded or checked (see the
    module)."""
    if not ops:
        return
    if _Capture.trace is not None:
        _Capture.trace.op(name, inputs, made, ops)
    else:
        COUNTS["ops"] += ops


_REFUSED = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly.")
_UPLOADERS = frozenset({"asarray", "array", "asanyarray", "ascontiguousarray"})
# calls that queue no device work: allocation, shape and dtype queries; and calls that may return
# a view or their input (an op only when they copy: a reshape of a non-contiguous array, a cast
# to another dtype)
_NO_WORK = frozenset({"empty", "empty_like", "shape", "ndim", "size", "result_type", "dtype",
                      "broadcast_shapes", "iinfo", "finfo", "can_cast", "promote_types"})
_ALLOCATORS = frozenset({"empty", "empty_like"})  # a capture's temporaries, though no work
_CASTS = frozenset({"astype", "copyto"})  # a cast where the dtype changes (COUNTS["casts"])
_VIEWS = frozenset({"reshape", "transpose", "swapaxes", "squeeze", "ravel", "view",
                    "broadcast_to", "expand_dims", "moveaxis", "atleast_1d", "atleast_2d",
                    "split", "array_split", "astype", "asarray", "ascontiguousarray"})


def _op(name: str, result, inputs, made=None, args=()) -> None:
    """Count one device operation, unless `name` queues no work or made a view of an input
    (`made`: the device array it made, `args` its arguments: `did`)."""
    if name in _NO_WORK:
        if name in _ALLOCATORS and _Capture.trace is not None:
            _Capture.trace.alloc(made)
        return
    if name in _VIEWS:
        res = result if isinstance(result, (list, tuple)) else (result,)
        base = [_unwrap(a) for a in inputs if type(a) is StandinArray]
        if all(isinstance(r, np.ndarray) and any(np.may_share_memory(r, b) for b in base)
               for r in res):
            return
    if name in _CASTS:  # astype(this) -> made; copyto(dst, src)
        given = [x for x in inputs if x is not None]  # (this, *args); this None: xp.copyto
        dst, src = (made, given[0]) if name == "astype" else given[:2]
        if _dtype_of(dst) != _dtype_of(src):
            COUNTS["casts"] += 1
    did(name, args, made)


def _dtype_of(v):
    return getattr(v, "dtype", None)


def _unwrap(v, host_ok: bool = False):
    """The numpy value behind `v` (recursively through lists, tuples and dicts); a host array
    where the device needs its own is refused as cupy refuses it."""
    if type(v) is StandinArray:
        return v._a
    if isinstance(v, np.ndarray):
        if not host_ok:
            raise TypeError(f"Unsupported type {type(v)}: a host (numpy) array passed to a "
                            "device operation; move it with xp.asarray first")
        _refuse_captured("an upload from host memory")
        COUNTS["uploads"] += 1
        return v
    if isinstance(v, (list, tuple)):
        return type(v)(_unwrap(x, host_ok) for x in v)
    if isinstance(v, dict):
        return {k: _unwrap(x, host_ok) for k, x in v.items()}
    return v


def _wrap(v):
    """Device arrays for numpy results; numpy scalars become 0-d device arrays (cupy's
    reductions return arrays, not host scalars)."""
    if isinstance(v, np.ndarray):
        return StandinArray(v)
    if isinstance(v, np.generic):
        return StandinArray(np.asarray(v))
    if isinstance(v, tuple):
        return tuple(_wrap(x) for x in v)
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    return v


_HALVES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))  # cupy's bfloat16: ml_dtypes'


def _matmul(a, b, *args, **kwargs):
    """np.matmul as a GPU does it: fp16 x fp16 (bf16 x bf16) accumulates in fp32 and rounds the
    result to the operands' dtype once (cuBLAS's default for halves), instead of numpy's slow
    loops over halves (or ml_dtypes' float32 result)."""
    half = getattr(a, "dtype", None)
    if half in _HALVES and getattr(b, "dtype", None) == half:
        out = kwargs.pop("out", None)
        r = np.matmul(a.astype(np.float32), b.astype(np.float32), *args, **kwargs).astype(half)
        if out is not None:
            out[...] = r
            return out
        return r
    return np.matmul(a, b, *args, **kwargs)


def _device_call(f, host_ok: bool = False, name: str | None = None, this=None):
    name = name or getattr(f, "__name__", "call")
    if f is np.matmul:
        f = _matmul

    def call(*args, **kwargs):
        if name in _CUBLAS:
            _refuse_captured(f"cuBLAS through cupy ({name})")
        ua, uk = _unwrap(args, host_ok), _unwrap(kwargs, host_ok)
        r = f(*ua, **uk)
        made = _wrap(r)
        _op(name, r, (this, *args), made, (this, ua, uk))
        return made
    call.__name__ = getattr(f, "__name__", "call")
    call.__doc__ = getattr(f, "__doc__", None)
    return call


class _Ufunc:
    """A numpy ufunc that takes and makes device arrays (and refuses host arrays)."""

    def __init__(self, uf):
        self._uf = uf
        self.__name__ = uf.__name__

    def __call__(self, *args, **kwargs):
        return _device_call(self._uf)(*args, **kwargs)

    def __getattr__(self, name):  # reduce, accumulate, outer, at; nin, nout, identity
        attr = getattr(self._uf, name)
        return _device_call(attr) if callable(attr) else attr


def _binary(uf, reflected: bool = False):
    def op(self, other):
        if uf is _matmul:
            _refuse_captured("cuBLAS through cupy (matmul)")
        a, o = self._a, _unwrap(other)
        made = _wrap(uf(o, a) if reflected else uf(a, o))
        did(uf.__name__, (a, o, reflected), made)
        return made
    return op


def _inplace(uf):
    def op(self, other):
        a, o = self._a, _unwrap(other)
        uf(a, o, out=a)
        did(uf.__name__, (a, o))
        return self
    return op


def _unary(uf):
    def op(self):
        a = self._a
        made = _wrap(uf(a))
        did(uf.__name__, (a,), made)
        return made
    return op


def _sync(conv):
    def op(self):
        _refuse_captured("a host sync")
        COUNTS["syncs"] += 1
        return conv(self._a)
    return op


# the ndarray methods cupy has (others, like tofile or tobytes, are missing there too)
_METHODS = frozenset([
    "all", "any", "argmax", "argmin", "argsort", "astype", "clip", "conj", "copy", "cumsum",
    "dot", "fill", "flatten", "max", "mean", "min", "nonzero", "prod", "ravel", "repeat",
    "reshape", "round", "squeeze", "std", "sum", "swapaxes", "take", "transpose", "var", "view",
])


class StandinArray:
    """A device array of the stand-in: numpy storage, cupy's boundary (see the module)."""

    __slots__ = ("_a",)
    __array_priority__ = 100.0
    __hash__ = None

    def __init__(self, a: np.ndarray):
        self._a = a

    # ---- what cupy refuses ----
    def __array__(self, *args, **kwargs):
        raise TypeError(_REFUSED)

    # ---- explicit transfers ----
    def get(self, stream=None, order="C", out=None):
        _refuse_captured("a download (a host sync)")
        COUNTS["syncs"] += 1
        COUNTS["downloads"] += 1
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.shape != self._a.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self._a.shape}, new shape: {arr.shape}")
        _refuse_captured("an upload from host memory")
        COUNTS["uploads"] += 1
        self._a[...] = arr

    # ---- host syncs cupy allows ----
    __float__ = _sync(float)
    __int__ = _sync(int)
    __complex__ = _sync(complex)
    __bool__ = _sync(bool)
    __index__ = _sync(lambda a: a.__index__())

    def item(self, *args):
        _refuse_captured("a host sync")
        COUNTS["syncs"] += 1
        return self._a.item(*args)

    def tolist(self):
        _refuse_captured("a host sync")
        COUNTS["syncs"] += 1
        return self._a.tolist()

    def __repr__(self):
        return "standin." + repr(self._a)

    __str__ = __repr__

    # ---- the protocols by which np.* reaches the device ----
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        f = _matmul if ufunc is np.matmul and method == "__call__" else getattr(ufunc, method)
        if ufunc is np.matmul:
            _refuse_captured("cuBLAS through cupy (matmul)")
        ui, uk = _unwrap(inputs), _unwrap(kwargs)
        made = _wrap(f(*ui, **uk))
        did(f"{ufunc.__name__}.{method}", (ui, uk), made)
        return made

    def __array_function__(self, func, types, args, kwargs):
        if func.__name__ in _UPLOADERS:
            raise TypeError(_REFUSED)
        if func.__name__ in _CUBLAS:
            _refuse_captured(f"cuBLAS through cupy ({func.__name__})")
        ua, uk = _unwrap(args), _unwrap(kwargs)
        r = func(*ua, **uk)
        made = _wrap(r)
        _op(func.__name__, r, args, made, (ua, uk))
        return made

    # ---- attributes ----
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: StandinArray(self._a.T))
    real = property(lambda self: StandinArray(self._a.real))
    imag = property(lambda self: StandinArray(self._a.imag))

    @property
    def base(self):
        b = self._a.base
        return None if b is None else StandinArray(b)

    def __getattr__(self, name):
        if name in _METHODS:
            return _device_call(getattr(self._a, name), name=name, this=self)
        raise AttributeError(f"'cupy.ndarray' (stand-in) has no attribute {name!r}")

    # ---- indexing ----
    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(x) for x in self._a)

    def __getitem__(self, key):
        a, k = self._a, _unwrap(key)
        r = a[k]
        made = _wrap(r)
        if isinstance(r, np.ndarray) and r.size and not np.may_share_memory(r, a):
            did("getitem", (a, k), made)  # a gather (advanced indexing); a basic index: a view
        return made

    def __setitem__(self, key, value):
        k, v = _unwrap(key), _unwrap(value)
        if type(value) is StandinArray and np.may_share_memory(v, self._a):
            t = self._a[k]
            if (t.__array_interface__["data"][0] == v.__array_interface__["data"][0]
                    and t.shape == v.shape and t.strides == v.strides):
                return  # `a[i] += b` stores the view back into itself: cupy skips it
        self._a[k] = v
        if isinstance(v, np.ndarray) and v.dtype != self._a.dtype:
            COUNTS["casts"] += 1  # an assignment across dtypes: a cast
        did("setitem", (self._a, k, v))

    # ---- operators (numpy's ufuncs on the storage; host arrays refused) ----
    __add__, __radd__ = _binary(np.add), _binary(np.add, True)
    __sub__, __rsub__ = _binary(np.subtract), _binary(np.subtract, True)
    __mul__, __rmul__ = _binary(np.multiply), _binary(np.multiply, True)
    __truediv__, __rtruediv__ = _binary(np.true_divide), _binary(np.true_divide, True)
    __floordiv__, __rfloordiv__ = _binary(np.floor_divide), _binary(np.floor_divide, True)
    __mod__, __rmod__ = _binary(np.remainder), _binary(np.remainder, True)
    __pow__, __rpow__ = _binary(np.power), _binary(np.power, True)
    __matmul__, __rmatmul__ = _binary(_matmul), _binary(_matmul, True)
    __and__, __rand__ = _binary(np.bitwise_and), _binary(np.bitwise_and, True)
    __or__, __ror__ = _binary(np.bitwise_or), _binary(np.bitwise_or, True)
    __xor__, __rxor__ = _binary(np.bitwise_xor), _binary(np.bitwise_xor, True)
    __lshift__, __rshift__ = _binary(np.left_shift), _binary(np.right_shift)
    __eq__, __ne__ = _binary(np.equal), _binary(np.not_equal)
    __lt__, __le__ = _binary(np.less), _binary(np.less_equal)
    __gt__, __ge__ = _binary(np.greater), _binary(np.greater_equal)
    __iadd__, __isub__ = _inplace(np.add), _inplace(np.subtract)
    __imul__, __itruediv__ = _inplace(np.multiply), _inplace(np.true_divide)
    __ipow__, __imod__ = _inplace(np.power), _inplace(np.remainder)
    __iand__, __ior__ = _inplace(np.bitwise_and), _inplace(np.bitwise_or)
    __neg__, __pos__ = _unary(np.negative), _unary(np.positive)
    __abs__, __invert__ = _unary(np.absolute), _unary(np.invert)


class _Module(types.ModuleType):
    """The stand-in's `xp`: numpy's namespace, whose functions take and make device arrays."""

    ndarray = StandinArray

    def __getattr__(self, name):
        attr = getattr(self.__dict__.get("_np", np), name)
        if isinstance(attr, np.ufunc):
            return _Ufunc(attr)
        if isinstance(attr, types.ModuleType):  # random, linalg, fft
            sub = _Module(f"{self.__name__}.{name}")
            sub._np = attr
            return sub
        if callable(attr) and not isinstance(attr, type):
            return _device_call(attr, host_ok=name in _UPLOADERS, name=name)
        return attr  # dtypes, scalar types, constants, finfo/iinfo


def _asnumpy(a, stream=None, order="C", out=None):
    if type(a) is StandinArray:
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)  # a host array or scalar stays where it is


def _get_array_module(*args):
    return standin if any(type(a) is StandinArray for a in args) else np


standin = _Module("standin", __doc__)
standin.asnumpy = _asnumpy
standin.get_array_module = _get_array_module

__all__ = ["COUNTS", "CaptureError", "StandinArray", "did", "standin"]
