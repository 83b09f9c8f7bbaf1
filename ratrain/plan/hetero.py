"""The planner for mixed clusters: layer splits and replica shares for ranks of unequal speed.

A heterogeneous cluster (`platform.classes`) runs at the pace of its slowest rank unless the
work is cut to the ranks: a stage of fast ranks takes more layers, a replica of fast ranks more
micro-batches. This module decides both, from each rank's class:

    classes = class_map(cfg.platform, hosts)        # shim: the class of every world rank
    cfg = resolve(cfg, classes)                     # `auto` keys -> concrete counts
    split_layers(cfg, classes), split_shares(cfg, classes, layers)

The model is the compute each rank does per micro-batch: a stage's blocks (the embedding and
the head weighed by their own flops, the embedding's gather by its bytes at the DDR bandwidth)
at the rate of the rank that holds them. Layers go to stages so that the slowest stage (over
its replicas) is as fast as it can be (an exact min-max over contiguous splits); micro-batches
go to replicas so that the slowest replica (its slowest stage, times its micro-batches) is as
fast as it can be (greedy, exact for min-max). Memory is checked after: a stage over its
class's DDR cap is refused before any work (`plan.check`).
"""

from __future__ import annotations

from dataclasses import replace

from ratrain.comm.topology import coords
from ratrain.exec.spec import block_flops_per_token, stage_layers
from ratrain.plan.cost import DEFAULT_MEM_BANDWIDTH
from ratrain.shim.platform import class_profile

ROLE_ORDER = ("embed", "layer", "head")


def rank_rates(cfg, classes) -> list[tuple[float, float]]:
    """(compute flop/s, DDR bytes/s) of every world rank from its class (`classes[r]`, None:
    no classes). A profile without a compute rate counts as 1 flop/s (only ratios matter)."""
    world = cfg.parallel.world_size
    names = classes if classes is not None else (None,) * world
    cache: dict = {}
    out = []
    for name in names:
        if name not in cache:
            prof = class_profile(cfg.platform, name)
            fact = prof.fact("ddr_bandwidth")
            cache[name] = (float(prof.compute_flops or 1.0),
                           float(fact.value) if fact is not None and fact.value
                           else DEFAULT_MEM_BANDWIDTH)
        out.append(cache[name])
    return out


def grid_rates(cfg, classes) -> list[list[tuple[float, float]]]:
    """`rates[stage][replica]` of the grid under `parallel.placement`."""
    p = cfg.parallel
    rates = rank_rates(cfg, classes)
    grid = [[None] * p.dp for _ in range(p.pp)]
    for r, rate in enumerate(rates):
        s, q = coords(r, p.pp, p.dp, p.placement)
        grid[s][q] = rate
    return grid


def role_seconds(cfg, role: str, rate: tuple[float, float]) -> float:
    """Seconds of one micro-batch's forward and backward of one block of `role` at `rate`."""
    m, tokens = cfg.model, cfg.parallel.micro_batch * cfg.model.seq_len
    flops, ddr = rate
    if role == "embed":  # a gather (and its scatter-add): memory-bound
        act = 2 if cfg.precision == "fp16" else 4
        return 2 * tokens * m.hidden * act / ddr
    return block_flops_per_token(m, role) * tokens / flops


def stage_seconds(cfg, stage: int, layers: int, rate) -> float:
    """One micro-batch through stage `stage` holding `layers` layers, at `rate`."""
    pp = cfg.parallel.pp
    t = layers * role_seconds(cfg, "layer", rate)
    if stage == 0:
        t += role_seconds(cfg, "embed", rate)
    if stage == pp - 1:
        t += role_seconds(cfg, "head", rate)
    return t


def split_layers(cfg, classes) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's time per micro-batch, each stage timed
    at its slowest replica's rate (exact: dynamic programming over contiguous splits)."""
    p, n = cfg.parallel, cfg.model.layers
    grid = grid_rates(cfg, classes)

    def cost(s: int, k: int) -> float:
        return max(stage_seconds(cfg, s, k, rate) for rate in grid[s])

    # best[s][j]: the least max-time of stages s.. holding the last j layers
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p.pp + 1)]
    take = [[0] * (n + 1) for _ in range(p.pp + 1)]
    best[p.pp][0] = 0.0
    for s in range(p.pp - 1, -1, -1):
        for j in range(1, n + 1):
            for k in range(1, j - (p.pp - 1 - s) + 1):  # leave a layer for every later stage
                v = max(cost(s, k), best[s + 1][j - k])
                if v < best[s][j] - 1e-15 * v:  # ties: the earlier stage takes fewer
                    best[s][j], take[s][j] = v, k
    out, j = [], n
    for s in range(p.pp):
        out.append(take[s][j])
        j -= take[s][j]
    return tuple(out)


def replica_seconds(cfg, classes, layers) -> list[float]:
    """Seconds per micro-batch of each replica: its slowest stage."""
    p = cfg.parallel
    grid = grid_rates(cfg, classes)
    return [max(stage_seconds(cfg, s, layers[s], grid[s][q]) for s in range(p.pp))
            for q in range(p.dp)]


def split_shares(cfg, classes, layers) -> tuple[int, ...]:
    """Micro-batches per replica (adding up to num_micro_batches x dp) minimising the slowest
    replica's time: each replica gets one, then each next one goes to the replica that would
    finish it first."""
    p = cfg.parallel
    per = replica_seconds(cfg, classes, layers)
    shares = [1] * p.dp
    for _ in range(p.num_micro_batches * p.dp - p.dp):
        q = min(range(p.dp), key=lambda i: ((shares[i] + 1) * per[i], i))
        shares[q] += 1
    return tuple(shares)


def with_measured_rates(cfg, classes, rates):
    """`cfg` with each `calibrate` class's compute_flops set to the slowest measured rate of its
    ranks (`rates[r]`: world rank r's flop/s, `classes[r]` its class), and calibrate off: the
    resolved config says what was used."""
    out = []
    for c in cfg.platform.classes:
        if c.calibrate:
            mine = [rates[r] for r, name in enumerate(classes) if name == c.name]
            if not mine:
                raise ValueError(f"platform.classes: class {c.name} has calibrate: true but no "
                                 "rank: give it ranks or hosts that match, or drop it")
            c = replace(c, compute_flops=float(min(mine)), calibrate=False)
        out.append(c)
    return replace(cfg, platform=replace(cfg.platform, classes=tuple(out)))


def resolve(cfg, classes):
    """`cfg` with `parallel.layers_per_stage: auto` and `replica_shares: auto` replaced by the
    counts this module chooses for ranks of `classes` (`shim.platform.class_map`; None: no
    classes, every rank alike). A config with nothing on auto comes back as it is."""
    p = cfg.parallel
    if not p.auto:
        return cfg
    layers = split_layers(cfg, classes) if p.layers_per_stage == p.AUTO else p.stage_layers()
    even = layers is None
    if even:
        layers = tuple(len(r) for r in stage_layers(cfg.model, p.pp))
    shares = (split_shares(cfg, classes, layers) if p.replica_shares == p.AUTO
              else p.replica_shares)
    return replace(cfg, parallel=replace(p, layers_per_stage=None if even else tuple(layers),
                                         replica_shares=shares))


__all__ = ["grid_rates", "rank_rates", "replica_seconds", "resolve", "role_seconds",
           "split_layers", "split_shares", "stage_seconds", "with_measured_rates"]
