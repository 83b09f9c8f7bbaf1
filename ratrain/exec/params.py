"""A pipeline stage's parameters, gradients and optimizer moments as flat buffers.

One `StageState` per rank holds, for the blocks of its stage (in model order):

- `master_buf`: one flat fp32 array of every parameter (ledger tag `params.master`);
- `m_buf`, `v_buf`: AdamW's first and second moments, flat fp32 arrays of the same size (tags `optim.m`,
  `optim.v`), allocated and zeroed at construction so a stage's steady memory is known up front;
- per-block working views: in fp32 the view *is* the block's master slice (no allocation); in
  fp16 and bf16 `materialize_view(block)` allocates `params.view.<block>` and casts the master slice into
  it, `drop_view(block)` releases it;
- per-block fp32 gradient buffers `grads.<block>`, allocated zeroed by `alloc_grad` and released
  by `free_grad`; backward kernels add into them.

Each block is a contiguous slice of the flat buffers, in the order of `BlockSpec.params`, so
per-block lifecycle actions (sync, update, materialise) deal with one contiguous range, and
checkpoints and Hugging Face import/export address parameters by their global names.

Sharded mode (`shard=(q, p)`, ZeRO-1 per block over p data-parallel replicas): replica q holds
only segment q of each block, `[q*n//p, (q+1)*n//p)` of the block's n elements (exactly the
segment a ring reduce-scatter leaves on dp rank q, `ratrain.comm.collectives.segments`), of
the master, m and v; the flat buffers are these segments back to back (same ledger tags, 1/p of
the bytes). `flat(buf, block)` is then the own segment, `segment(block)` its (lo, hi) within
the block. Working views are whole-block buffers of their own in fp32 too:
`materialize_view` casts (fp16, bf16) or copies (fp32) the own master segment into the view's
segment, and the caller all-gathers the rest (this package does no MPI). Gradients are whole
blocks while backward accumulates; after the reduce-scatter `shrink_grad` keeps only the own
segment (`grad_segment`). Whole-parameter accessors (`named`, `master`, `state_dict`) refuse in
sharded mode; `load_named` takes whole parameters and keeps the own segment.

    state = StageState(stage_blocks(cfg.model, pp, stage), cfg.precision, ledger, seed=cfg.init.seed)
    state.materialize_view("layers.0")
    p = state.view("layers.0")  # {"attn.wq": (H, H), ...}
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from ratrain.config import is_half
from ratrain.exec.backends import Kernels, default_kernels
from ratrain.exec.kernels import DTYPES
from ratrain.exec.spec import BlockSpec, ParamSpec, init_param

STATE_BUFFERS = ("master", "m", "v")  # the flat fp32 buffers a stage holds (masters, AdamW moments)
BUFFER_TAGS = {"master": "params.master", "m": "optim.m", "v": "optim.v"}  # their ledger tags


STATE_BYTES_PER_PARAM = 12  # held per parameter of the own segment: fp32 master, AdamW m and v
GRAD_BYTES_PER_PARAM = 4  # an fp32 gradient


def view_bytes_per_param(precision: str, shards: int = 1) -> int:
    """Bytes per parameter a materialised working view holds: 2 in fp16 and bf16; in fp32 4
    when the master is sharded (the view is a whole-block copy), 0 when the view is the master
    itself."""
    if is_half(precision):
        return 2
    return 4 if shards > 1 else 0


def view_cast_bytes_per_param(precision: str, shards: int = 1) -> int:
    """Memory bytes one view materialisation moves per parameter of the own segment: read the
    fp32 master, write the view (0 when the view is the master)."""
    vb = view_bytes_per_param(precision, shards)
    return 4 + vb if vb else 0


def shard_size(n: int, shards: int = 1) -> int:
    """The largest of the `shards` segments of n elements (`segment_bounds`' sizes differ by at
    most one)."""
    return -(-n // shards)


def segment_bounds(n: int, q: int, p: int) -> tuple[int, int]:
    """Segment q of p of n elements: [q*n//p, (q+1)*n//p), the segment a ring reduce-scatter
    leaves on rank q (`ratrain.comm.collectives.segments`)."""
    return q * n // p, (q + 1) * n // p


def held_elements(blocks: Iterable[BlockSpec], shard: tuple[int, int] | None = None) -> int:
    """Elements of each of master, m, v that a `StageState` of `blocks` holds (`shard`: (q, p),
    its segments only)."""
    q, p = shard or (0, 1)
    return sum(hi - lo for lo, hi in (segment_bounds(b.size, q, p) for b in blocks))


class StageState:
    """Flat fp32 masters, AdamW moments, working views and gradients for one stage's blocks.

    Args:
        blocks: the stage's blocks in model order (`spec.stage_blocks`).
        precision: "fp32" (views are the masters), "fp16" or "bf16" (views are 16-bit copies).
        ledger: the rank's DDR ledger; every buffer here is allocated through it.
        xp: the array module (numpy or cupy).
        seed: `init.seed`; each parameter starts at `spec.init_param(p, seed)`, which depends only
            on (seed, global name), so the union of the stages of any split equals pp = 1.
        initial: optional {global name: array} to start from instead (Hugging Face import);
            it must hold every parameter of the stage (extra names are ignored).
        shard: (q, p): hold only segment q of p of each block's master and moments (see the
            module); None or p = 1: whole blocks.
        external: {buffer: flat fp32 array of `held_size`} for the state buffers that live
            outside the DDR (in the memory tier: `runtime.passes.offload`), used instead of an
            allocation from the ledger; a block's segment is then served from a DDR copy while
            one is placed (`place`, `unplace`).
    """

    def __init__(
        self,
        blocks: Iterable[BlockSpec],
        precision: str,
        ledger,
        xp=np,
        seed: int = 1234,
        initial: Mapping[str, np.ndarray] | None = None,
        shard: tuple[int, int] | None = None,
        kernels: Kernels | None = None,
        external: Mapping[str, object] | None = None,
    ):
        if precision not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"precision={precision!r} is not one of: fp32, fp16, bf16")
        self.blocks: list[BlockSpec] = list(blocks)
        if not self.blocks:
            raise ValueError("a stage needs at least one block")
        self.precision = precision
        self.view_dtype = DTYPES[precision]
        self.ledger = ledger
        self.xp = xp
        # the rank's kernel table: its `assign` casts masters into 16-bit views
        self.kernels = kernels if kernels is not None else default_kernels(xp)
        self._block = {b.name: b for b in self.blocks}
        if len(self._block) != len(self.blocks):
            raise ValueError("duplicate block names in the stage")

        # Offsets: block -> (start, stop) in the flat buffers; param -> (start, stop).
        self._block_range: dict[str, tuple[int, int]] = {}
        self._param_range: dict[str, tuple[int, int]] = {}
        self._spec: dict[str, ParamSpec] = {}
        self._param_block: dict[str, str] = {}
        off = 0
        for b in self.blocks:
            start = off
            for p in b.params:
                self._param_range[p.name] = (off, off + p.size)
                self._spec[p.name] = p
                self._param_block[p.name] = b.name
                off += p.size
            self._block_range[b.name] = (start, off)
        self.size = off  # parameters on this stage
        self._set_shard(*(shard or (0, 1)))

        self.external = dict(external or {})
        for buf, tag in BUFFER_TAGS.items():  # (N/p,) each, zeroed
            if buf in self.external:  # in the tier (memory-mapped): not the DDR's
                ext = self.external[buf]
                if ext.shape != (self.held_size,) or ext.dtype != np.float32:
                    raise ValueError(f"external {buf}: {ext.shape} {ext.dtype}, expected "
                                     f"({self.held_size},) float32")
                ext[...] = 0
                setattr(self, f"{buf}_buf", ext)
            else:
                setattr(self, f"{buf}_buf", ledger.alloc(tag, (self.held_size,), np.float32, xp))
        self._placed: dict[tuple[str, str], object] = {}  # (buffer, block) -> DDR copy
        self._views: dict[str, object] = {}  # separate views (16-bit or sharded): block -> flat
        self._grads: dict[str, object] = {}  # block -> flat fp32 gradient
        self._shrunk: set[str] = set()  # blocks whose gradient holds only the own segment
        # keep_buffers: a released view or whole gradient stays held (and counted) for the
        # block's next one, at the same address: what a device graph that reads the view and
        # adds into the gradient needs (`exec.graphs`; set by `runtime.compute` when run.graphs
        # is on)
        self.keep_buffers = False
        self._spare: dict[str, object] = {}  # block -> its gradient, kept
        self._spare_views: dict[str, object] = {}  # block -> its view, kept

        if initial is not None:
            self.load_named(initial)
        else:
            for name, spec in self._spec.items():
                self._put(self.master_buf, name, init_param(spec, seed))

    def _set_shard(self, q: int, p: int) -> None:
        """Segment bookkeeping: block -> own (lo, hi) within the block, and its range in the
        held flat buffers."""
        if not (isinstance(q, int) and isinstance(p, int) and p >= 1 and 0 <= q < p):
            raise ValueError(f"shard=({q}, {p}): need 0 <= q < p")
        self.shard_index, self.num_shards = q, p
        self._seg: dict[str, tuple[int, int]] = {}
        self._held_range: dict[str, tuple[int, int]] = {}
        off = 0
        for b in self.blocks:
            a, e = self._block_range[b.name]
            lo, hi = segment_bounds(e - a, q, p)
            self._seg[b.name] = (lo, hi)
            self._held_range[b.name] = (off, off + hi - lo)
            off += hi - lo
        self.held_size = off  # elements of each of master, m, v held here

    @property
    def sharded(self) -> bool:
        """Whether only this replica's segment of each block's master and moments is held."""
        return self.num_shards > 1

    @property
    def separate_views(self) -> bool:
        """Whether working views are buffers of their own (16-bit, or sharded masters)."""
        return is_half(self.precision) or self.sharded

    def shard(self, q: int, p: int) -> None:
        """Turn a whole-block state into a sharded one in place (keep segment q of p of every
        block's master and moments); views must be dropped and gradients freed first. The
        whole buffers are freed once the segments are copied (a transient of 12 bytes/param)."""
        if self.sharded:
            raise RuntimeError(f"the state is already sharded ({self.shard_index} of "
                               f"{self.num_shards})")
        if self.external:
            raise RuntimeError("a state whose buffers live in the tier is built sharded; it "
                               "cannot be cut afterwards")
        if self._views or self._grads:
            raise RuntimeError("drop every view and free every gradient before sharding")
        self._drop_spares()  # kept at the whole state's sizes
        if p == 1:
            return
        old = {k: self.buffer(k) for k in STATE_BUFFERS}
        old_range = dict(self._block_range)
        self._set_shard(q, p)
        for k, tag in BUFFER_TAGS.items():
            new = self.ledger.alloc(tag, (self.held_size,), np.float32, self.xp, zero=False)
            for b in self.block_names:
                a, _ = old_range[b]
                lo, hi = self._seg[b]
                s0, s1 = self._held_range[b]
                new[s0:s1] = old[k][a + lo : a + hi]
            setattr(self, f"{k}_buf", new)
            self.ledger.free(old[k])

    def segment(self, block: str) -> tuple[int, int]:
        """(lo, hi): the part of the block (element offsets within it) whose master and moments
        this replica holds; (0, block size) when unsharded."""
        self.block(block)
        return self._seg[block]

    def _put(self, buf, name: str, arr) -> None:
        """Copy a whole parameter's values (any shape with its size) into the held part of the
        flat buffer `buf` (`master`, `m` or `v`)."""
        a, b = self._param_range[name]
        blk = self._param_block[name]
        base = self._block_range[blk][0]
        lo, hi = self._seg[blk]
        i0, i1 = max(a, base + lo), min(b, base + hi)  # the parameter's own elements
        if i0 >= i1:
            return
        h0 = self._held_range[blk][0] + i0 - (base + lo)
        src = self.xp.asarray(arr, dtype=np.float32).reshape(-1)
        buf[h0 : h0 + i1 - i0] = src[i0 - a : i1 - a]

    def _need_whole(self, what: str) -> None:
        if self.sharded:
            raise RuntimeError(
                f"{what}: this state holds only segment {self.shard_index} of "
                f"{self.num_shards} of each block (optimizer state sharded over dp); gather "
                "whole blocks with Executor.iter_full_state() / full_params()"
            )

    # -- structure ------------------------------------------------------------------------------

    @property
    def block_names(self) -> list[str]:
        """The stage's block names, in model order."""
        return [b.name for b in self.blocks]

    @property
    def names(self) -> list[str]:
        """Global names of the stage's parameters, in buffer order."""
        return list(self._spec)

    def spec(self, name: str) -> ParamSpec:
        """The ParamSpec of a global parameter name on this stage."""
        try:
            return self._spec[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not on this stage") from None

    def block(self, name: str) -> BlockSpec:
        try:
            return self._block[name]
        except KeyError:
            raise KeyError(
                f"block {name!r} is not on this stage (blocks: {', '.join(self._block)})"
            ) from None

    def block_range(self, name: str) -> tuple[int, int]:
        """(start, stop) of the block in the flat buffers."""
        self.block(name)
        return self._block_range[name]

    def param_range(self, name: str) -> tuple[int, int]:
        """(start, stop) of a parameter (global name) in the flat buffers."""
        self.spec(name)
        return self._param_range[name]

    def _split(self, block: str, flat, base: int = 0) -> dict[str, object]:
        """Per-parameter views (param shapes) of a block's flat array starting at `base`."""
        out = {}
        for p in self.block(block).params:
            a, b = self._param_range[p.name]
            out[p.local] = flat[a - base : b - base].reshape(p.shape)
        return out

    # -- masters and moments --------------------------------------------------------------------

    def buffer(self, buf: str):
        """The whole flat fp32 buffer of `master`, `m` or `v` (shape (N,); sharded: the own
        segments of the blocks back to back)."""
        if buf not in STATE_BUFFERS:
            raise ValueError(f"buffer {buf!r} is not one of: {', '.join(STATE_BUFFERS)}")
        return getattr(self, f"{buf}_buf")

    def flat(self, buf: str, block: str):
        """The block's slice of `master`, `m` or `v` (a view, fp32); sharded: the own segment
        only (`segment(block)` says which part of the block); a buffer in the tier: its DDR copy
        while one is placed."""
        if buf not in STATE_BUFFERS:
            raise ValueError(f"buffer {buf!r} is not one of: {', '.join(STATE_BUFFERS)}")
        self.block(block)
        placed = self._placed.get((buf, block)) if self._placed else None
        if placed is not None:
            return placed
        a, b = self._held_range[block]
        return self.buffer(buf)[a:b]

    def place(self, buf: str, block: str, arr) -> None:
        """Serve `arr` (a DDR copy of the block's segment of a buffer in the tier) as
        `flat(buf, block)` until `unplace`."""
        if buf not in self.external:
            raise RuntimeError(f"buffer {buf!r} is not in the tier: nothing to place")
        self._placed[(buf, block)] = arr

    def unplace(self, buf: str, block: str):
        """Stop serving the placed copy; returns it (write it back, then free it)."""
        return self._placed.pop((buf, block))

    def master_flat(self, block: str):
        return self.flat("master", block)

    def master(self, block: str) -> dict[str, object]:
        """{local name: fp32 master view (param shape)} of a block (unsharded only)."""
        self._need_whole("master()")
        return self._split(block, self.master_buf)

    def named(self, buf: str = "master") -> Iterator[tuple[str, object]]:
        """(global name, view of param shape) of `master`, `m` or `v`, in buffer order
        (unsharded only)."""
        if buf not in STATE_BUFFERS:
            raise ValueError(f"buffer {buf!r} is not one of: {', '.join(STATE_BUFFERS)}")
        self._need_whole("named()")
        flat = self.buffer(buf)
        for name, spec in self._spec.items():
            a, b = self._param_range[name]
            yield name, flat[a:b].reshape(spec.shape)

    def named_master(self) -> Iterator[tuple[str, object]]:
        """(global name, fp32 master view of param shape), in buffer order."""
        return self.named("master")

    def load_named(self, arrays: Mapping[str, np.ndarray], buf: str = "master",
                   blocks: Iterable[str] | None = None) -> None:
        """Copy {global name: whole array} into `master`, `m` or `v` (import, resume,
        resharding); sharded, only the own segment of each block is kept.

        Every parameter of this stage (of `blocks`, when given) must be present with its exact
        shape; other names are ignored. Materialised views of the loaded blocks are refreshed
        from the new masters (sharded: dropped; the schedule gathers them again).
        """
        if buf not in STATE_BUFFERS:
            raise ValueError(f"buffer {buf!r} is not one of: {', '.join(STATE_BUFFERS)}")
        want = set(self.block_names if blocks is None else blocks)
        for b in want:
            self.block(b)
        names = [n for n in self._spec if self._param_block[n] in want]
        missing = [n for n in names if n not in arrays]
        if missing:
            raise KeyError(
                f"{buf}: {len(missing)} parameter(s) of this stage missing, first {missing[0]!r}"
            )
        for name in names:
            arr, spec = arrays[name], self._spec[name]
            if tuple(arr.shape) != spec.shape:
                raise ValueError(
                    f"{buf}: parameter {name!r} has shape {tuple(arr.shape)}, expected "
                    f"{spec.shape}"
                )
        flat = self.buffer(buf)
        for name in names:
            self._put(flat, name, arrays[name])
        if buf == "master":
            for block in [b for b in self._views if b in want]:
                if self.sharded:
                    self.drop_view(block)
                else:
                    self.materialize_view(block)

    def state_dict(self) -> dict[str, dict[str, object]]:
        """{"master"|"m"|"v": {global name: view}}: views into the live buffers, not copies
        (unsharded only: a sharded state holds segments; see `Executor.iter_full_state`)."""
        self._need_whole("state_dict()")
        return {buf: dict(self.named(buf)) for buf in STATE_BUFFERS}

    def load_state_dict(self, state: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Inverse of `state_dict` (each buffer must cover every parameter of the stage); works
        sharded too (keeps the own segments)."""
        for buf in STATE_BUFFERS:
            if buf not in state:
                raise KeyError(f"stage state is missing {buf!r}")
            self.load_named(state[buf], buf)

    # -- working views --------------------------------------------------------------------------

    def materialize_view(self, block: str):
        """Make the block's working parameter view current; returns it flat.

        Unsharded fp32: the view is the master slice (nothing is allocated). fp16, bf16:
        allocate `params.view.<block>` on first use and cast the master slice into it (round to
        nearest even). Sharded: allocate the whole-block view (16-bit or fp32) and cast / copy
        the own master segment into its segment; the other segments are the caller's to
        all-gather.
        """
        master = self.master_flat(block)
        if not self.separate_views:
            return master
        view = self._views.get(block)
        if view is None and block in self._spare_views:
            view = self._views[block] = self._spare_views.pop(block)
        if view is None:
            a, b = self._block_range[block]
            view = self.ledger.alloc(
                f"params.view.{block}", (b - a,), self.view_dtype, self.xp, zero=False
            )
            self._views[block] = view
        lo, hi = self._seg[block]
        self.kernels.assign(view[lo:hi], master)  # fp32 -> fp16 / bf16 cast (or copy)
        return view

    def drop_view(self, block: str) -> None:
        """Release the block's view (a no-op when the view is the master)."""
        self.block(block)
        view = self._views.pop(block, None)
        if view is not None and self.keep_buffers:
            self._spare_views[block] = view
        elif view is not None:
            self.ledger.free(view)

    def has_view(self, block: str) -> bool:
        self.block(block)
        return not self.separate_views or block in self._views

    def view_flat(self, block: str):
        """The block's working view, flat (a separate view must be materialised first)."""
        if not self.separate_views:
            return self.master_flat(block)
        try:
            return self._views[block]
        except KeyError:
            self.block(block)
            raise RuntimeError(
                f"the view of block {block!r} is not materialised: call "
                "materialize_view first (a schedule must materialise a view before use)"
            ) from None

    def view(self, block: str) -> dict[str, object]:
        """{local name: working view (param shape, fp16, bf16 or fp32)} of a block."""
        a, _ = self.block_range(block)
        return self._split(block, self.view_flat(block), base=a)

    # -- gradients ------------------------------------------------------------------------------

    def alloc_grad(self, block: str):
        """Allocate the block's zeroed fp32 gradient `grads.<block>`; returns it flat."""
        a, b = self.block_range(block)
        if block in self._grads:
            raise RuntimeError(f"the gradient of block {block!r} is already allocated")
        g = self._spare.pop(block, None)
        if g is not None:
            g.fill(0)
        else:
            g = self.ledger.alloc(f"grads.{block}", (b - a,), np.float32, self.xp)
        self._grads[block] = g
        return g

    def _release(self, block: str, g) -> None:
        """A whole gradient given up: kept for the next alloc_grad (`keep_buffers`), or freed."""
        if self.keep_buffers and block not in self._spare:
            self._spare[block] = g
        else:
            self.ledger.free(g)

    def free_grad(self, block: str) -> None:
        """Release the block's gradient buffer (a no-op when none is held)."""
        self.block(block)
        g = self._grads.pop(block, None)
        shrunk = block in self._shrunk
        self._shrunk.discard(block)
        if g is not None and shrunk:
            self.ledger.free(g)
        elif g is not None:
            self._release(block, g)

    def has_grad(self, block: str) -> bool:
        self.block(block)
        return block in self._grads

    def grad_flat(self, block: str):
        """The block's whole flat fp32 gradient (shape (block size,))."""
        if block in self._shrunk:
            raise RuntimeError(f"the gradient of block {block!r} holds only this replica's "
                               "segment (after shrink_grad): use grad_segment")
        try:
            return self._grads[block]
        except KeyError:
            self.block(block)
            raise RuntimeError(
                f"the gradient of block {block!r} is not allocated: call alloc_grad first"
            ) from None

    def grad_segment(self, block: str):
        """The part of the block's gradient matching `flat(buf, block)`: the own segment when
        sharded (after the reduce-scatter it holds the reduced values), else the whole block."""
        if block in self._shrunk:
            return self._grads[block]
        lo, hi = self.segment(block)
        return self.grad_flat(block)[lo:hi]

    def shrink_grad(self, block: str):
        """Sharded, after the reduce-scatter: keep only the own segment of the block's gradient
        (a segment-sized copy under the same tag; the whole buffer is released). Returns it."""
        if not self.sharded or block in self._shrunk:
            return self.grad_segment(block)
        full = self.grad_flat(block)
        lo, hi = self._seg[block]
        g = self.ledger.alloc(f"grads.{block}", (hi - lo,), np.float32, self.xp, zero=False)
        g[...] = full[lo:hi]
        self._release(block, full)
        self._grads[block] = g
        self._shrunk.add(block)
        return g

    def grad(self, block: str) -> dict[str, object]:
        """{local name: fp32 gradient view (param shape)} of a block."""
        a, _ = self.block_range(block)
        return self._split(block, self.grad_flat(block), base=a)

    # -- accounting -----------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes of every array this state holds now (masters, moments, views, gradients)."""
        held = [self.master_buf, self.m_buf, self.v_buf, *self._views.values(),
                *self._grads.values(), *self._spare.values(), *self._spare_views.values()]
        return sum(int(a.nbytes) for a in held)

    def _drop_spares(self) -> None:
        """Free the views and gradients kept for reuse (`keep_buffers`)."""
        self.ledger.free(*self._spare.values(), *self._spare_views.values())
        self._spare.clear()
        self._spare_views.clear()

    def close(self) -> None:
        """Release every buffer from the ledger (the state is unusable afterwards)."""
        for block in list(self._views):
            self.drop_view(block)
        for block in list(self._grads):
            self.free_grad(block)
        self._drop_spares()
        self.ledger.free(self.master_buf, self.m_buf, self.v_buf)


__all__ = [
    "STATE_BUFFERS",
    "BUFFER_TAGS",
    "GRAD_BYTES_PER_PARAM",
    "STATE_BYTES_PER_PARAM",
    "StageState",
    "held_elements",
    "segment_bounds",
    "shard_size",
    "view_bytes_per_param",
    "view_cast_bytes_per_param",
]
