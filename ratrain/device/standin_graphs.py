"""The stand-in's graphs: a call's device operations captured, and replays checked against them.

    graph, result = capture(fn)     fn() run once, each device operation's signature recorded
    graph.launch()                  fn() run again, checked operation by operation

What `device.graphs` runs a CUDA graph's capture as on the stand-in (`device.standin` hands
it each operation through `did`, and refuses while capturing what cupy refuses).
`fn` runs once while each device operation's signature is recorded: its name, each array it
reads or writes (one the call made itself, named by the operation that made it, or any other by
its address and layout) and each host scalar it is given, by value. `StandinGraph.launch()`, a
replay, runs `fn` again, checks each operation against the capture and refuses the first that
differs (`CaptureError`: a scalar that changed, an array now elsewhere, another sequence), so
what passes is exactly what a card would replay; its results are written into the arrays the
capture returned (the graph's), and it counts as one operation (a graph launch), its
operations in `COUNTS["graph_ops"]`. A call's own arrays live as long as the call, as a card's
private pool reuses them. What cupy refuses while a stream captures is refused in a capture: a
host sync (`float(a)`, `.get()`, `.item()`), an upload from host memory, and cuBLAS through
cupy (`matmul`, `dot`, `einsum`, ...: cupy's cuBLAS wrappers refuse a capturing stream).
"""

from __future__ import annotations

import weakref

import numpy as np

from ratrain.device.standin import COUNTS, CaptureError, StandinArray, _Capture


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns `a`'s memory (itself, or the base its views come from)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _arrays(v):
    """The numpy arrays in a structure of arguments or results (stand-in arrays unwrapped)."""
    if type(v) is StandinArray:
        yield v._a
    elif isinstance(v, np.ndarray):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _arrays(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _arrays(x)


_SCALARS = (int, float, complex, bool, str, bytes, type(None), np.generic, np.dtype, type)


class _Trace:
    """One run of a captured call: each operation's signature (its name; each array argument
    as a temporary of the call, by the operation that made it, or by its address; every host
    scalar by value) recorded at capture, compared on a replay."""

    def __init__(self, graph, replay: bool):
        self.graph, self.replay = graph, replay
        self.temps: dict = {}  # id(root) -> (key, weak reference to the root)
        self.k = 0
        self.ops = 0

    def _where(self, a: np.ndarray) -> tuple:
        root = _root(a)
        t = self.temps.get(id(root))
        at = t[0] if t is not None and t[1]() is root else ("at", _data(root))
        return (at, _data(a) - _data(root), a.shape, a.strides, a.dtype.str)

    def _desc(self, v):
        if type(v) is StandinArray:
            v = v._a
        if isinstance(v, np.ndarray):
            return self._where(v)
        if isinstance(v, (list, tuple)):
            return tuple(self._desc(x) for x in v)
        if isinstance(v, dict):
            return tuple((k, self._desc(x)) for k, x in v.items())
        if isinstance(v, slice):
            return ("slice", self._desc(v.start), self._desc(v.stop), self._desc(v.step))
        if isinstance(v, _SCALARS) or v is Ellipsis:
            return v if not isinstance(v, float) or v == v else "nan"
        return type(v).__qualname__  # a kernel, a backend: what it is, not where

    def alloc(self, made) -> None:
        """An allocation (no operation): its arrays are the call's temporaries."""
        self.op("(alloc)", (), made, 0)

    def op(self, name, inputs, made, ops) -> None:
        sig = (name, self._desc(inputs), ops)
        seen = {id(_root(a)) for a in _arrays(inputs)}
        for i, a in enumerate(_arrays(made)):
            root = _root(a)
            if id(root) not in seen:
                self.temps[id(root)] = (("temp", self.k, i), weakref.ref(root))
        if self.replay:
            sigs = self.graph.sigs
            if self.k >= len(sigs) or sigs[self.k] != sig:
                want = sigs[self.k] if self.k < len(sigs) else "(the capture ended)"
                raise CaptureError(f"a replay of a graph differs from its capture at operation "
                                   f"{self.k} ({name}): {_first_difference(want, sig)}; a graph "
                                   "replays what it captured, with the same arrays and host "
                                   "scalars")
        else:
            self.graph.sigs.append(sig)
        self.k += 1
        self.ops += ops


def _data(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _is_place(v) -> bool:
    """Whether a signature's element says where an array is (`_Trace._where`'s first)."""
    return isinstance(v, tuple) and v[:1] in (("at",), ("temp",))


def _first_difference(want, got) -> str:
    """Where two signatures first differ, in words."""
    if _is_place(want) and _is_place(got):
        return f"an array captured {_said(want)}, now {_said(got)}"
    if isinstance(want, tuple) and isinstance(got, tuple) and len(want) == len(got):
        for w, g in zip(want, got):
            if w != g:
                return _first_difference(w, g)
    return f"captured {want!r}, now {got!r}"


def _said(where: tuple) -> str:
    return (f"at {where[1]:#x}" if where[0] == "at" else
            f"as the call's own (made by its operation {where[1]})")


def _copy_into(dst, src) -> None:
    """A replay's results into the arrays its capture made (the graph's, which its callers
    hold): arrays element by element, through lists, tuples, dicts and objects' fields."""
    if type(dst) is StandinArray:
        dst = dst._a
    if type(src) is StandinArray:
        src = src._a
    if isinstance(src, np.generic):  # a reduction's scalar, which the device made a 0-d array
        src = np.asarray(src)
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        if dst.__array_interface__ != src.__array_interface__:
            np.copyto(dst, src)
    elif isinstance(dst, (list, tuple)) and isinstance(src, (list, tuple)):
        for d, r in zip(dst, src):
            _copy_into(d, r)
    elif isinstance(dst, dict) and isinstance(src, dict):
        for k in dst:
            _copy_into(dst[k], src[k])
    elif hasattr(dst, "__dict__") and type(dst) is type(src):
        for k, d in vars(dst).items():
            _copy_into(d, vars(src)[k])


class StandinGraph:
    """A captured call of the stand-in (see the module): its operations' signatures, the call
    and what it returned (the graph's arrays)."""

    def __init__(self, fn):
        self.fn = fn
        self.sigs: list = []
        self.ops = 0
        self.result = None

    def _run(self, replay: bool):
        if _Capture.trace is not None:
            raise CaptureError("a capture or a launch inside a capture or a replay")
        trace = _Capture.trace = _Trace(self, replay)
        try:
            result = self.fn()
        finally:
            _Capture.trace = None
        if replay and trace.k != len(self.sigs):
            raise CaptureError(f"a replay of a graph ran {trace.k} operations, its capture "
                               f"{len(self.sigs)}")
        return result, trace.ops

    def launch(self) -> None:
        """Replay: the call run again, each operation checked against the capture, its results
        written into the graph's arrays; counted as one operation (a graph launch)."""
        result, _ = self._run(replay=True)
        _copy_into(self.result, result)
        self._launched()

    def _launched(self) -> None:
        """One launch counted: one host operation, the graph's operations the device's."""
        COUNTS["ops"] += 1
        COUNTS["graphs"] += 1
        COUNTS["graph_ops"] += self.ops


def capture(fn):
    """(graph, fn()): `fn` run once while its device operations are recorded (see the module),
    counted as the graph's first launch."""
    graph = StandinGraph(fn)
    graph.result, graph.ops = graph._run(replay=False)
    # what a card does next: the graph launched once (here its operations already ran)
    COUNTS["captures"] += 1
    graph._launched()
    return graph, graph.result


__all__ = ["StandinGraph", "capture"]
