"""A discrete-event simulator of training steps at scales no machine here can run.

Input: the per-rank action lists `ratrain.lifecycle` builds (one pipeline = one replica) and a
cost model (`ratrain.plan.cost.CostModel`, or anything with the same methods). On a uniform
cluster with equal shares the data-parallel replicas run the same lists in lockstep, so one
replica stands for all (`simulate`). On a mixed cluster (`platform.classes`) or with unequal
`parallel.replica_shares`, the whole pp x dp grid is played (`simulate_grid`): the replicas
grouped by what they are (each stage's class, the replica's micro-batches; `grid_groups`), one
pipeline per group with its own lists and each rank at its class's rates (compute, DDR, links),
a block's data-parallel collective starting only when every group's rank of that stage has
submitted it (a fast replica waits for the slow one: imbalance, not communication, in its
figures). One group of every replica is the lockstep case, the same code. Output: the step
time, tokens/s, and per rank the busy time (compute, recompute, update, view), the exposed
communication, the bubble, and the peak memory.

What is modelled, per rank:

- the main thread runs its list in order: compute (`Forward` / `Backward`, block by block, hooks
  in between), the memory-bound lifecycle work (`Update`, `MaterializeView`), and it blocks on
  receives, on `WaitGrad` and on `GradNorm`;
- point-to-point messages between neighbouring stages: `send_mode="eager"` (default; the send is
  handed to the engine and the main thread goes on, as the runtime's engine does) or
  `"rendezvous"` (MPI_Send of a large message: the transfer starts when both sides have posted,
  and both wait for it). A message costs latency + bytes / bandwidth on the sender's link;
- the communication engine, a separate resource: `SyncGrad` queues one all-reduce per block
  (across the `dp` replicas, ring / tree per the cost model); the engine runs one collective at a
  time, in submission order; each takes its latency part then puts its wire bytes on the link;
- the rank's outgoing link is shared (processor sharing) by its concurrent flows: a pipeline
  message sent during a gradient all-reduce slows both down;
- `GradNorm` is a barrier of every rank (the global gradient norm and overflow flag need every
  stage, and on the grid every replica), followed by one small all-reduce over the world.

Memory does not depend on timing (a rank's allocations follow its own list order), so the peak is
a walk over each rank's lists by the lifecycle's memory model (`lifecycle.memory.simulate_peak`,
the same one the executor's `recompute: auto` uses) with sizes from shapes (`plan.memory`).

The items each action becomes and the event loop that plays them are in `plan.events`.

    res = simulate_config(cfg)                      # the config's layout, policy and recompute
    res.step_s, res.tokens_per_s, res.ranks[0].bubble_s, res.peak_bytes
    res = simulate_config(cfg, classes=class_map(cfg.platform, hosts))  # ranks by node
    res.step_s * cfg.platform.time_scale            # the step in this host's time (emulation)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ratrain.comm.topology import grid
from ratrain.config import Config
from ratrain.lifecycle.passes import offload
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.plan import events
from ratrain.plan.cost import CostModel, Rates
from ratrain.plan.memory import stage_peaks
from ratrain.plan.steps import recompute_for, recovery_for
from ratrain.shim.platform import class_map, class_profile

SEND_MODES = ("eager", "rendezvous")


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class RankStats:
    """One rank's share of the measured step (seconds), and its peak memory."""

    stage: int
    compute_s: float = 0.0  # forward + backward, recomputation included
    recompute_s: float = 0.0  # the recomputation part of compute_s
    update_s: float = 0.0  # AdamW
    view_s: float = 0.0  # fp16 view materialisation
    comm_exposed_s: float = 0.0  # main thread blocked while its communication was in flight
    bubble_s: float = 0.0  # the rest: waiting for other stages
    peak_bytes: int = 0
    comm_total_s: float = 0.0  # engine busy time (hidden or not)
    group: int = 0  # the replicas it stands for (`simulate_grid`'s groups)
    tier_s: float = 0.0  # its transfers to and from the memory tier (hidden or not)
    tier_exposed_s: float = 0.0  # main thread blocked waiting for them
    tier_bytes: float = 0.0  # bytes they moved

    @property
    def busy_s(self) -> float:
        return self.compute_s + self.update_s + self.view_s


@dataclass
class SimResult:
    step_s: float
    tokens_per_step: int
    ranks: list[RankStats]
    timeline: list[tuple[int, float, float, str]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else math.inf

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.ranks)

    @property
    def comm_exposed_s(self) -> float:
        """The largest exposed communication of any rank."""
        return max(r.comm_exposed_s for r in self.ranks)

    @property
    def bubble_s(self) -> float:
        return max(r.bubble_s for r in self.ranks)

    @property
    def recompute_s(self) -> float:
        return max(r.recompute_s for r in self.ranks)

    @property
    def tier_s(self) -> float:
        """The largest time any rank's tier transfers took (hidden or not)."""
        return max(r.tier_s for r in self.ranks)

    @property
    def tier_exposed_s(self) -> float:
        """The largest time any rank waited for the tier."""
        return max(r.tier_exposed_s for r in self.ranks)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """Replicas alike (the same class at every stage, the same micro-batch count), played by
    one simulated pipeline: `plan` (its micro-batches), `costs` (one per stage, its class's)."""

    replicas: tuple[int, ...]
    plan: PipelinePlan
    costs: tuple


def simulate(plan, cost, recompute: list[dict[str, str]] | None = None,
             tokens_per_step: int = 0, send_mode: str = "eager", **kw) -> SimResult:
    """Simulate consecutive steps of one replica's pipeline, `plan` (a
    `lifecycle.pipeline.PipelinePlan`; its dp replicas run in lockstep).

    `recompute[s]`: layer -> "none" | "selective" | "full"; `cost`: a `CostModel` (or the same
    methods), or one per stage (each stage's compute, DDR-bound work and links at its own
    rates); `kw`: `simulate_grid`'s (`mem`: (model, micro_batch) for peak memory figures
    (`plan.memory`), or None; `timeline`; `steps`, default 2; `step_lists`: lists to play
    instead of the plan's own, `step_lists[k][s]`, a test's doctored ones). The step time is
    that of the last step, measured between the moments the last rank finished the step
    before and this one (the whole run for one step); under partial synchronization, whose
    steps differ through a period, the mean of the last period's steps (and so the figures
    per rank).
    """
    costs = tuple(cost) if isinstance(cost, (list, tuple)) else (cost,) * len(plan.blocks)
    group = Group(tuple(range(plan.dp)), plan, costs)
    return simulate_grid([group], recompute, tokens_per_step, send_mode, **kw)


def simulate_grid(
    groups,
    recompute: list[dict[str, str]] | None = None,
    tokens_per_step: int = 0,
    send_mode: str = "eager",
    mem=None,
    timeline: bool = False,
    steps: int = 2,
    step_lists=None,
) -> SimResult:
    """Simulate the whole pp x dp grid as `groups` of replicas alike (`Group`; `grid_groups`
    makes them from a config and its ranks' classes): each group's pipeline with its own
    micro-batches and its ranks' rates, a block's data-parallel collective starting when every
    group's rank of that stage has submitted it (a fast replica waits for the slow one), the
    global facts a barrier of every rank. One group of every replica is `simulate`'s lockstep
    replica. `step_lists`: one group's doctored lists (see `simulate`). Ranks of the result:
    `group * pp + stage`."""
    if send_mode not in SEND_MODES:
        raise ValueError(f"send_mode={send_mode!r} is not one of {', '.join(SEND_MODES)}")
    first = groups[0].plan
    blocks, shards, dp, pp = first.blocks, first.shards, first.dp, len(first.blocks)
    window = first.period  # partial synchronization: the steps of a period differ
    steps = max(steps, window + 1)
    recompute = recompute or [{} for _ in range(pp)]
    ranks, costs, lists_of = [], [], []
    for g, grp in enumerate(groups):
        lists = grp.plan.steps(steps) if step_lists is None else step_lists
        lists_of.append(lists)
        for s in range(pp):
            items: list = []
            for k, step in enumerate(lists):
                items += events.items(step[s], s, blocks[s], recompute[s], grp.costs[s], k,
                                      shards, rank=g * pp + s, passes=grp.plan.passes)
            ranks.append(events.RankState(s, items, blocks[s], group=g))
            costs.append(grp.costs[s])
    sim = events.Sim(ranks, costs[0], dp, send_mode, timeline, costs,
                     [grp.replicas for grp in groups])
    sim.run()

    last = len(lists_of[0]) - 1
    n = min(window, last) or 1  # the steps measured: the last, or a whole period's
    end = max(rk.end[last] for rk in ranks)
    begin = max(rk.end[last - n] for rk in ranks) if last > 0 else 0.0
    step_s = (end - begin) / n
    peaks = ([stage_peaks(grp.plan, *mem, recompute, steps) for grp in groups]
             if mem is not None else None)
    stats = []
    for rk in ranks:
        busy: dict[str, float] = {}
        for k in range(last + 1 - n, last + 1):
            for c, v in rk.busy.get(k, {}).items():
                busy[c] = busy.get(c, 0.0) + v / n
        st = RankStats(
            stage=rk.stage,
            compute_s=busy.get("compute", 0.0) + busy.get("recompute", 0.0),
            recompute_s=busy.get("recompute", 0.0),
            update_s=busy.get("update", 0.0),
            view_s=busy.get("view", 0.0),
            comm_exposed_s=sum(rk.comm.get(k, 0.0) for k in range(last + 1 - n, last + 1)) / n,
            comm_total_s=rk.engine_s / len(lists_of[0]),
            peak_bytes=peaks[rk.group][rk.stage] if peaks is not None else 0,
            group=rk.group,
            tier_s=rk.tier_s.get(last, 0.0),
            tier_exposed_s=rk.tier_exposed.get(last, 0.0),
            tier_bytes=rk.tier_bytes.get(last, 0.0),
        )
        st.bubble_s = max(0.0, step_s - st.busy_s - st.comm_exposed_s - st.tier_exposed_s)
        stats.append(st)
    return SimResult(step_s, tokens_per_step, stats, sim.timeline or [])


def config_classes(cfg: Config):
    """The class of every world rank from the config's explicit `ranks` lists (None: no
    classes); a class given by `hosts` only needs the ranks' nodes (`shim.platform.class_map`,
    passed as `classes=`)."""
    if not cfg.platform.classes:
        return None
    world = cfg.parallel.world_size
    listed = {r for c in cfg.platform.classes for r in c.ranks}
    by_host = [c.name for c in cfg.platform.classes if c.hosts]
    if by_host and not listed >= set(range(world)):
        raise ValueError(f"platform.classes: {', '.join(by_host)} name their ranks by node "
                         "(hosts), which the planner does not know: list the ranks of every "
                         "class (platform.classes[].ranks) to plan them here")
    return class_map(cfg.platform, [""] * world)


def grid_groups(cfg: Config, classes=None, cost: CostModel | None = None,
                policy: str | None = None, validate: bool = True) -> list[Group]:
    """The replicas of `cfg`'s grid grouped by what they are (each stage's class under
    `parallel.placement`, and the replica's micro-batches), each with its plan and one cost
    model per stage: `cost` (default the config's) at the rates of the stage's class (`classes`:
    every world rank's class name, None: every rank the profile)."""
    p = cfg.parallel
    base = cost or CostModel.from_config(cfg)
    g = grid(p.pp, p.dp, p.placement)
    names = classes if classes is not None else (None,) * p.world_size
    by: dict = {}
    for q in range(p.dp):
        key = (tuple(names[int(g[q, s])] for s in range(p.pp)), p.micro_batches_of(q))
        by.setdefault(key, []).append(q)
    costs: dict = {None: base}

    def cost_of(name):
        if name not in costs:
            rates = Rates.from_profile(class_profile(cfg.platform, name))
            keep = base.rates
            costs[name] = base.with_rates(rates.with_(
                "ranks_per_node", keep.ranks_per_node, keep.source("ranks_per_node")))
        return costs[name]

    return [Group(tuple(qs), PipelinePlan.from_config(cfg, policy, replica=qs[0],
                                                      validate=validate),
                  tuple(cost_of(n) for n in key[0]))
            for key, qs in by.items()]


_CLASSES = object()


def simulate_config(
    cfg: Config,
    cost: CostModel | None = None,
    policy: str | None = None,
    recompute_layers: list[int] | None = None,
    steps: int = 2,
    send_mode: str = "eager",
    with_memory: bool = True,
    classes=_CLASSES,
    validate: bool = True,
    offload_layers: list[int] | None = None,
) -> SimResult:
    """Simulate `cfg`'s layout (its layers per stage and replica shares) under `policy`
    (default: the config's) with its recompute setting (`auto` = none unless
    `recompute_layers` gives per-stage counts of fully recomputed layers; `offload_layers`:
    per-stage counts of layers offloaded to the memory tier, the first ones of each stage, as
    the executor's `offload.*` chose them), on ranks of `classes` (every world rank's class
    name; default `config_classes`). Replicas alike are played once (`grid_groups`): a uniform
    cluster with equal shares is one lockstep replica."""
    m, p = cfg.model, cfg.parallel
    groups = grid_groups(cfg, config_classes(cfg) if classes is _CLASSES else classes,
                         cost, policy, validate)
    if offload_layers is not None:  # keep / recompute / offload, as the executor chose
        recompute = recovery_for(groups[0].plan.blocks, recompute_layers or [0] * p.pp,
                                 offload_layers)
        off = [tuple(b for b, c in ch.items() if c == "offload") for ch in recompute]
        groups = [replace(g, plan=offload.with_layers(g.plan, off, validate=validate))
                  for g in groups]
    else:
        recompute = recompute_for(groups[0].plan.blocks, cfg.schedule.recompute,
                                  recompute_layers)
    mem = (m, p.micro_batch) if with_memory else None
    tokens = p.global_batch * m.seq_len
    return simulate_grid(groups, recompute, tokens, send_mode, mem, steps=steps)


__all__ = ["Group", "RankStats", "SEND_MODES", "SimResult", "config_classes", "grid_groups",
           "simulate", "simulate_config", "simulate_grid"]
