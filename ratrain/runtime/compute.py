"""One stage's compute: its blocks run forward and backward on one micro-batch.

`StageCompute` calls the block kernels (`exec.layers`, `exec.head`) in block order (reverse
order backward) with the blocks' working views and gradient buffers, keeps each block's cache
per micro-batch (tracked in the DDR ledger as `activations.mb<i>.<block>`) until its backward,
runs each layer with its recompute choice, pads each block to the platform's time for its flops
when a pacer is given (`exec.spec.block_flops`; the embedding, a gather, is not paced), and runs
the lifecycle hooks a compute action carries around each block (`hook(hooks, block)`, the
executor's). Tied embeddings: the head uses the embedding's view and gradient as its weight.
With `run.graphs` on, the blocks' calls are device graphs (`exec.graphs`): each micro-batch
holds a slot from its forward to its backward, and what leaves the stage (the activations sent
on, the input gradient, the loss) is a copy of a graph's output.
"""

from __future__ import annotations

import contextlib

from ratrain.exec import graphs, head, layers
from ratrain.exec.spec import block_flops


class StageCompute:
    def __init__(self, cfg, state, ctx, ledger, pacer=None):
        self.cfg, self.state, self.ctx, self.ledger, self.pacer = cfg, state, ctx, ledger, pacer
        self.blocks = state.block_names
        self.role = {b.name: b.role for b in state.blocks}
        self.tied = cfg.model.tie_embeddings and "head" in self.role and "embed" in self.role
        self.tokens = cfg.parallel.micro_batch * cfg.model.seq_len
        self.recompute: dict[str, str] = {}  # layer -> recompute choice (set by the executor)
        self.caches: dict = {}  # (mb, block) -> the block's cache until its backward
        # the blocks' calls as device graphs (run.graphs), a slot per micro-batch in flight
        on = graphs.resolve(cfg.run.graphs, ctx, cfg.offload.activations != "off")
        self.graphs = graphs.BlockGraphs(ctx) if on else None
        self.slots: dict[int, int] = {}  # mb -> its slot, from its forward to its backward
        if self.graphs is not None:  # a graph reads the views and adds into the gradients
            state.keep_buffers = True  # where it was captured

    def view(self, block):
        """The block's working parameter view {local name: array}."""
        p = self.state.view(block)
        if self.tied and block == "head":
            p = {**p, "weight": self.state.view("embed")["weight"]}
        return p

    def grad(self, block):
        """The block's gradient buffer {local name: fp32 array} (backward adds into it)."""
        g = self.state.grad(block)
        if self.tied and block == "head":
            if not self.state.has_grad("embed"):
                self.state.alloc_grad("embed")
            g = {**g, "weight": self.state.grad("embed")["weight"]}
        return g

    def pace(self, role, phase, recompute="none"):
        """Pad a block's compute to the platform's time for its flops (platform.emulate)."""
        if self.pacer is None or role == "embed":
            return contextlib.nullcontext()
        return self.pacer.compute(block_flops(self.cfg.model, role, self.tokens, phase, recompute))

    def forward(self, mb, x, inputs, targets, keep_caches=True, pre=(), post=(), hook=None):
        """Run the blocks forward on micro-batch `mb` (`x`: the stage input, None on the first
        stage, which embeds `inputs[mb]`); returns (output, loss or None: a 0-d array).
        `keep_caches=False` (eval) keeps nothing and recomputes nothing."""
        loss = None
        slot = self._slot(mb) if keep_caches and self.graphs is not None else None
        for b in self.blocks:
            if hook:
                hook(pre, b)
            role, p = self.role[b], self.view(b)
            with self.pace(role, "forward"):
                if role == "embed":
                    x, cache = layers.embed_forward(inputs[mb], p, self.ctx)  # (B, T, C)
                elif role == "layer":
                    recompute = self.recompute[b] if keep_caches else "full"
                    if slot is None:
                        x, cache = layers.layer_forward(x, p, self.ctx, recompute)
                    else:
                        x, cache = self.graphs.forward(b, slot, x, p, recompute)
                elif slot is None:
                    # a 0-d array, on the device where it ran: the executor downloads
                    # the step's losses together (one host sync per step)
                    loss, cache = head.head_forward(x, targets[mb], p, self.ctx,
                                                    backward=keep_caches)
                else:
                    loss, cache = self.graphs.head_forward(b, slot, x, targets[mb], p)
                    loss = self._handed(loss)
            if keep_caches:
                self.ledger.track(f"activations.mb{mb}.{b}", *layers.cache_arrays(cache))
                self.caches[(mb, b)] = cache
            if hook:
                hook(post, b)
        return (x if "head" in self.role else self._handed(x)), loss

    def backward(self, mb, dy, dscale, pre=(), post=(), hook=None):
        """Run the blocks backward on micro-batch `mb` (`dy`: the output gradient, None on the
        last stage, whose head is seeded with `dscale`); returns the input gradient (None on
        the first stage), tracked in the ledger."""
        for b in reversed(self.blocks):
            if hook:
                hook(pre, b)
            role, cache = self.role[b], self.caches.pop((mb, b))
            p, g = self.view(b), self.grad(b)
            slot = self.slots.get(mb)
            with self.pace(role, "backward", cache.recompute):
                if role == "head" and slot is not None:
                    dx = self.graphs.head_backward(b, slot, dscale, cache, p, g)
                elif role == "head":
                    dx = head.head_backward(dscale, cache, p, g, self.ctx)  # (B, T, C)
                elif role == "layer" and slot is not None:
                    dx = self.graphs.backward(b, slot, dy, cache, p, g)
                elif role == "layer":
                    dx = layers.layer_backward(dy, cache, p, g, self.ctx)
                elif slot is not None:
                    self.graphs.embed_backward(b, slot, dy, cache, p, g)
                    dx = None
                else:
                    layers.embed_backward(dy, cache, p, g, self.ctx)
                    dx = None
            self.ledger.free(*layers.cache_arrays(cache), dy)
            if dx is not None:
                self.ledger.track(f"activations.mb{mb}.grad", dx)
            dy = dx
            if hook:
                hook(post, b)
        self.slots.pop(mb, None)
        return self._handed(dy)

    def _slot(self, mb: int) -> int:
        """Micro-batch `mb`'s slot: the lowest not held by another in flight."""
        held = set(self.slots.values())
        self.slots[mb] = next(s for s in range(len(held) + 1) if s not in held)
        return self.slots[mb]

    def _handed(self, a):
        """What leaves the stage (to a link, or the executor): a copy of a graph's output, which
        its next replay rewrites, else `a` itself."""
        if a is not None and self.graphs is not None and self.graphs.owns(a):
            return a.copy()
        return a


__all__ = ["StageCompute"]
