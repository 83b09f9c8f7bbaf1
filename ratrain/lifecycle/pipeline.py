"""A pipeline decided once, as data: the `PipelinePlan`.

    plan = PipelinePlan.from_config(cfg)              # the config's policy and layout
    plan = PipelinePlan.from_config(cfg, "1f1b-bare", pp=8, dp=4, m=16)  # the planner's
    plan = PipelinePlan.from_config(cfg, replica=2)  # replica 2's (its own replica_shares)
    plan.stages[s]                                    # stage s's `StageInfo`
    plan.step_list(s, carry=False), plan.flush_list(s)
    plan.steps(2)                                     # out[k][stage], as one replica runs them
    plan.with_pass(p)                                 # another pass, or one of its name replaced
    print(plan.grid())                                # the step x rank picture, before any rank

A plan is pure: made from the config (or from block names, for tests) with no MPI and no
buffer, so it can be printed (`lifecycle.grid`) and checked before any rank exists. It holds the
policy (a bare order, `1f1b-bare` / `gpipe-bare`, is a `Policy` with no lifecycle), every stage's
description from one builder (`PipelinePlan.build`), its passes over the step
(`lifecycle.passes`: partial synchronization, offload; each rewrites the policy's lists), each
stage's step lists and flush list per phase of the passes' period, and it is validated once
when made (`lifecycle.validate`). The executor, the planner, the benches and the grid all take
it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ratrain.exec.params import GRAD_BYTES_PER_PARAM
from ratrain.exec.spec import block_params, block_role, stage_blocks
from ratrain.lifecycle.grid import grid, legend
from ratrain.lifecycle.passes import Pass, named, passes_of, period_of
from ratrain.lifecycle.policies import PRESETS, Policy, StageInfo, policy_of
from ratrain.lifecycle.schedule import Action
from ratrain.lifecycle.validate import validate_stages

_CONFIG = object()  # from_config(layers_per_stage=..., passes=...): the config's own


def stage_block_names(model, pp: int, layers_per_stage=None) -> list[tuple[str, ...]]:
    """Block names of every stage in model order (embed on the first, head on the last)."""
    return [tuple(b.name for b in stage_blocks(model, pp, s, layers_per_stage))
            for s in range(pp)]


def resolve_policy(schedule, policy=None) -> Policy:
    """The policy a plan plays: a `Policy` as is; a bare order's name as its preset; a preset's
    name with the component keys `schedule` sets (`policies.policy_of`); None: the section's
    own policy."""
    if isinstance(policy, Policy):
        return policy
    if policy is not None and policy in PRESETS and not PRESETS[policy].lifecycle:
        return Policy(policy)
    return policy_of(schedule, policy)


@dataclass(frozen=True)
class PipelinePlan:
    """One replica's pipeline under one policy and its passes: every stage's description and
    lists (replicas of unequal shares have plans of unequal micro-batch counts; the gradient
    collectives of each block come in the same order on every replica, so they still pair)."""

    policy: Policy
    dp: int
    stages: tuple[StageInfo, ...]
    # per stage, per phase of the period: (a step with nothing carried, a step after a step
    # (the same list unless the policy carries), the flush that ends a run)
    lists: tuple[tuple[tuple[tuple[Action, ...], ...], ...], ...]
    # every replica's micro-batches (unequal under `parallel.replica_shares`), and whose plan
    # this is: shares[replica] == num_micro_batches (checked when the plan is made)
    shares: tuple[int, ...] = ()
    replica: int = 0
    passes: tuple[Pass, ...] = ()  # the passes over the step, in the order they rewrote

    @classmethod
    def build(cls, policy: Policy, blocks, m: int, precision: str = "fp32", dp: int = 1,
              block_bytes=None, validate: bool = True, shares=None, replica: int = 0,
              passes=()) -> PipelinePlan:
        """The plan of stages with block names `blocks[s]` and fp32 gradient bytes
        `block_bytes[s]` (None: zero bytes) for replica `replica` of `shares` (None: `m`
        micro-batches each), its lists rewritten by `passes` in order (each checked first);
        `validate`: check every stage's lists first."""
        shares = tuple(shares) if shares is not None else (m,) * dp
        if len(shares) != dp or not 0 <= replica < dp or shares[replica] != m:
            raise ValueError(f"replica {replica} of {dp} runs {m} micro-batches, but the shares "
                             f"of the replicas are {list(shares)}: give each replica its share")
        passes = tuple(passes)
        stages = _stage_infos(policy, blocks, m, precision, dp, block_bytes)
        for p in passes:
            p.check(policy, stages, passes)
        period = math.lcm(*(period_of(p) for p in passes)) if passes else 1
        plan = cls(policy, dp, stages, tuple(_stage_lists(policy, i, passes, period)
                                             for i in stages), shares, replica, passes)
        if validate:
            plan.validate()
        return plan

    @classmethod
    def of_model(cls, model, policy: Policy, pp: int, dp: int, m: int, precision: str = "fp32",
                 layers_per_stage=None, validate: bool = True, shares=None,
                 replica: int = 0, passes=()) -> PipelinePlan:
        """The plan of `model` cut into `pp` stages (`layers_per_stage`: None, even), its
        blocks sized from their parameter counts, rewritten by `passes`."""
        blocks = stage_block_names(model, pp, layers_per_stage)
        sizes = [tuple(GRAD_BYTES_PER_PARAM * block_params(model, block_role(b)) for b in names)
                 for names in blocks]
        return cls.build(policy, blocks, m, precision, dp, sizes, validate, shares, replica,
                         passes)

    @classmethod
    def from_config(cls, cfg, policy=None, *, pp: int | None = None, dp: int | None = None,
                    m: int | None = None, layers_per_stage=_CONFIG, replica: int = 0,
                    validate: bool = True, passes=_CONFIG) -> PipelinePlan:
        """The plan of replica `replica` of `cfg` (its `parallel` layout, its micro-batches by
        `replica_shares`, unless `pp`/`dp`/`m` micro-batches or `layers_per_stage` are given;
        `policy`: see `resolve_policy`; `passes`: default the config's, `passes_of`)."""
        par = cfg.parallel
        own = pp is None and dp is None and m is None  # the config's layout, its shares
        pp, dp = par.pp if pp is None else pp, par.dp if dp is None else dp
        m = par.micro_batches_of(replica) if m is None else m
        layers = par.stage_layers() if layers_per_stage is _CONFIG else layers_per_stage
        if passes is _CONFIG:
            passes = passes_of(cfg, stage_block_names(cfg.model, pp, layers))
        return cls.of_model(
            cfg.model, resolve_policy(cfg.schedule, policy), pp, dp, m, cfg.precision, layers,
            validate, par.shares if own else None, replica if own else 0, passes)

    def pass_named(self, name: str):
        """The plan's pass called `name`, or None."""
        return named(self.passes, name)

    def with_pass(self, p: Pass, validate: bool = True) -> PipelinePlan:
        """This plan with pass `p` in place of its pass of the same name (or after its passes)."""
        have = [q.name for q in self.passes]
        passes = (tuple(p if q.name == p.name else q for q in self.passes) if p.name in have
                  else self.passes + (p,))
        st = self.stages
        return PipelinePlan.build(
            self.policy, self.blocks, self.num_micro_batches, self.precision, self.dp,
            [i.block_bytes for i in st], validate, self.shares, self.replica, passes)

    # -- what the plan holds ---------------------------------------------------------------

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per replica and step."""
        return self.stages[0].num_micro_batches

    @property
    def precision(self) -> str:
        return self.stages[0].precision

    @property
    def shards(self) -> int:
        """dp segments of each block's master and moments (1: whole on every replica)."""
        return self.stages[0].shards

    @property
    def blocks(self) -> tuple[tuple[str, ...], ...]:
        """Every stage's block names."""
        return tuple(i.blocks for i in self.stages)

    @property
    def per_layer_recovery(self) -> bool:
        """Whether `recompute: auto` picks layers one at a time (else none or all)."""
        return self.policy.components.recovery == "per-layer"

    def carries(self) -> bool:
        """Whether a step leaves lifecycle work for the next (see `Policy.build_flush`)."""
        return self.policy.carries(self.stages[0])

    @property
    def period(self) -> int:
        """Steps after which the lists repeat (the passes' least common period; 1 for most)."""
        return len(self.lists[0])

    def step_list(self, stage: int, carry: bool = False, step: int = 0) -> tuple[Action, ...]:
        """Stage `stage`'s actions for step `step` (0-based; lists differ by step only under a
        pass with a period, as partial synchronization) (`carry`: after a step that was not
        flushed)."""
        return self.lists[stage][step % self.period][1 if carry else 0]

    def flush_list(self, stage: int, step: int = 0) -> tuple[Action, ...]:
        """What ends a run (or precedes a checkpoint, an evaluation) after step `step`."""
        return self.lists[stage][step % self.period][2]

    def stage_steps(self, stage: int, n: int, flush: bool = False) -> list[tuple[Action, ...]]:
        """Stage `stage`'s lists for `n` consecutive steps as the executor runs them (the first
        with nothing carried), then, with `flush`, the flush that ends a run."""
        out = [self.step_list(stage, k > 0, k) for k in range(n)]
        return out + [self.flush_list(stage, n - 1)] if flush else out

    def steps(self, n: int) -> list[list[tuple[Action, ...]]]:
        """`n` consecutive steps of every stage: `out[k][stage]` (no flush)."""
        return [[self.step_list(s, k > 0, k) for s in range(self.pp)] for k in range(n)]

    def grid(self, step: int = 1, **kw) -> str:
        """The step x rank picture of step `step` (1: a step after a step, so carried work
        shows; `lifecycle.grid.grid`'s keywords)."""
        if kw.get("legend"):
            kw["legend"] = legend(self.passes)
        return grid(self.steps(step + 1)[step], self.blocks, **kw)

    # -- checks ----------------------------------------------------------------------------

    def validate(self, steps: int = 3) -> None:
        """Every stage's lists: the pipeline pairs and cannot deadlock; every block's lifecycle
        is in order over `steps` steps (a whole period and one more where the lists differ by
        step) and the flush (`lifecycle.validate`, each pass checking its own actions)."""
        steps = max(steps, self.period + 1)
        validate_stages([self.stage_steps(s, steps, flush=True) for s in range(self.pp)],
                        self.stages, steps, self.policy.components.lifecycle, self.passes)


def check_passes(cfg) -> None:
    """The passes `cfg` asks for, each checked against its policy and layout: one line naming
    the keys, before any work (start-up; `PipelinePlan.build` checks them again)."""
    blocks = stage_block_names(cfg.model, cfg.parallel.pp)
    policy, passes = resolve_policy(cfg.schedule), passes_of(cfg, blocks)
    stages = _stage_infos(policy, blocks, 1, cfg.precision, cfg.parallel.dp)
    for p in passes:
        p.check(policy, stages, passes)


def _stage_infos(policy: Policy, blocks, m: int, precision: str, dp: int, block_bytes=None):
    """Every stage's `StageInfo` (`block_bytes` None: zero bytes)."""
    return tuple(
        StageInfo(len(blocks), s, m, tuple(names),
                  tuple(block_bytes[s]) if block_bytes is not None else (0,) * len(names),
                  precision, policy.shards(dp))
        for s, names in enumerate(blocks))


def _stage_lists(policy: Policy, info: StageInfo, passes, period: int):
    """Stage `info`'s (first, carried, flush) lists for each phase of `period`: the policy's,
    then each pass's rewrite in order."""
    first = policy.build_step(info)
    carried = policy.build_step(info, True) if policy.carries(info) else first
    flush = policy.build_flush(info)
    out = []
    for phase in range(period):
        lists = (first, carried, flush)
        for p in passes:
            lists = p.rewrite(lists, info, phase % period_of(p), policy)
        out.append(tuple(lists))
    return tuple(out)


__all__ = ["PipelinePlan", "check_passes", "resolve_policy", "stage_block_names"]
