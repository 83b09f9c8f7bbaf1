"""A decoder layer's forward and backward as device graphs (`run.graphs`), eager the reference.

    graphs = BlockGraphs(ctx)
    y, cache = graphs.forward(block, slot, x, p, recompute)     layers.layer_forward's result
    dx = graphs.backward(block, slot, dy, cache, p, g)          layers.layer_backward's result

Each (layer, phase, slot) is captured once (`device.graphs`) and replayed by one host launch
after. A slot is a micro-batch in flight on the stage (`runtime.compute`: the lowest one free
when its forward starts, free again when its backward ends), so a slot's forward graph owns
the arrays its cache keeps until that micro-batch's backward, which its backward graph reads.

A replay runs on the addresses it was captured on. So a key is replayed only while what the
call reads is where it was: the block's weight views and gradients (their addresses are part
of the key), the cache its forward graph made (a backward's), and the input: a graph's output
of the same slot is handed on as is (the layer before's y, the layer after's dx), anything else
is copied into the graph's own input buffer (one operation). A key whose addresses changed is
run eagerly once more, then captured again. A key is captured on its second call, the first
eager (it loads kernels, builds cuDNN's plans and fills the memory pool outside the capture).
What a graph writes stays its own until its next replay: the stage hands copies of its outputs
to the links (`runtime.compute`).

Nothing in a layer's call depends on a step's scalars (learning rate, loss scale, clipping: the
optimizer's and the head's, which stay eager), so the scalars frozen into a capture stay
right; the host scalars a call does take (`recompute`, the shapes) are part of the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from ratrain.device import graphs as dgraphs
from ratrain.device import storage_of
from ratrain.exec import layers

GRAPHS = ("auto", "on", "off")


def why_not(ctx) -> str:
    """Why `ctx`'s layer calls cannot be captured ("" when they can)."""
    why = dgraphs.why_not(ctx.xp)
    if why:
        return why
    if not ctx.half_layout:
        return (f"precision={ctx.precision}: a device's fp32 GEMMs go through cupy's cuBLAS, which "
                "refuses a capturing stream (fp16 and bf16 GEMMs go through exec.devgemm)")
    attn = ctx.kernels.attention
    if not attn.captures:
        return (f"run.attention={attn.name} runs its GEMMs through cupy's cuBLAS, which refuses "
                "a capturing stream (cuDNN's attention captures)")
    return ""


def resolve(mode: str, ctx) -> bool:
    """Whether `run.graphs: mode` captures `ctx`'s layer calls: auto where they can be, on
    (one line where they cannot), off."""
    if mode not in GRAPHS:
        raise ValueError(f"run.graphs={mode!r}: expected one of {', '.join(GRAPHS)}")
    if mode == "off":
        return False
    why = why_not(ctx)
    if why and mode == "on":
        raise ValueError(f"run.graphs=on: {why}; set run.graphs=auto (or off)")
    return not why


def _where(a) -> tuple:
    """What a replay needs unchanged of an array: its memory and layout."""
    h = storage_of(a)
    ptr = h.__array_interface__["data"][0] if h is not None else a.data.ptr
    return ptr, tuple(a.shape), tuple(a.strides), str(a.dtype)


def _where_all(arrays: dict) -> tuple:
    return tuple((k, _where(v)) for k, v in sorted(arrays.items()))


def _made(out):
    """The array a call hands on: y of a forward's (y, cache), a backward's dx."""
    return out[0] if isinstance(out, tuple) else out


@dataclass
class _Entry:
    graph: object
    sig: tuple
    inp: object  # the graph's input (x forward, dy backward)
    out: object  # what the call returns: (y, cache) forward, dx backward


class BlockGraphs:
    """The layer calls of one stage captured and replayed (see the module)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.entries: dict[tuple, _Entry] = {}
        self.seen: dict[tuple, tuple] = {}  # key -> the addresses of its last eager call
        self.outputs: dict[int, dict[int, object]] = {}  # slot -> {id: a graph's output}
        self.captures = 0

    def _input(self, a, slot):
        """`a` as a graph's input: itself where it is a graph's output of the slot, else a
        copy of its own (made before the capture)."""
        if self.outputs.get(slot, {}).get(id(a)) is a:
            return a
        return a.copy()

    def _call(self, key, slot, sig, inp, run):
        """Replay `key` when its addresses are `sig`, else run eagerly (the first call at
        these addresses) or capture (the second); `run(inp)` is the eager call."""
        e = self.entries.get(key)
        if e is not None and e.sig == sig:
            if inp is not e.inp:
                e.inp[...] = inp  # into the graph's own input buffer
            e.graph.launch()
            return e.out
        if self.seen.get(key) != sig:
            self.seen[key] = sig
            old = self.entries.pop(key, None)
            if old is not None:
                self.outputs.get(slot, {}).pop(id(_made(old.out)), None)
            return run(inp)
        mine = self._input(inp, slot)
        graph, out = dgraphs.capture(self.ctx.xp, lambda: run(mine))
        self.entries[key] = _Entry(graph, sig, mine, out)
        self.captures += 1
        made = _made(out)
        self.outputs.setdefault(slot, {})[id(made)] = made
        return out

    def forward(self, block, slot, x, p, recompute):
        sig = (recompute, _where_all(p), tuple(x.shape), str(x.dtype))
        return self._call((block, "forward", slot), slot, sig, x,
                          lambda xin: layers.layer_forward(xin, p, self.ctx, recompute))

    def backward(self, block, slot, dy, cache, p, g):
        fe = self.entries.get((block, "forward", slot))
        if fe is None or fe.out[1] is not cache:  # an eager forward's cache: eager
            return layers.layer_backward(dy, cache, p, g, self.ctx)
        sig = (id(cache), _where_all(p), _where_all(g), tuple(dy.shape), str(dy.dtype))
        return self._call((block, "backward", slot), slot, sig, dy,
                          lambda dyin: layers.layer_backward(dyin, cache, p, g, self.ctx))

    def owns(self, a) -> bool:
        """Whether `a` is a graph's output (rewritten by its next replay)."""
        return any(o.get(id(a)) is a for o in self.outputs.values())


__all__ = ["GRAPHS", "BlockGraphs", "resolve", "why_not"]
