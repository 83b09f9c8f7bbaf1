"""What this rank's blocks keep per micro-batch, measured from the kernels' own caches.

`recompute: auto` (and the predicted peak every executor reports, `fit_rank_recompute`) plays the rank's action lists
through the memory model (`lifecycle.memory`) with these sizes: each block is run forward once
on zeros, per recompute choice for a layer, and its cache is weighed (one layer stands for all:
they have the same shapes). Views made for the measurement are dropped again; the sharded
views are cast, gathered and waited for as the schedule would.
"""

from __future__ import annotations

import numpy as np

from ratrain.exec import head, layers
from ratrain.exec.params import GRAD_BYTES_PER_PARAM
from ratrain.exec.spec import OFFLOAD, RECOMPUTE
from ratrain.lifecycle.memory import StageSizes, choose_recompute, peaks, simulate_peak
from ratrain.lifecycle.passes import offload
from ratrain.lifecycle.recovery import choose_recovery


def measure_stage_sizes(executor, recompute: dict[str, str]) -> StageSizes:
    """Activation bytes per recompute choice of `executor`'s blocks (see the module), with the
    resident bytes the ledger holds now and the kernels' workspace (a layer's, or the head's
    where this stage has it and it is larger), for `simulate_peak`.

    Collective over the stage's replicas when the optimizer state is sharded (views are
    all-gathered); call it at the same point on every rank."""
    ex, ctx = executor, executor.ctx
    shape = ex.act_shape
    made = [b for b in ex.blocks if not ex.state.has_view(b)]
    act: dict[str, dict[str, int]] = {}
    x = ctx.xp.zeros(shape, ctx.dtype)
    ids = ctx.xp.zeros(shape[:2], np.int64)
    layer_sizes = None
    run = ex.compute
    try:
        for b in ex.blocks:
            role = run.role[b]
            if role == "layer" and layer_sizes is not None:
                act[b] = dict(layer_sizes)
                continue
            ex.materialize_now(b)
            if run.tied and role == "head" and not ex.state.has_view("embed"):
                ex.materialize_now("embed")
            p = run.view(b)
            if role == "embed":
                act[b] = {"none": layers.cache_nbytes(layers.embed_forward(ids, p, ctx)[1])}
            elif role == "head":
                act[b] = {"none": layers.cache_nbytes(
                    head.head_forward(x, ids, p, ctx, backward=True)[1])}
            else:
                layer_sizes = {r: layers.cache_nbytes(layers.layer_forward(x, p, ctx, r)[1])
                               for r in RECOMPUTE}
                act[b] = dict(layer_sizes)
    finally:
        for b in made:
            ex.state.drop_view(b)
    params = {b.name: b.size for b in ex.state.blocks}
    extra = layers.layer_workspace_nbytes(ctx, shape[0], shape[1], backward=True)
    if "head" in (run.role[b] for b in ex.blocks):  # the larger of the two: never at once
        extra = max(extra, head.head_workspace_nbytes(ctx, shape[0], shape[1], backward=True))
    if ex.info.half:
        extra += 4 * max(params.values())  # fp32 GEMM copies of a block's weights
    held_grads = sum(GRAD_BYTES_PER_PARAM * params[b] for b in ex.blocks if ex.state.has_grad(b))
    return StageSizes(
        precision=ex.cfg.precision, params=params, act=act,
        full_act={b: modes["none"] for b, modes in act.items()},
        message_bytes=int(np.prod(shape)) * np.dtype(ctx.dtype).itemsize,
        static=ex.ledger.current - held_grads, extra=extra, recompute=recompute,
        shards=ex.info.shards)


def fit_rank_recompute(executor) -> tuple[dict[str, str], int]:
    """What each of `executor`'s layers recomputes under `schedule.recompute` (`auto`: the
    fewest layers that fit the ledger's cap, per the plan's `recovery`), and the peak bytes the
    memory model predicts with it: the stage's sizes measured, then its plan's lists played.

    Collective like `measure_stage_sizes`: `runtime.rank.build_rank` calls it on every rank
    at the same point, after the executor is made and before its first step."""
    ex = executor
    choice = dict(ex.recovery)  # schedule.recompute as it stands (auto: none)
    sizes = measure_stage_sizes(ex, choice)
    if ex.offloader is not None:  # keep / recompute / offload, and the tier's bytes
        return _fit_with_tier(ex, sizes, choice)
    lists, passes = ex.plan.stage_steps(ex.stage, 2), ex.plan.passes
    if ex.cfg.schedule.recompute == "auto":
        chosen, peak = choose_recompute(ex.ledger.cap, sizes, lists, ex.blocks,
                                        ex.plan.per_layer_recovery, passes)
        return {b: chosen.get(b, "none") for b in choice}, peak
    return choice, simulate_peak(lists, ex.blocks, sizes, passes)


def _fit_with_tier(ex, sizes: StageSizes, choice: dict[str, str]):
    """`fit_rank_recompute` on a rank with a memory tier: under `recompute: auto` each layer
    kept, recomputed or offloaded (`lifecycle.recovery.choose_recovery`, by
    `offload.activations`), else the choice as it stands; the activations' file sized for the
    tier bytes the memory model plays."""
    off = ex.offloader
    base = ex.plan
    if any(offload.layers_of(base)):
        base = offload.with_layers(base, [()] * ex.pp, validate=False)

    def lists_for(offloaded):
        return offload.lists_with(base, ex.stage, offloaded, 2)

    def walk(lists, s):
        return peaks(lists, ex.blocks, s, base.passes)

    mode, layers = ex.cfg.offload.activations, list(choice)
    if ex.cfg.schedule.recompute == "auto":
        layer = next((b for b in ex.blocks if b in choice), None)
        top = (off.rates.offloadable(ex.cfg.model, ex.blocks, ex.micro_batch,
                                     sizes.act[layer]["none"]) if layer is not None else 0)
        choice, peak, tier = choose_recovery(
            ex.ledger.cap, sizes, lists_for, ex.blocks, ex.plan.per_layer_recovery, mode, top,
            off.store.ledger.cap, walk)
        choice = {b: choice.get(b, "none") for b in layers}
    else:
        peak, tier = walk(lists_for(tuple(b for b, c in choice.items() if c == OFFLOAD)),
                          sizes.with_recompute(choice))
    off.prepare_activations(tier - off.state_bytes)
    return choice, peak


__all__ = ["fit_rank_recompute", "measure_stage_sizes"]
