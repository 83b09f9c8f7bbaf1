"""Whole blocks out of a stage whose optimizer state may be sharded: for checkpoints and checks.

    for block, arrays in iter_full_state(executor):     # {buffer: {global name: fp32 array}}
        ...
    iter_full_state(executor, mean=True)                # the replicas' mean (partial sync)
    full_params(executor)                               # {global name: whole fp32 master}

Every array is a host numpy array: on the host, unsharded, views into the live buffers (no copy,
no communication); on a device, one download per buffer and block. Sharded
(`ratrain` at dp > 1), each buffer of a block is ring all-gathered through the communication
engine over the stage's replicas into a block-sized buffer (ledger `comm.gather.<buffer>`),
released when the next block is asked for: at most one extra block is held, and the arrays are
valid only until then (copy what you keep). Collective over the stage's replicas: every replica
iterates to the end, in the same order. `mean=True` (partial synchronization, whose replicas
differ): each buffer of a block is copied (ledger `comm.mean.<buffer>`), all-reduced over the
stage's replicas and divided by dp, so every replica gets the replicas' mean, one block at a time.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ratrain.device import to_host
from ratrain.exec.params import STATE_BUFFERS


def iter_full_state(ex, buffers=STATE_BUFFERS, mean: bool = False):
    """Yield `(block, {buffer: {global name: fp32 array of the parameter's shape}})` for each
    block of `ex`'s stage in model order, buffers from `("master", "m", "v")`, after the step's
    deferred work is flushed (see the module); `mean`: the replicas' mean (collective)."""
    ex.flush()
    for k in buffers:
        if k not in STATE_BUFFERS:
            raise ValueError(f"buffer {k!r} is not one of: {', '.join(STATE_BUFFERS)}")
    state = ex.state
    for b in ex.blocks:
        spec = state.block(b)
        base, end = state.block_range(b)
        if not ex.sharded and not (mean and ex.dp > 1):
            host = {k: to_host(state.buffer(k)[base:end]) for k in buffers}  # views on the host
            yield b, {k: {p.name: host[k][_local(state, p.name, base)].reshape(p.shape)
                          for p in spec.params} for k in buffers}
            continue
        with _whole_block(ex, b, buffers, base, end, mean) as host:
            yield b, {k: {p.name: host[k][_local(state, p.name, base)].reshape(p.shape)
                          for p in spec.params} for k in buffers}


@contextlib.contextmanager
def _whole_block(ex, b: str, buffers, base: int, end: int, mean: bool):
    """Block `b`'s buffers as whole host arrays, held in block-sized buffers of the ledger
    until the caller is done: the own segments all-gathered (sharded), or the replicas' mean
    (`mean`: copies summed by the runtime's all-reduce, divided by dp)."""
    state, bufs = ex.state, {}
    try:
        for k in buffers:
            buf = ex.ledger.alloc(f"comm.{'mean' if mean else 'gather'}.{k}", (end - base,),
                                  np.float32, ex.ctx.xp, zero=False)
            bufs[k] = buf
            if mean:
                buf[...] = state.flat(k, b)
                ex.engine.allreduce(buf, ex.topo.dp_comm).result()
                buf /= ex.dp
            else:
                lo, hi = state.segment(b)
                buf[lo:hi] = state.flat(k, b)
                ex.engine.allgather(buf, ex.topo.dp_comm).result()
        yield {k: to_host(buf) for k, buf in bufs.items()}
    finally:
        ex.ledger.free(*bufs.values())


def _local(state, name: str, base: int) -> slice:
    """Parameter `name`'s range inside its block's flat range that starts at `base`."""
    a, e = state.param_range(name)
    return slice(a - base, e - base)


def full_params(ex) -> dict[str, np.ndarray]:
    """{global name: whole fp32 master (a copy)} of `ex`'s stage; collective over the stage's
    replicas (see `iter_full_state`). For tests and hash checks."""
    return {name: np.array(a) for _, st in iter_full_state(ex, ("master",))
            for name, a in st["master"].items()}


__all__ = ["full_params", "iter_full_state"]
