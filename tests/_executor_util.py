"""Shared by the executor tests: a tiny model trained a few steps at a pp x dp layout."""

import numpy as np

from ratrain.config import (
    Config,
    InitConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    ScheduleConfig,
)
from ratrain.runtime.rank import build_rank
from ratrain.runtime.trace import Timeline

MODEL = ModelConfig(vocab_size=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn_hidden=64, seq_len=16)


def tiny_config(pp=1, dp=1, m=4, precision="fp32", policy="ratrain", recompute="none", steps=3,
                model=MODEL, micro_batch=2, grad_clip=1.0):
    return Config(
        model=model,
        parallel=ParallelConfig(pp=pp, dp=dp, micro_batch=micro_batch, num_micro_batches=m),
        precision=precision,
        schedule=ScheduleConfig(policy=policy, recompute=recompute),
        optim=OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=grad_clip, loss_scale_init=1024.0),
        init=InitConfig(seed=1),
        run=RunConfig(steps=steps, threads=1),
    )


def global_batch(cfg, step):
    """(dp*M, B, T) inputs and targets of a step: replica r takes its share of micro-batches
    from its offset (`ParallelConfig.share_offset`; [r*M, (r+1)*M) with equal shares)."""
    p, mc = cfg.parallel, cfg.model
    rng = np.random.default_rng(1000 + step)
    ids = rng.integers(0, mc.vocab_size, (p.dp * p.num_micro_batches, p.micro_batch, mc.seq_len + 1))
    return ids[..., :-1].copy(), ids[..., 1:].copy()


def train(cfg, comm=None, steps=None, cap=None, trace=None):
    """Train `steps` steps; returns (results, state, executor). `comm`: None for one rank.
    `executor.final_params`: {name: whole fp32 master} after the flush (gathered over dp when
    the optimizer state is sharded)."""
    rank = build_rank(cfg, comm, cap=cap, watchdog_s=60)
    ex = rank.executor
    if trace:  # every step's events, as run.trace keeps them (outside the ledger: cap tests)
        ex.timeline = Timeline(cfg.run.trace_bytes)
    replica = rank.topo.replica if rank.topo is not None else 0
    results = []
    try:
        lo = cfg.parallel.share_offset(replica)  # this replica's micro-batches (its share)
        sl = slice(lo, lo + cfg.parallel.micro_batches_of(replica))
        for s in range(steps or cfg.run.steps):
            inputs, targets = global_batch(cfg, s)
            results.append(ex.run_step(s, (inputs[sl], targets[sl])))
        ex.flush()
        ex.final_params = ex.full_params()
        if trace:
            ex.write_trace(trace)
    finally:
        rank.close()
    return results, rank.state, ex


def same_global_batch(cfg):
    """The 1 x 1 config with the same global batch as `cfg` (dp replicas -> more micro-batches)."""
    from dataclasses import replace

    p = cfg.parallel
    return replace(cfg, parallel=replace(p, pp=1, dp=1, num_micro_batches=p.num_micro_batches * p.dp))


def params_digest(params):
    """SHA-256 of {name: array} in name order."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()



def layer_weight_copy_nbytes(rank) -> int:
    """The bytes a rank's first decoder layer copies of its weights for its GEMMs each call
    (0: the GEMMs take the views as they lie in the flat buffer)."""
    from ratrain.exec import layers

    ex = rank.executor
    layer = next(b for b in ex.blocks if ex.compute.role[b] == "layer")
    if not rank.state.has_view(layer):
        ex.materialize_now(layer)
    return layers._gemm_weight_nbytes(ex.compute.view(layer), rank.ctx)
