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
fast as it can be (greedy, exact for min-max). No stage takes more layers than its
classes' smallest DDR cap holds of masters and moments (`state_bytes`); the rest of memory is
checked after: a stage over its class's DDR cap is refused before any work (`plan.check`).

The planner (`candidates`, `best_plans`) scores every layout by the simulator on the whole
grid (`predict`: `plan.simulate.simulate_config` with the ranks' classes, in this host's time),
and moves its best cut plan a layer or a micro-batch per replica at a time while the
simulator finds it faster (`refined`): the splits above weigh compute alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ratrain.comm.topology import coords
from ratrain.config import act_itemsize
from ratrain.config.platform import RankClass
from ratrain.exec.params import STATE_BYTES_PER_PARAM, shard_size
from ratrain.exec.spec import block_flops_per_token, block_params, stage_layers
from ratrain.lifecycle.pipeline import PipelinePlan, resolve_policy
from ratrain.plan.cost import DEFAULT_MEM_BANDWIDTH
from ratrain.plan.memory import fit_recompute, stage_peaks
from ratrain.plan.search import POLICY_NAMES, candidate_pps
from ratrain.plan.simulate import simulate_config
from ratrain.plan.steps import recompute_for
from ratrain.shim.platform import class_profile

def class_rates(cfg, name) -> tuple[float, float]:
    """(compute flop/s, DDR bytes/s) of a rank of class `name` (None: the profile's). A profile
    without a compute rate counts as 1 flop/s (only ratios matter)."""
    prof = class_profile(cfg.platform, name)
    fact = prof.fact("ddr_bandwidth")
    return (float(prof.compute_flops or 1.0),
            float(fact.value) if fact is not None and fact.value else DEFAULT_MEM_BANDWIDTH)


def grid_rates(cfg, classes) -> list[list[tuple[float, float]]]:
    """`rates[stage][replica]` of the grid under `parallel.placement` (`grid_classes`)."""
    rates = {n: class_rates(cfg, n) for n in set(classes or (None,))}
    return [[rates[n] for n in row] for row in grid_classes(cfg, classes)]


def role_seconds(cfg, role: str, rate: tuple[float, float]) -> float:
    """Seconds of one micro-batch's forward and backward of one block of `role` at `rate`."""
    m, tokens = cfg.model, cfg.parallel.micro_batch * cfg.model.seq_len
    flops, ddr = rate
    if role == "embed":  # a gather (and its scatter-add): memory-bound
        act = act_itemsize(cfg.precision)
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


def state_bytes(cfg, stage: int, layers: int) -> int:
    """Bytes of stage `stage`'s fp32 masters and AdamW moments when it holds `layers` layers
    (this replica's segment of each block when the policy shards them): what no recomputation
    frees."""
    p, m = cfg.parallel, cfg.model
    shards = resolve_policy(cfg.schedule).shards(p.dp)
    roles = ["layer"] * layers + (["embed"] if stage == 0 else []) + (
        ["head"] if stage == p.pp - 1 else [])
    return STATE_BYTES_PER_PARAM * sum(shard_size(block_params(m, r), shards) for r in roles)


def split_layers(cfg, classes) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's time per micro-batch, each stage timed
    at its slowest replica's rate (exact: dynamic programming over contiguous splits), no
    stage holding more state than its classes' smallest DDR cap (`state_bytes`; when no split
    fits, the fastest regardless, for the memory check to refuse by name)."""
    p = cfg.parallel
    grid = grid_rates(cfg, classes)
    caps = stage_caps(cfg, classes)
    for capped in (True, False):
        out = _split(cfg, grid, caps if capped else [None] * p.pp)
        if out is not None:
            return out
    raise AssertionError("unreachable: every split has a finite time")


def _split(cfg, grid, caps) -> tuple[int, ...] | None:
    p, n = cfg.parallel, cfg.model.layers

    memo: dict = {}

    def cost(s: int, k: int) -> float:
        if (s, k) not in memo:
            over = caps[s] is not None and state_bytes(cfg, s, k) > caps[s]
            memo[s, k] = (float("inf") if over
                          else max(stage_seconds(cfg, s, k, rate) for rate in grid[s]))
        return memo[s, k]

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
    if best[0][n] == inf:
        return None
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


# -- the simulator's view of a mixed cluster -----------------------------------------------------


def grid_classes(cfg, classes) -> list[list[str | None]]:
    """`names[stage][replica]`: the class of each grid position under `parallel.placement`."""
    p = cfg.parallel
    names = [[None] * p.dp for _ in range(p.pp)]
    for r in range(p.world_size):
        s, q = coords(r, p.pp, p.dp, p.placement)
        names[s][q] = classes[r] if classes is not None else None
    return names


def _largest_share_plan(cfg):
    """The plan of the replica with the most micro-batches (the most in flight: memory)."""
    p = cfg.parallel
    return PipelinePlan.from_config(cfg, replica=max(range(p.dp), key=p.micro_batches_of),
                                    validate=False)


def _fit_auto(cfg, plan, caps):
    """`fit_recompute` of `plan` under the smallest of the stages' caps: (counts, peaks, fits)."""
    known = [c for c in caps if c is not None]
    return fit_recompute(plan, cfg.model, cfg.parallel.micro_batch, min(known) if known else None)


def recompute_layers(cfg, classes) -> list[int] | None:
    """`schedule.recompute: auto`: per stage, the fewest layers fully recomputed that fit (the
    largest share's micro-batches in flight, under the smallest cap of the ranks' classes);
    None for any other setting (the simulator takes it as it is)."""
    if cfg.schedule.recompute != "auto":
        return None
    return _fit_auto(cfg, _largest_share_plan(cfg), stage_caps(cfg, classes))[0]


def predict_step_s(cfg, classes, steps: int = 3) -> float:
    """The simulated step (platform seconds) of `cfg` on ranks of `classes`: the whole grid,
    each rank at its class's rates, each replica with its own share, a block's gradient
    collective waiting for every replica (`plan.simulate.simulate_config`; replicas alike are
    played once)."""
    return simulate_config(cfg, recompute_layers=recompute_layers(cfg, classes), steps=steps,
                           with_memory=False, classes=classes, validate=False).step_s


def predict(cfg, classes) -> float:
    """Tokens per second of wall-clock time `cfg` (concrete: nothing on `auto`) trains at on
    ranks of `classes`, as this host runs it under emulation (the simulated platform step x
    `platform.time_scale`: the units of the run's metrics.jsonl)."""
    step = predict_step_s(cfg, classes) * cfg.platform.time_scale
    return cfg.parallel.global_batch * cfg.model.seq_len / step


# -- the search ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    cfg: object  # a concrete Config: layout, policy, layers per stage and shares
    symmetric: bool  # even layers and equal shares
    tokens_per_s: float  # predicted, wall-clock under the config's time_scale (0: does not fit)
    fits: bool

    def describe(self) -> str:
        p = self.cfg.parallel
        layers = f"[{runs(p.layers_per_stage)}]" if p.layers_per_stage else "even"
        shares = (f"[{runs(p.replica_shares)}]" if p.replica_shares
                  else f"{p.num_micro_batches} each")
        return (f"pp {p.pp} x dp {p.dp} ({p.placement} placement), layers {layers}, "
                f"micro-batches {shares}, {self.cfg.schedule.policy}")


def runs(values) -> str:
    """[40, 40, 20, 20] -> "40 x2, 20 x2" (a long list of shares or layers, read at a glance)."""
    out: list[list] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return ", ".join(f"{v}" if n == 1 else f"{v} x{n}" for v, n in out)


def stage_caps(cfg, classes) -> list[int | None]:
    """Each stage's DDR cap: the smallest of its ranks' classes' caps."""
    caps = []
    for names in grid_classes(cfg, classes):
        got = [class_profile(cfg.platform, n).ddr_bytes for n in set(names)]
        caps.append(None if any(c is None for c in got) else min(got))
    return caps


def fits(cfg, classes) -> bool:
    """Whether every stage fits its cap, with the largest share's micro-batches in flight."""
    plan, caps = _largest_share_plan(cfg), stage_caps(cfg, classes)
    if cfg.schedule.recompute == "auto":
        peaks = _fit_auto(cfg, plan, caps)[1]
    else:
        peaks = stage_peaks(plan, cfg.model, cfg.parallel.micro_batch,
                            recompute_for(plan.blocks, cfg.schedule.recompute))
    return all(c is None or pk <= c for pk, c in zip(peaks, caps))


def candidates(cfg, classes, policies=POLICY_NAMES, refine: bool = True) -> list[Candidate]:
    """Every layout of `cfg`'s ranks keeping its global batch and micro-batch size (pp x dp,
    both placements, `policies`), each symmetric (even layers, equal shares) and cut to the
    classes (`split_layers`, `split_shares`), fastest first; with `refine`, the fastest cut
    one also improved by the simulator (`refined`)."""
    p = cfg.parallel
    world, windows = p.world_size, p.global_batch // p.micro_batch
    out, seen = [], set()
    for pp in candidate_pps(cfg.model.layers, world, (p.pp,)):
        dp = world // pp
        if pp * dp != world or windows % dp:
            continue
        for placement in ("pp", "dp") if pp > 1 and dp > 1 else (p.placement,):
            for policy in policies:
                lay = replace(p, pp=pp, dp=dp, num_micro_batches=windows // dp,
                              placement=placement, layers_per_stage=None, replica_shares=None)
                sym = replace(cfg, parallel=lay,
                              schedule=replace(cfg.schedule, policy=policy))
                auto = replace(sym, parallel=replace(lay, layers_per_stage=lay.AUTO,
                                                     replica_shares=lay.AUTO))
                for c, symmetric in ((sym, True), (resolve(auto, classes), False)):
                    key = (c.parallel, policy)
                    if key in seen:
                        continue
                    seen.add(key)
                    ok = fits(c, classes)
                    out.append(Candidate(c, symmetric or _even(c), predict(c, classes) if ok
                                         else 0.0, ok))
    out.sort(key=lambda c: -c.tokens_per_s)
    best = next((c for c in out if c.fits and not c.symmetric), None)
    if best is not None and refine:
        better = refined(best, classes)
        if better is not best:
            out.append(better)
            out.sort(key=lambda c: -c.tokens_per_s)
    return out


def neighbours(cfg, classes) -> list:
    """Configs one move from `cfg`: a layer from its slowest stage (`stage_seconds` at the
    stage's slowest rank) to a neighbouring stage, or one micro-batch from every replica of
    one kind (the same class at every stage) to every replica of another kind as many."""
    p = cfg.parallel
    layers = list(p.layers_per_stage or (len(r) for r in stage_layers(cfg.model, p.pp)))
    rates = grid_rates(cfg, classes)
    slow = max(range(p.pp), key=lambda s: max(stage_seconds(cfg, s, layers[s], r)
                                              for r in rates[s]))
    out = []
    for to in (slow - 1, slow + 1):
        if 0 <= to < p.pp and layers[slow] > 1:
            moved = list(layers)
            moved[slow] -= 1
            moved[to] += 1
            out.append(replace(cfg, parallel=replace(p, layers_per_stage=tuple(moved))))
    names = grid_classes(cfg, classes)
    kinds: dict = {}
    for q in range(p.dp):
        kinds.setdefault(tuple(names[s][q] for s in range(p.pp)), []).append(q)
    shares = list(p.shares)
    for a in kinds.values():
        for b in kinds.values():
            if a is b or len(a) != len(b) or min(shares[q] for q in a) < 2:
                continue
            moved = list(shares)
            for q in a:
                moved[q] -= 1
            for q in b:
                moved[q] += 1
            out.append(replace(cfg, parallel=replace(p, replica_shares=tuple(moved))))
    return out


def refined(cand: Candidate, classes, rounds: int = 4) -> Candidate:
    """`cand` improved by the simulator: the fastest fitting `neighbours`, while one is
    faster (at most `rounds` moves; `split_layers` and `split_shares` weigh compute only,
    the simulator the links, the collectives and the pipeline's bubbles as well)."""
    for _ in range(rounds):
        best = cand
        for c in neighbours(cand.cfg, classes):
            if fits(c, classes):
                v = predict(c, classes)
                if v > best.tokens_per_s * (1 + 1e-9):
                    best = Candidate(c, _even(c), v, True)
        if best is cand:
            break
        cand = best
    return cand


def _even(cfg) -> bool:
    """Whether a resolved plan came out symmetric anyway (a uniform cluster)."""
    p = cfg.parallel
    even = tuple(len(r) for r in stage_layers(cfg.model, p.pp))
    return ((p.layers_per_stage is None or tuple(p.layers_per_stage) == even)
            and len(set(p.shares)) == 1)


def best_plans(cfg, classes, policies=POLICY_NAMES) -> dict:
    """The planner's choice for `cfg`'s ranks of `classes` (`asymmetric`: the fastest plan that
    fits) and the fastest symmetric plan (`symmetric`), as concrete configs; a ValueError
    naming the cap when none fits."""
    ranked = [c for c in candidates(cfg, classes, policies) if c.fits]
    if not ranked:
        raise ValueError("no layout of parallel.pp x parallel.dp fits every stage under its "
                         "class's DDR cap (platform.classes[].ddr_bytes, platform.ddr_bytes): "
                         "raise the caps, lower parallel.micro_batch, or set "
                         "schedule.recompute=auto")
    sym = [c for c in ranked if c.symmetric]
    return {"asymmetric": ranked[0].cfg, "symmetric": (sym or ranked)[0].cfg}


def halves(cfg, factor: float):
    """`cfg` on a mixed cluster: the first half of its ranks at the profile's compute rate
    (class `base`), the second half at `factor` times it (class `x<factor>`)."""
    world, rate = cfg.parallel.world_size, class_profile(cfg.platform, None).compute_flops
    if not rate:
        raise ValueError(f"platform profile {cfg.platform.profile!r} has no compute_flops to "
                         "scale: set platform.compute_flops or use platform.profile=mt3000")
    half = world // 2
    return replace(cfg, platform=replace(cfg.platform, classes=(
        RankClass(name="base", ranks=tuple(range(half))),
        RankClass(name=f"x{factor:g}", ranks=tuple(range(half, world)),
                  compute_flops=float(rate) * factor))))


def uniform_like(cfg, classes):
    """`cfg` on a uniform cluster of the same total compute: one class holding every rank at
    the mean of the ranks' compute rates (their other values the profile's)."""
    rates = [class_profile(cfg.platform, n).compute_flops for n in classes]
    one = RankClass(name="uniform", ranks=tuple(range(len(classes))),
                    compute_flops=float(sum(rates)) / len(rates))
    return replace(cfg, platform=replace(cfg.platform, classes=(one,)),
                   parallel=replace(cfg.parallel, layers_per_stage=None, replica_shares=None))


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


__all__ = ["Candidate", "best_plans", "candidates", "class_rates", "fits", "grid_classes",
           "grid_rates", "halves", "neighbours", "predict", "predict_step_s", "recompute_layers",
           "refined", "replica_seconds", "resolve", "role_seconds", "runs", "split_layers",
           "split_shares", "stage_caps", "stage_seconds", "state_bytes", "uniform_like",
           "with_measured_rates"]
