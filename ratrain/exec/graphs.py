"""A stage's block calls as device graphs (`run.graphs`), eager the reference.

    graphs = BlockGraphs(ctx)
    y, cache = graphs.forward(block, slot, x, p, recompute)     layers.layer_forward's result
    dx = graphs.backward(block, slot, dy, cache, p, g)          layers.layer_backward's result
    loss, cache = graphs.head_forward(block, slot, x, targets, p)    head.head_forward's
    dx = graphs.head_backward(block, slot, dscale, cache, p, g)      head.head_backward's
    graphs.embed_backward(block, slot, dy, cache, p, g)              layers.embed_backward

Each (block, phase, slot) is captured once (`device.graphs`) and replayed by one host launch
after. A slot is a micro-batch in flight on the stage (`runtime.compute`: the lowest one free
when its forward starts, free again when its backward ends), so a slot's forward graph owns
the arrays its cache keeps until that micro-batch's backward, which its backward graph reads.
(The embedding's forward, one gather, stays eager.)

A replay runs on the addresses it was captured on. So a key is replayed only while what the
call reads is where it was: the block's weight views and gradients (their addresses are part
of the key), the cache its forward graph made (a backward's), and the inputs: a graph's output
of the same slot is handed on as is (the layer before's y, the layer after's dx), anything else
is copied into the graph's own input buffer (one operation). A key whose addresses changed is
captured again; so is one whose input came from an eager call at its capture and comes from a
graph now. A key is captured on its second call, the first eager (it loads kernels, builds
cuDNN's plans and fills the memory pool outside the capture); one captured `RECAPTURES` times
runs eagerly from then on. What a
graph writes stays its own until its next replay: the stage hands copies of its outputs on
(`runtime.compute`).

The host scalars a call takes are part of its key: `recompute` and the shapes, and the head's
loss seed (the loss scale over the tokens: a new scale, a new capture, never a frozen old one).
The optimizer, whose learning rate and bias corrections change every step, stays eager.
"""

from __future__ import annotations

from dataclasses import dataclass

from ratrain.device import graphs as dgraphs
from ratrain.exec import head, layers

GRAPHS = ("auto", "on", "off")
# captures of one key before it runs eagerly for good: its addresses keep moving (a step's
# settling takes two or three)
RECAPTURES = 8


def why_not(ctx, parks: bool = False) -> str:
    """Why `ctx`'s block calls cannot be captured ("" when they can); `parks`: whether a pass
    moves the caches' arrays out and back between a forward and its backward (the memory
    tier's activations), which a replay, on the captured addresses, cannot follow."""
    why = dgraphs.why_not(ctx.xp)
    if why:
        return why
    if parks:
        return ("offload.activations moves a cache's arrays to the tier and back to new "
                "addresses, which a replay cannot follow (set offload.activations=off)")
    if not ctx.half_layout:
        return (f"precision={ctx.precision}: a device's fp32 GEMMs go through cupy's cuBLAS, which "
                "refuses a capturing stream (fp16 and bf16 GEMMs go through exec.devgemm)")
    attn = ctx.kernels.attention
    if not attn.captures:
        return (f"run.attention={attn.name} runs its GEMMs through cupy's cuBLAS, which refuses "
                "a capturing stream (cuDNN's attention captures)")
    return ""


def resolve(mode: str, ctx, parks: bool = False) -> bool:
    """Whether `run.graphs: mode` captures `ctx`'s block calls: auto where they can be, on
    (one line where they cannot), off (`parks`: `why_not`'s)."""
    if mode not in GRAPHS:
        raise ValueError(f"run.graphs={mode!r}: expected one of {', '.join(GRAPHS)}")
    if mode == "off":
        return False
    why = why_not(ctx, parks)
    if why and mode == "on":
        raise ValueError(f"run.graphs=on: {why}; set run.graphs=auto (or off)")
    return not why


def _where_all(arrays: dict) -> tuple:
    return tuple((k, dgraphs.where(v)) for k, v in sorted(arrays.items()))


def _made(out):
    """The array a call hands on: y of a forward's (y, cache) (the head's loss), a backward's
    dx (None: the embedding's backward)."""
    return out[0] if isinstance(out, tuple) else out


@dataclass
class _Entry:
    graph: object
    sig: tuple
    inp: tuple  # the graph's inputs (x forward, dy backward; the targets, the token ids)
    out: object  # what the call returns: (y, cache) forward, dx backward


class BlockGraphs:
    """The block calls of one stage captured and replayed (see the module)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.entries: dict[tuple, _Entry] = {}
        self.seen: dict[tuple, int] = {}  # key -> its calls with a signature new to it
        self.outputs: dict[int, dict[int, object]] = {}  # slot -> {id: a graph's output}
        self.captures = 0

    def _input(self, a, slot):
        """`a` as a graph's input: itself where it is a graph's output of the slot, else a
        copy of its own (made before the capture)."""
        if self.outputs.get(slot, {}).get(id(a)) is a:
            return a
        return a.copy()

    def _forget(self, key, slot) -> None:
        old = self.entries.pop(key, None)
        made = _made(old.out) if old is not None else None
        if made is not None:
            self.outputs.get(slot, {}).pop(id(made), None)

    def _call(self, key, slot, sig, inputs: tuple, run):
        """Replay `key` when its addresses and scalars are `sig`, else capture it anew (run
        eagerly on its first call, and after `RECAPTURES` captures); `run(*inputs)` is the
        eager call. Which inputs are graphs' outputs is part of the signature, so a graph
        captured while its input came from an eager call is captured again once that input
        comes from a graph (then handed on with no copy)."""
        owned = self.outputs.get(slot, {})
        sig = (sig, tuple(id(a) if owned.get(id(a)) is a else None for a in inputs))
        e = self.entries.get(key)
        if e is not None and e.sig == sig:
            for a, mine in zip(inputs, e.inp):
                if a is not mine:
                    mine[...] = a  # into the graph's own input buffer
            e.graph.launch()
            return e.out
        self._forget(key, slot)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] == 1 or self.seen[key] > RECAPTURES:
            return run(*inputs)  # the first call (a warm-up), or a key that keeps moving
        mine = tuple(self._input(a, slot) for a in inputs)
        graph, out = dgraphs.capture(self.ctx.xp, lambda: run(*mine))
        self.entries[key] = _Entry(graph, sig, mine, out)
        self.captures += 1
        made = _made(out)
        if made is not None:
            self.outputs.setdefault(slot, {})[id(made)] = made
        return out

    def _cache_of(self, block, slot, cache) -> bool:
        """Whether `cache` is what the block's forward graph of the slot keeps."""
        fe = self.entries.get((block, "forward", slot))
        return fe is not None and fe.out[1] is cache

    def forward(self, block, slot, x, p, recompute):
        """A decoder layer's forward: `layers.layer_forward`'s (y, cache)."""
        sig = (recompute, _where_all(p), tuple(x.shape), str(x.dtype))
        return self._call((block, "forward", slot), slot, sig, (x,),
                          lambda xin: layers.layer_forward(xin, p, self.ctx, recompute))

    def backward(self, block, slot, dy, cache, p, g):
        """A decoder layer's backward: `layers.layer_backward`'s dx."""
        if not self._cache_of(block, slot, cache):  # an eager forward's cache: eager
            return layers.layer_backward(dy, cache, p, g, self.ctx)
        sig = (id(cache), _where_all(p), _where_all(g), tuple(dy.shape), str(dy.dtype))
        return self._call((block, "backward", slot), slot, sig, (dy,),
                          lambda dyin: layers.layer_backward(dyin, cache, p, g, self.ctx))

    def head_forward(self, block, slot, x, targets, p):
        """The head's forward, a backward to follow: `head.head_forward`'s (loss, cache)."""
        sig = (_where_all(p), tuple(x.shape), str(x.dtype), tuple(targets.shape))
        return self._call((block, "forward", slot), slot, sig, (x, targets),
                          lambda xin, t: head.head_forward(xin, t, p, self.ctx, backward=True))

    def head_backward(self, block, slot, dscale, cache, p, g):
        """The head's backward: `head.head_backward`'s dx; the loss's seed `dscale`, a host
        scalar a replay would freeze, is part of the key (a new one is captured anew)."""
        if not self._cache_of(block, slot, cache):
            return head.head_backward(dscale, cache, p, g, self.ctx)
        sig = (id(cache), float(dscale), _where_all(p), _where_all(g))
        return self._call((block, "backward", slot), slot, sig, (),
                          lambda: head.head_backward(dscale, cache, p, g, self.ctx))

    def embed_backward(self, block, slot, dy, cache, p, g) -> None:
        """The embedding's backward (`layers.embed_backward`), its token ids an input."""
        sig = (_where_all(p), _where_all(g), tuple(dy.shape), tuple(cache.x.shape))
        self._call((block, "backward", slot), slot, sig, (dy, cache.x),
                   lambda dyin, ids: layers.embed_backward(
                       dyin, layers.BlockCache("embed", "none", ids, [], None, {}), p, g,
                       self.ctx))

    def owns(self, a) -> bool:
        """Whether `a` is a graph's output (rewritten by its next replay)."""
        return any(o.get(id(a)) is a for o in self.outputs.values())


__all__ = ["GRAPHS", "BlockGraphs", "resolve", "why_not"]
