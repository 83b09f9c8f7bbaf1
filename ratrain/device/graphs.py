"""A device's graphs: a call's device operations captured once, replayed by one host launch.

    graph, result = capture(xp, fn)    fn() run once, its device operations captured
    graph.launch()                     the same operations again, on the same memory
    graph.ops                          how many device operations one launch runs
    where(a)                           what a replay needs unchanged of an array

A replay runs the operations as captured: on the same arrays (addresses are baked in), with the
host scalars they were given then. So whatever a captured call reads must live at a fixed
address and be refilled before a launch, and nothing in it may wait for the host (a sync, a
download, an upload from host memory): the capture refuses those (`CaptureError`). The arrays a
call makes while captured belong to its graph for the graph's life (a card's private pool).

On the stand-in (`device.standin_graphs.capture`) the call runs while each operation's signature is
recorded, and a replay runs it again, refusing any operation that differs from its capture (a
changed scalar, an array elsewhere); its cupy rules hold: a host sync, an upload and cuBLAS
through cupy are refused while capturing. On a card
(cupy) a capture would queue the call on a non-blocking stream under `begin_capture` with a
private memory pool and launch the graph on the current stream once captured; it is not built:
`why_not` says so, and `exec.graphs` keeps a card's block calls eager.
"""

from __future__ import annotations

from ratrain.device.arrays import kind_of, storage_of
from ratrain.device.standin import CaptureError
from ratrain.device.standin_graphs import capture as _standin_capture

# why a card does not capture yet (`why_not`): what a captured block call needs first
_CARD = ("a card's capture is not built yet: its GEMMs go through cupy's cuBLAS binding, which "
         "refuses a capturing stream, and the GEMMs need a cuBLAS handle of ratrain's own "
         "(with its workspace) first")


def why_not(xp) -> str:
    """Why `xp` cannot capture graphs ("" when it can)."""
    kind = kind_of(xp)
    if kind == "standin":
        return ""
    if kind == "gpu":
        return _CARD
    return "the host (numpy) queues no device operations: a graph is a device's"


def where(a) -> tuple:
    """What a replay needs unchanged of an array: its memory (its address on the stand-in's
    storage, or on the card) and its layout."""
    h = storage_of(a)
    ptr = h.__array_interface__["data"][0] if h is not None else a.data.ptr
    return ptr, tuple(a.shape), tuple(a.strides), str(a.dtype)


def capture(xp, fn):
    """(graph, fn()): `fn` run once with its device operations captured (see the module)."""
    why = why_not(xp)
    if why:
        raise CaptureError(f"capture on {kind_of(xp)}: {why}")
    return _standin_capture(fn)


__all__ = ["CaptureError", "capture", "where", "why_not"]
