"""The memory model of one rank: what a stage holds, when, under a lifecycle policy.

A rank holds, on top of its static state (fp32 masters and AdamW moments,
`STATE_BYTES_PER_PARAM` per parameter; with the optimizer state sharded over `shards` dp
replicas, per parameter of its segment, the largest segment being ceil(n / shards) of a block's
n), working views (`view_bytes_per_param`: fp16 2 bytes per parameter while materialised; fp32
none, the view is the master, unless sharded: 4), fp32 gradients (`GRAD_BYTES_PER_PARAM` while
allocated; sharded, only the own segment after the block's reduce-scatter is waited for), the
activations each block keeps per micro-batch in flight (by its recompute choice), the
pipeline's message buffers, and transients (a recomputed layer's full activations during its
backward, the optimizer's scratch of the updated part). `simulate_peak` plays a rank's action
lists with these sizes and returns the peak, so the same model serves the executor's
`recompute: auto` (with activation sizes measured from the kernels' caches,
`runtime.measure`) and the planner (with sizes computed from shapes, `stage_sizes`).

`LinearWalk` is the same walk played once for every recompute choice. The walk only adds and
subtracts sizes, and only what a block keeps depends on its choice. So a symbol stands for
each block's kept bytes, and each total the walk looks at becomes a constant plus symbol
terms. A choice then sets the symbols, and numpy's exact int64 sums give every total at once:
the numbers the plain walk compares, so the same peak. `choose_recompute` asks it one choice
after another; the plain walk (`play`) stays as the reference it is tested against. It knows
the offload pass's part (`lifecycle.passes.offload.MemoryTier`): its bytes in transit become
symbols too.

    act = {"none": ..., "full": ...}                      # bytes per layer per micro-batch
    recompute, peak = choose_recompute(cap, sizes, lists) # fewest layers recomputed that fit
    walk = play(lists, blocks, sizes, plan.passes)        # each pass's part: walk.parts[name]
    compiled = LinearWalk(lists, blocks, sizes, plan.passes); compiled.peaks(sizes_of_a_choice)

A pass over the step (`lifecycle.passes`) gives the walk its part: the bytes its actions hold
(the memory tier's transfers, `lifecycle.passes.offload.MemoryTier`, with the tier's own peak).
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, field, fields, replace

import numpy as np

from ratrain.config import act_itemsize, is_half
from ratrain.exec.params import (
    GRAD_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    shard_size,
    view_bytes_per_param,
)
from ratrain.exec.spec import OFFLOAD, RECOMPUTE, block_params, block_role, kernel_recompute
from ratrain.exec.layers import layer_cache_nbytes
from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.passes.offload import NAME as OFFLOAD_PASS
from ratrain.lifecycle.passes.offload import MemoryTier
from ratrain.lifecycle.schedule import dispatch_table, expand


@dataclass
class StageSizes:
    """Byte sizes the model plays with, for one rank."""

    precision: str
    params: dict[str, int]  # block -> parameter count
    act: dict[str, dict[str, int]]  # block -> recompute choice -> bytes kept per micro-batch
    full_act: dict[str, int]  # block -> bytes of a full forward (a recompute's transient)
    message_bytes: int = 0  # one activation / gradient message between stages
    static: int | None = None  # default: STATE_BYTES_PER_PARAM per held parameter
    extra: int = 0  # anything else resident (scratch reserve, comm buffers)
    recompute: dict[str, str] = field(default_factory=dict)  # block -> choice ("none" if absent)
    shards: int = 1  # dp segments of the optimizer state (1: whole blocks on every replica)

    def kept(self, block: str) -> int:
        """Bytes `block` keeps per micro-batch (an offloaded layer: what it moves to the tier,
        when the sizes say, else what `none` keeps)."""
        modes, choice = self.act[block], self.recompute.get(block, "none")
        if choice in modes:
            return modes[choice]
        return modes.get(kernel_recompute(choice), modes.get("none", 0))

    def with_recompute(self, recompute: dict[str, str]) -> StageSizes:
        return replace(self, recompute=dict(recompute))


def layer_activation_bytes(model, micro_batch: int, precision: str, recompute: str) -> int:
    """Bytes one decoder layer keeps per micro-batch, from shapes (the planner's estimate).

    Counted as the kernels keep them: `full` = the layer input only; `selective` = the inputs
    of the GEMMs and norms (x, normed x, q, k, v, attention output, mlp input, gate and up);
    `none` adds the cheap, memory-heavy intermediates (SwiGLU activation, RMSNorm statistics,
    attention softmax statistics). Within 10-20% of the measured caches; the executor measures.
    """
    b, t, h, f = micro_batch, model.seq_len, model.hidden, model.ffn_hidden
    kv = model.kv_heads * model.head_dim
    e = act_itemsize(precision)
    x = b * t * h * e
    if recompute == "full":
        return x
    sel = (
        x  # input
        + x  # attn-normed input
        + b * t * (h + 2 * kv) * e  # q, k, v (after RoPE)
        + x  # attention output
        + x  # residual / mlp-normed input
        + 2 * b * t * f * e  # gate, up
        + 2 * b * t * 4 * 2  # rms statistics (fp32)
        + b * model.heads * t * 4  # softmax log-sum-exp (fp32)
    )
    if recompute == "selective":
        return sel
    return sel + b * t * f * e + x  # SwiGLU output, mlp-norm input copy


def stage_sizes(model, micro_batch: int, precision: str, blocks,
                recompute: dict[str, str] | None = None, shards: int = 1) -> StageSizes:
    """`StageSizes` of one stage on the platform, from shapes.

    Layers keep `layer_activation_bytes` per micro-batch (and hold their full activations
    while a recomputation runs; an offloaded layer holds its cache as the kernels keep it,
    `exec.layers.layer_cache_nbytes`, while it is written or read); the head keeps its input
    and fp32 statistics; the embedding keeps the token ids. Kernel workspaces are not counted (the platform's fp16 GEMMs need no
    fp32 weight copies, unlike the CPU emulation, whose executor measures its own).
    """
    tokens = micro_batch * model.seq_len
    x = tokens * model.hidden * act_itemsize(precision)
    layer = {r: layer_activation_bytes(model, micro_batch, precision, r) for r in RECOMPUTE}
    # an offloaded layer's cache, as the kernels keep it: the bytes the tier moves
    layer[OFFLOAD] = layer_cache_nbytes(model, micro_batch, precision, "none")
    params, act, full = {}, {}, {}
    for b in blocks:
        role = block_role(b)
        params[b] = block_params(model, role)
        if role == "layer":
            act[b], full[b] = dict(layer), layer["none"]
        elif role == "head":
            act[b] = {"none": x + 3 * 8 * tokens}  # input, fp32 rstd and logsumexp, int64 targets
        else:
            act[b] = {"none": 8 * tokens}  # int64 token ids
    return StageSizes(precision=precision, params=params, act=act, full_act=full,
                      message_bytes=x, recompute=dict(recompute or {}), shards=shards)


class Walk:
    """One rank's bytes held, event by event (see the module); `parts[name]`: each pass's."""

    def __init__(self, blocks, sizes: StageSizes, passes=()):
        self.sizes, self.blocks, self.first_block = sizes, tuple(blocks), blocks[0]
        shards = sizes.shards
        self.separate = is_half(sizes.precision) or shards > 1  # views are buffers of their own
        self.vb = view_bytes_per_param(sizes.precision, shards)
        static = sizes.static if sizes.static is not None else (
            STATE_BYTES_PER_PARAM * sum(shard_size(sizes.params[b], shards) for b in blocks))
        self.cur = static + sizes.extra
        self.views: set[str] = set()
        self.grads: dict[str, int] = {}  # block -> bytes held
        self.msgs = 0  # received activations held until their micro-batch's backward
        self.parts = {p.name: x for p in passes if (x := self._part(p)) is not None}
        self.peak = self.cur  # after the parts: what a pass keeps out of the DDR is not held
        self.table = dispatch_table("memory.simulate_peak", {
            sched.Forward: self._forward, sched.Backward: self._backward, sched.MaterializeView: self._view,
            sched.DropView: self._drop_view, sched.AllocGrad: self._alloc, sched.WaitGrad: self._wait,
            sched.FreeGrad: self._free, sched.Update: self._update, sched.RecvForward: self._recv_forward,
            sched.SendForward: self._message, sched.RecvBackward: self._message, sched.SendBackward: self._message,
            **{t: f for x in self.parts.values() for t, f in x.handlers().items()},
        }, ignore=(sched.WaitView, sched.SyncGrad, sched.GradNorm), passes=passes)

    def _part(self, p):
        """Pass `p`'s part of this walk (its handlers)."""
        return p.memory(self)

    def bump(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.cur + extra)

    def event(self, blk, e) -> None:
        self.table[type(e)](blk, e)
        self.bump()

    def _forward(self, blk, e):
        s = self.sizes
        self.cur += s.kept(blk)
        self.bump(s.full_act.get(blk, 0) - s.kept(blk))

    def _backward(self, blk, e):
        # a recomputed layer holds its full activations again while it runs backward
        self.bump(self.sizes.full_act.get(blk, 0))
        self.cur -= self.sizes.kept(blk)
        if blk == self.first_block and self.msgs:  # the stage input's backward: its message goes
            self.bump()
            self.msgs -= 1
            self.cur -= self.sizes.message_bytes

    def _view(self, blk, e):
        if self.separate and e.block not in self.views:
            self.views.add(e.block)
            self.cur += self.vb * self.sizes.params[e.block]

    def _drop_view(self, blk, e):
        if e.block in self.views:
            self.views.discard(e.block)
            self.cur -= self.vb * self.sizes.params[e.block]

    def _alloc(self, blk, e):
        self.grads[e.block] = GRAD_BYTES_PER_PARAM * self.sizes.params[e.block]
        self.cur += self.grads[e.block]

    def _wait(self, blk, e):
        if not e.scatter:
            return
        for b in e.blocks:  # keep the own segment only
            seg = GRAD_BYTES_PER_PARAM * shard_size(self.sizes.params[b], self.sizes.shards)
            if self.grads.get(b, 0) > seg:
                self.bump(seg)  # the segment's copy, next to the whole buffer
                self.cur -= self.grads[b] - seg
                self.grads[b] = seg

    def _free(self, blk, e):
        if e.block in self.grads:
            self.cur -= self.grads.pop(e.block)

    def _update(self, blk, e):  # the optimizer's scratch of the updated part
        self.bump(4 * shard_size(self.sizes.params[e.block], self.sizes.shards))

    def _recv_forward(self, blk, e):  # a received input lives until its backward
        self.msgs += 1
        self.cur += self.sizes.message_bytes

    def _message(self, blk, e):  # sends and gradients are held briefly
        self.bump(self.sizes.message_bytes)


def play(lists, blocks, sizes: StageSizes, passes=()) -> Walk:
    """The walk of a rank running `lists` (successive steps) in order, from nothing held, with
    the plan's `passes` (those whose actions the lists hold)."""
    walk = Walk(blocks, sizes, passes)
    for actions in lists:
        for a in actions:
            for blk, e in expand(a, blocks):
                walk.event(blk, e)
    return walk


def simulate_peak(lists, blocks, sizes: StageSizes, passes=()) -> int:
    """Peak bytes of a rank running `lists` (successive steps) in order, from nothing held."""
    return int(play(lists, blocks, sizes, passes).peak)


def peaks(lists, blocks, sizes: StageSizes, passes=()) -> tuple[int, int]:
    """(peak DDR bytes, peak bytes in the memory tier) of a rank running `lists` in order with
    the plan's `passes` (no offload pass: no tier, 0)."""
    walk = play(lists, blocks, sizes, passes)
    part = walk.parts.get(OFFLOAD_PASS)
    return int(walk.peak), int(part.peak) if part is not None else 0


# -- the walk compiled once --------------------------------------------------------------------


class _Sum:
    """A constant plus symbol terms ((coefficient, symbol), ...): what the compiled walk holds
    where the plain walk holds a number of bytes. Symbols are `LinearWalk`'s."""

    __slots__ = ("const", "terms")

    def __init__(self, const: int = 0, terms: tuple = ()):
        self.const, self.terms = const, terms

    def __rsub__(self, other: int) -> _Sum:  # int - self: a forward's transient
        return _Sum(other - self.const, tuple((-c, k) for c, k in self.terms))


class _Tape:
    """A running total as its increments, and the points where the walk looks at it (each
    with an extra that counts at that point only)."""

    def __init__(self, start: int):
        self.const, self.coef, self.sym = [operator.index(start)], [0], [-1]
        self.at: list[int] = []  # a point: the total after this many increments (less one)
        self.extra: list[int] = []  # its constant extra
        self.extra_terms: list[tuple[int, int, int]] = []  # (point, coefficient, symbol)
        self.plain = -1  # the last increment looked at with no extra
        self.look()

    def _add(self, x, sign: int) -> _Tape:
        if x.__class__ is int:  # the common case, first
            self.const.append(sign * x)
            self.coef.append(0)
            self.sym.append(-1)
            return self
        if isinstance(x, _Sum) and not x.terms:
            return self._add(x.const, sign)
        if isinstance(x, _Sum):  # the constant rides on the first term
            for i, (c, k) in enumerate(x.terms):
                self.const.append(sign * x.const if i == 0 else 0)
                self.coef.append(sign * c)
                self.sym.append(k)
        else:
            self.const.append(sign * operator.index(x))
            self.coef.append(0)
            self.sym.append(-1)
        return self

    def __iadd__(self, x) -> _Tape:
        return self._add(x, 1)

    def __isub__(self, x) -> _Tape:
        return self._add(x, -1)

    def look(self, extra=0) -> None:
        pos = len(self.const) - 1
        if extra.__class__ is int and extra == 0:  # the common case, first
            if pos != self.plain:
                self.plain = pos
                self.at.append(pos)
                self.extra.append(0)
            return
        if isinstance(extra, _Sum):
            self.extra_terms += [(len(self.at), c, k) for c, k in extra.terms]
            extra = extra.const
        elif extra == 0:
            if pos == self.plain:  # the same total looked at again: nothing new
                return
            self.plain = pos
        self.at.append(pos)
        self.extra.append(operator.index(extra))

    def freeze(self) -> _Peak:
        return _Peak(self)

class _Peak:
    """A frozen `_Tape`: the largest value at its points, for given symbol values."""

    def __init__(self, tape: _Tape):
        i64 = np.int64
        self.const, self.coef = np.array(tape.const, i64), np.array(tape.coef, i64)
        self.sym, self.at = np.array(tape.sym, np.intp), np.array(tape.at, np.intp)
        self.extra = np.array(tape.extra, i64)
        x = np.array(tape.extra_terms, i64).reshape(-1, 3)
        self.x_at, self.x_coef, self.x_sym = x[:, 0].astype(np.intp), x[:, 1], x[:, 2]

    def max(self, values) -> int:
        """The peak with `values[k]` for symbol k (`values[-1]`: 0, the no-symbol slot)."""
        total = np.cumsum(self.const + self.coef * values[self.sym])
        points = total[self.at] + self.extra
        np.add.at(points, self.x_at, self.x_coef * values[self.x_sym])
        return int(points.max())


class _SymbolSizes(StageSizes):
    """`StageSizes` whose blocks keep a symbol each (`LinearWalk`'s `k` symbols)."""

    def kept(self, block: str):
        return self.symbols[block]


class _SymbolTier(MemoryTier):
    """The tier's handlers with symbols: an activation transfer moves its block's `o` symbol,
    and the tier's total is a tape."""

    def __init__(self, walk, state: str, moved: dict[str, _Sum]):
        super().__init__(walk, state)
        self.cur, self.moved = _Tape(self.cur), moved

    def _bytes(self, e):
        return self.moved[e.block] if e.what == "act" else super()._bytes(e)

    def _tier(self, n) -> None:
        self.cur += n
        self.cur.look()


class _Compile(Walk):
    """The plain walk over symbols: each bump becomes a point of the tape."""

    def __init__(self, blocks, sizes: StageSizes, passes=()):
        n = len(blocks)
        fixed = {f.name: getattr(sizes, f.name) for f in fields(StageSizes)}
        sym = _SymbolSizes(**fixed)
        sym.symbols = {b: _Sum(0, ((1, i),)) for i, b in enumerate(blocks)}
        self.moved = {b: _Sum(0, ((1, n + i),)) for i, b in enumerate(blocks)}
        super().__init__(blocks, sym, passes)
        self.cur = _Tape(self.cur)

    def _part(self, p):
        if p.name == OFFLOAD_PASS:
            return _SymbolTier(self, p.state, self.moved)
        return p.memory(self)

    def bump(self, extra=0) -> None:
        self.cur.look(extra)

    def event(self, blk, e) -> None:
        self.table[type(e)](blk, e)
        self.cur.look()


def whole_bytes(sizes: StageSizes) -> bool:
    """Whether every size is a whole number of bytes, as `LinearWalk` needs."""
    values = [*sizes.params.values(), *sizes.full_act.values(), sizes.message_bytes,
              sizes.extra, 0 if sizes.static is None else sizes.static,
              *(v for modes in sizes.act.values() for v in modes.values())]
    return all(isinstance(v, numbers.Integral) for v in values)


def _fixed(sizes: StageSizes) -> tuple:
    """What a compiled walk holds fixed: every size but the recompute choice and the bytes
    each choice keeps."""
    return (sizes.precision, sizes.params, sizes.full_act, sizes.message_bytes, sizes.static,
            sizes.extra, sizes.shards)


class LinearWalk:
    """`peaks` of one rank's `lists`, compiled once for every recompute choice.

    The walk adds and subtracts sizes, and the peak is the largest total it looks at. Every
    size but what a block keeps is fixed by `sizes`. So the walk is played once with a symbol
    for each block's kept bytes (`k`) and for its activation bytes in transit (`o`). Each
    total it looks at is then a constant plus symbol terms, and `peaks` evaluates them all
    at once in exact int64 sums: the same numbers the plain walk compares, so the same peak.

    `peaks(sizes, offloaded)`: `offloaded` names the layers whose activation transfers in
    `lists` count; the others' count as absent (None: all count). `passes.offload.place`
    puts each layer's transfers where they go whatever else is offloaded. So the lists with
    every layer's transfers, counted for a subset, are the subset's own lists.
    """

    def __init__(self, lists, blocks, sizes: StageSizes, passes=()):
        self.blocks, self.fixed = tuple(blocks), _fixed(sizes)
        walk, blocks = _Compile(self.blocks, sizes, passes), self.blocks
        order = {sched.Forward: blocks, sched.Backward: blocks[::-1]}
        for actions in lists:
            for a in actions:
                if a.group != "compute":
                    walk.event(None, a)
                elif a.pre or a.post:
                    for blk, e in expand(a, blocks):
                        walk.event(blk, e)
                else:  # no hooks: its blocks, as `expand` gives them
                    for blk in order[type(a)]:
                        walk.event(blk, a)
        tier = walk.parts.get(OFFLOAD_PASS)
        self.ddr = walk.cur.freeze()
        self.tier = (tier.cur if tier is not None else _Tape(0)).freeze()

    def peaks(self, sizes: StageSizes, offloaded=None) -> tuple[int, int]:
        """(peak DDR bytes, peak tier bytes) with `sizes` (its recompute choice)."""
        if _fixed(sizes) != self.fixed:
            raise ValueError("LinearWalk.peaks: sizes differ from the compiled ones in more "
                             "than the recompute choice")
        kept = [operator.index(sizes.kept(b)) for b in self.blocks]
        moved = [k if offloaded is None or b in offloaded else 0
                 for b, k in zip(self.blocks, kept)]
        values = np.array(kept + moved + [0], np.int64)
        return self.ddr.max(values), self.tier.max(values)


def choose_recompute(cap: int | None, sizes: StageSizes, lists, blocks, per_layer: bool = True,
                     passes=(), walk=None) -> tuple[dict[str, str], int]:
    """The fewest layers fully recomputed (the first ones of the stage) whose simulated peak
    fits `cap`; returns ({layer: recompute choice}, peak). All of them when nothing fits.
    `per_layer=False` (uniform recovery): no layer, or every layer. `passes`: the plan's.
    `walk`: `lists` compiled (a `LinearWalk`; default: compiled here when the sizes are whole
    bytes)."""
    layers = [b for b in blocks if b.startswith("layers.")]
    counts = range(len(layers) + 1) if per_layer else sorted({0, len(layers)})
    if walk is None and whole_bytes(sizes):  # else the plain walk, whose floats it keeps
        walk = LinearWalk(lists, blocks, sizes, passes)
    best: tuple[dict[str, str], int] = ({}, 0)
    for k in counts:
        choice = {b: ("full" if i < k else "none") for i, b in enumerate(layers)}
        sz = sizes.with_recompute(choice)
        peak = walk.peaks(sz)[0] if walk is not None else simulate_peak(lists, blocks, sz, passes)
        best = (choice, peak)
        if cap is None or peak <= cap:
            return best
    return best


__all__ = ["LinearWalk", "StageSizes", "Walk", "act_itemsize", "choose_recompute",
           "layer_activation_bytes", "peaks", "play", "simulate_peak", "stage_sizes",
           "whole_bytes"]
