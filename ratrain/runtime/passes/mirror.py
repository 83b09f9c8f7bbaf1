"""The peer copies' runner (elastic mode; the pass: `lifecycle.passes.mirror`).

`Mirror` keeps, on replica q of a stage, a copy of replica (q - 1) mod dp's segment of every
block's master and moments (`state`: a `StageState` of that segment, its buffers in the ledger
under `copy.*`), with a segment-sized gradient per block. `start()` fills it from its owner
once, when the rank is built (collective over the stage's replicas: after a checkpoint resume
or a recovery as at a fresh start). Each step `CopyGrad` sends this replica's reduced
gradient segments to its keeper and receives the kept peer's (in the engine), `WaitCopy`
completes them, and `CopyUpdate` runs the same AdamW on the copy as the owner runs on its
segment, from the same facts, so the copy holds the owner's bits. `settle()` finishes a
committed update cut off by a loss (`Executor.settle`), and `elastic.recover` takes the copy
as the lost segment's source.
"""

from __future__ import annotations

from ratrain.exec.optim import ADAMW_BYTES_PER_PARAM, AdamW
from ratrain.exec.params import STATE_BUFFERS, StageState
from ratrain.exec.spec import stage_blocks
from ratrain.lifecycle.passes.mirror import CopyGrad, CopyUpdate, WaitCopy
from ratrain.runtime.passes.base import Runner

TAG_BASE = 7000  # + the block's index in the stage: its copy gradient's messages
TAG_FILL = 6900  # + the buffer's index: the copy's fill at start


class Tagged:
    """A ledger whose allocations go under `prefix.<tag>` (the copy's own tags)."""

    def __init__(self, ledger, prefix: str):
        self._ledger, self._prefix = ledger, prefix

    def alloc(self, tag, *args, **kw):
        return self._ledger.alloc(f"{self._prefix}.{tag}", *args, **kw)

    def __getattr__(self, name):
        return getattr(self._ledger, name)


class Mirror(Runner):
    """One rank's copy of its kept peer's segment (see the module)."""

    def __init__(self, ex):
        self.ex = ex
        self.dp = ex.dp
        self.replica = (ex.replica - 1) % ex.dp  # the replica whose segment this copy is
        self.keeper = (ex.replica + 1) % ex.dp  # the replica that keeps this one's
        cfg = ex.cfg
        p = cfg.parallel
        blocks = stage_blocks(cfg.model, p.pp, ex.stage, p.stage_layers())
        self.state = StageState(blocks, cfg.precision, Tagged(ex.ledger, "copy"), ex.ctx.xp,
                                cfg.init.seed, shard=(self.replica, ex.dp),
                                kernels=ex.ctx.kernels)
        for b in self.state.block_names:  # a segment-sized gradient each, kept
            self.state.alloc_grad(b)
            self.state.shrink_grad(b)
        self.opt = AdamW(cfg.optim, ex.ctx.kernels)
        self.index = {b: i for i, b in enumerate(self.state.block_names)}
        self.flying: list = []

    @classmethod
    def of_executor(cls, ex, p, resource=None) -> Mirror:
        return cls(ex)

    def handlers(self) -> dict:
        return {CopyGrad: self._copy_grad, WaitCopy: self._wait, CopyUpdate: self._update}

    def start(self) -> None:
        """Fill the copy from its owner, and take its optimizer step (collective over the
        stage's replicas: each sends its segment to its keeper)."""
        ex, comm = self.ex, self.ex.topo.dp_comm
        own = ex.state
        futs = []
        for k, buf in enumerate(STATE_BUFFERS):
            futs.append(ex.engine.send(own.buffer(buf), self.keeper, TAG_FILL + k, comm))
            futs.append(ex.engine.recv(self.state.buffer(buf), self.replica, TAG_FILL + k, comm))
        for f in futs:
            f.result()
        self.opt.load_state_dict(ex.opt.state_dict())

    def load_state_dict(self, sd: dict) -> None:
        self.opt.load_state_dict(sd["opt"])

    def _copy_grad(self, a: CopyGrad) -> None:
        ex, comm = self.ex, self.ex.topo.dp_comm
        for b in a.blocks:
            tag = TAG_BASE + self.index[b]
            self.flying.append(ex.engine.send(ex.state.grad_segment(b), self.keeper, tag, comm))
            self.flying.append(ex.engine.recv(self.state.grad_segment(b), self.replica, tag,
                                              comm))

    def _wait(self, a: WaitCopy) -> None:
        for f in self.flying:
            f.result()
        self.flying = []

    def _update(self, a: CopyUpdate) -> None:
        pend = self.ex._pending
        if not pend.skipped:
            self._apply(a.block, pend)

    def _apply(self, block: str, pend) -> None:
        lo, hi = self.state.segment(block)
        with self.ex._pace_memory(ADAMW_BYTES_PER_PARAM * (hi - lo)):
            self.opt.update_block(self.state, block, pend.t, pend.lr, pend.grad_scale)

    def settle(self, pending) -> None:
        for b in self.state.block_names:
            if self.opt.block_step(b) < pending.t:
                self._apply(b, pending)


__all__ = ["Mirror", "Tagged"]
