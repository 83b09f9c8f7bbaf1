"""A pipeline stage's parameters, gradients and optimizer moments as flat buffers.

One `StageState` per rank holds, for the blocks of its stage (in model order):

- `master_buf`: one flat fp32 array of every parameter (ledger tag `params.master`);
- `m_buf`, `v_buf`: AdamW's first and second moments, flat fp32 arrays of the same size (tags `optim.m`,
  `optim.v`), allocated and zeroed at construction so a stage's steady memory is known up front;
- per-block working views: in fp32 the view *is* the block's master slice (no allocation); in
  fp16 `materialize_view(block)` allocates `params.view.<block>` and casts the master slice into
  it, `drop_view(block)` releases it;
- per-block fp32 gradient buffers `grads.<block>`, allocated zeroed by `alloc_grad` and released
  by `free_grad`; backward kernels add into them.

Each block is a contiguous slice of the flat buffers, in the order of `BlockSpec.params`, so
per-block lifecycle actions (sync, update, materialise) deal with one contiguous range, and
checkpoints and Hugging Face import/export address parameters by their global names.

    state = StageState(stage_blocks(cfg.model, pp, stage), cfg.precision, ledger, seed=cfg.init.seed)
    state.materialize_view("layers.0")
    p = state.view("layers.0")  # {"attn.wq": (H, H), ...}
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from ratrain.exec.spec import BlockSpec, ParamSpec, init_param

KINDS = ("master", "m", "v")  # the flat fp32 states a stage holds


class StageState:
    """Flat fp32 masters, AdamW moments, working views and gradients for one stage's blocks.

    Args:
        blocks: the stage's blocks in model order (`spec.stage_blocks`).
        precision: "fp32" (views are the masters) or "fp16" (views are fp16 copies).
        ledger: the rank's DDR ledger; every buffer here is allocated through it.
        xp: the array module (numpy or cupy).
        seed: `init.seed`; each parameter starts at `spec.init_param(p, seed)`, which depends only
            on (seed, global name), so the union of the stages of any split equals pp = 1.
        initial: optional {global name: array} to start from instead (Hugging Face import);
            it must hold every parameter of the stage (extra names are ignored).
    """

    def __init__(
        self,
        blocks: Iterable[BlockSpec],
        precision: str,
        ledger,
        xp=np,
        seed: int = 1234,
        initial: Mapping[str, np.ndarray] | None = None,
    ):
        if precision not in ("fp32", "fp16"):
            raise ValueError(f"precision={precision!r} is not one of: fp32, fp16")
        self.blocks: list[BlockSpec] = list(blocks)
        if not self.blocks:
            raise ValueError("a stage needs at least one block")
        self.precision = precision
        self.view_dtype = np.float16 if precision == "fp16" else np.float32
        self.ledger = ledger
        self.xp = xp
        self._block = {b.name: b for b in self.blocks}
        if len(self._block) != len(self.blocks):
            raise ValueError("duplicate block names in the stage")

        # Offsets: block -> (start, stop) in the flat buffers; param -> (start, stop).
        self._block_range: dict[str, tuple[int, int]] = {}
        self._param_range: dict[str, tuple[int, int]] = {}
        self._spec: dict[str, ParamSpec] = {}
        off = 0
        for b in self.blocks:
            start = off
            for p in b.params:
                self._param_range[p.name] = (off, off + p.size)
                self._spec[p.name] = p
                off += p.size
            self._block_range[b.name] = (start, off)
        self.size = off  # parameters on this stage

        self.master_buf = ledger.alloc("params.master", (self.size,), np.float32, xp)  # (N,)
        self.m_buf = ledger.alloc("optim.m", (self.size,), np.float32, xp)  # (N,)
        self.v_buf = ledger.alloc("optim.v", (self.size,), np.float32, xp)  # (N,)
        self._views: dict[str, object] = {}  # fp16 only: block -> flat fp16 view
        self._grads: dict[str, object] = {}  # block -> flat fp32 gradient

        if initial is not None:
            self.load_named(initial)
        else:
            for name, spec in self._spec.items():
                a, b = self._param_range[name]
                self.master_buf[a:b] = xp.asarray(init_param(spec, seed).reshape(-1))

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

    def buffer(self, kind: str):
        """The whole flat fp32 buffer of `master`, `m` or `v` (shape (N,))."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of: {', '.join(KINDS)}")
        return getattr(self, f"{kind}_buf")

    def flat(self, kind: str, block: str):
        """The block's slice of `master`, `m` or `v` (a view, fp32, shape (block size,))."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of: {', '.join(KINDS)}")
        a, b = self.block_range(block)
        return self.buffer(kind)[a:b]

    def master_flat(self, block: str):
        return self.flat("master", block)

    def master(self, block: str) -> dict[str, object]:
        """{local name: fp32 master view (param shape)} of a block."""
        return self._split(block, self.master_buf)

    def named(self, kind: str = "master") -> Iterator[tuple[str, object]]:
        """(global name, view of param shape) of `master`, `m` or `v`, in buffer order."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of: {', '.join(KINDS)}")
        buf = self.buffer(kind)
        for name, spec in self._spec.items():
            a, b = self._param_range[name]
            yield name, buf[a:b].reshape(spec.shape)

    def named_master(self) -> Iterator[tuple[str, object]]:
        """(global name, fp32 master view of param shape), in buffer order."""
        return self.named("master")

    def load_named(self, arrays: Mapping[str, np.ndarray], kind: str = "master") -> None:
        """Copy {global name: array} into `master`, `m` or `v` (import, resume, resharding).

        Every parameter of this stage must be present with its exact shape; names of other
        stages are ignored. Materialised fp16 views are refreshed from the new masters.
        """
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of: {', '.join(KINDS)}")
        missing = [n for n in self._spec if n not in arrays]
        if missing:
            raise KeyError(
                f"{kind}: {len(missing)} parameter(s) of this stage missing, first {missing[0]!r}"
            )
        for name, spec in self._spec.items():
            arr = arrays[name]
            if tuple(arr.shape) != spec.shape:
                raise ValueError(
                    f"{kind}: parameter {name!r} has shape {tuple(arr.shape)}, expected "
                    f"{spec.shape}"
                )
        buf = self.buffer(kind)
        for name in self._spec:
            a, b = self._param_range[name]
            buf[a:b] = self.xp.asarray(arrays[name], dtype=np.float32).reshape(-1)
        if kind == "master":
            for block in list(self._views):
                self.materialize_view(block)

    def state_dict(self) -> dict[str, dict[str, object]]:
        """{"master"|"m"|"v": {global name: view}}: views into the live buffers, not copies."""
        return {kind: dict(self.named(kind)) for kind in KINDS}

    def load_state_dict(self, state: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Inverse of `state_dict` (each kind must cover every parameter of the stage)."""
        for kind in KINDS:
            if kind not in state:
                raise KeyError(f"stage state is missing {kind!r}")
            self.load_named(state[kind], kind)

    # -- working views --------------------------------------------------------------------------

    def materialize_view(self, block: str):
        """Make the block's working parameter view current; returns it flat.

        fp32: the view is the master slice (nothing is allocated). fp16: allocate
        `params.view.<block>` on first use and cast the master slice into it (round to nearest).
        """
        master = self.master_flat(block)
        if self.precision == "fp32":
            return master
        view = self._views.get(block)
        if view is None:
            view = self.ledger.alloc(
                f"params.view.{block}", master.shape, np.float16, self.xp, zero=False
            )
            self._views[block] = view
        view[...] = master  # fp32 -> fp16 cast
        return view

    def drop_view(self, block: str) -> None:
        """Release the block's fp16 view (a no-op in fp32, where the view is the master)."""
        self.block(block)
        view = self._views.pop(block, None)
        if view is not None:
            self.ledger.free(view)

    def has_view(self, block: str) -> bool:
        self.block(block)
        return self.precision == "fp32" or block in self._views

    def view_flat(self, block: str):
        """The block's working view, flat (fp16 must be materialised first)."""
        if self.precision == "fp32":
            return self.master_flat(block)
        try:
            return self._views[block]
        except KeyError:
            self.block(block)
            raise RuntimeError(
                f"the fp16 view of block {block!r} is not materialised: call "
                "materialize_view first (a schedule must materialise a view before use)"
            ) from None

    def view(self, block: str) -> dict[str, object]:
        """{local name: working view (param shape, fp16 or fp32)} of a block."""
        a, _ = self.block_range(block)
        return self._split(block, self.view_flat(block), base=a)

    # -- gradients ------------------------------------------------------------------------------

    def alloc_grad(self, block: str):
        """Allocate the block's zeroed fp32 gradient `grads.<block>`; returns it flat."""
        a, b = self.block_range(block)
        if block in self._grads:
            raise RuntimeError(f"the gradient of block {block!r} is already allocated")
        g = self.ledger.alloc(f"grads.{block}", (b - a,), np.float32, self.xp)
        self._grads[block] = g
        return g

    def free_grad(self, block: str) -> None:
        """Release the block's gradient buffer (a no-op when none is held)."""
        self.block(block)
        g = self._grads.pop(block, None)
        if g is not None:
            self.ledger.free(g)

    def has_grad(self, block: str) -> bool:
        self.block(block)
        return block in self._grads

    def grad_flat(self, block: str):
        """The block's flat fp32 gradient (shape (block size,))."""
        try:
            return self._grads[block]
        except KeyError:
            self.block(block)
            raise RuntimeError(
                f"the gradient of block {block!r} is not allocated: call alloc_grad first"
            ) from None

    def grad(self, block: str) -> dict[str, object]:
        """{local name: fp32 gradient view (param shape)} of a block."""
        a, _ = self.block_range(block)
        return self._split(block, self.grad_flat(block), base=a)

    # -- accounting -----------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes of every array this state holds now (masters, moments, views, gradients)."""
        held = [self.master_buf, self.m_buf, self.v_buf, *self._views.values(), *self._grads.values()]
        return sum(int(a.nbytes) for a in held)

    def close(self) -> None:
        """Release every buffer from the ledger (the state is unusable afterwards)."""
        for block in list(self._views):
            self.drop_view(block)
        for block in list(self._grads):
            self.free_grad(block)
        self.ledger.free(self.master_buf, self.m_buf, self.v_buf)


__all__ = ["KINDS", "StageState"]
