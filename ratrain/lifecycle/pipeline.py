"""A pipeline decided once, as data: the `PipelinePlan`.

    plan = PipelinePlan.from_config(cfg)              # the config's policy and layout
    plan = PipelinePlan.from_config(cfg, "1f1b-bare", pp=8, dp=4, m=16)  # the planner's
    plan = PipelinePlan.from_config(cfg, replica=2)  # replica 2's (its own replica_shares)
    plan.stages[s]                                    # stage s's `StageInfo`
    plan.step_list(s, carry=False), plan.flush_list(s)
    plan.steps(2)                                     # out[k][stage], as one replica runs them
    print(plan.grid())                                # the step x rank picture, before any rank

A plan is pure: made from the config (or from block names, for tests) with no MPI and no
buffer, so it can be printed (`lifecycle.grid`) and checked before any rank exists. It holds the
policy (a bare order, `1f1b-bare` / `gpipe-bare`, is a `Policy` with no lifecycle), every stage's
description from one builder (`PipelinePlan.build`), each stage's step lists and flush list, and
it is validated once when made (`lifecycle.validate`). The executor, the planner, the benches
and the grid all take it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ratrain.exec.params import GRAD_BYTES_PER_PARAM
from ratrain.exec.spec import block_params, block_role, stage_blocks
from ratrain.lifecycle import offload
from ratrain.lifecycle.grid import grid
from ratrain.lifecycle.partial import PartialSync, check_partial, phase_lists
from ratrain.lifecycle.policies import PRESETS, Policy, StageInfo, policy_of
from ratrain.lifecycle.schedule import Action
from ratrain.lifecycle.validate import validate_stages

_CONFIG = object()  # from_config(layers_per_stage=...): the config's own


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
    """One replica's pipeline under one policy: every stage's description and lists (replicas
    of unequal shares have plans of unequal micro-batch counts; the gradient collectives of
    each block come in the same order on every replica, so they still pair)."""

    policy: Policy
    dp: int
    stages: tuple[StageInfo, ...]
    first: tuple[tuple[Action, ...], ...]  # per stage: a step with nothing carried
    carried: tuple[tuple[Action, ...], ...]  # per stage: a step after a step (== first unless the policy carries)
    flushes: tuple[tuple[Action, ...], ...]  # per stage: what ends a run
    # every replica's micro-batches (unequal under `parallel.replica_shares`), and whose plan
    # this is: shares[replica] == num_micro_batches (checked when the plan is made)
    shares: tuple[int, ...] = ()
    replica: int = 0
    # partial synchronization (`sync.mode: partial`, `lifecycle.partial`): the blocks each step
    # averages, and per phase of its period per stage (first, carried, flush); None: full sync
    partial: PartialSync | None = None
    phases: tuple = ()

    @classmethod
    def build(cls, policy: Policy, blocks, m: int, precision: str = "fp32", dp: int = 1,
              block_bytes=None, validate: bool = True, shares=None,
              replica: int = 0, offloaded=None, offload_state: str = "off",
              partial: PartialSync | None = None) -> PipelinePlan:
        """The plan of stages with block names `blocks[s]` and fp32 gradient bytes
        `block_bytes[s]` (None: zero bytes) for replica `replica` of `shares` (None: `m`
        micro-batches each); `offloaded[s]`: stage s's layers whose activations go to the tier,
        `offload_state`: the optimizer state that lives there (`lifecycle.offload`); `partial`:
        partial synchronization's assignment (None: full);
        `validate`: check every stage's lists first."""
        shares = tuple(shares) if shares is not None else (m,) * dp
        if len(shares) != dp or not 0 <= replica < dp or shares[replica] != m:
            raise ValueError(f"replica {replica} of {dp} runs {m} micro-batches, but the shares "
                             f"of the replicas are {list(shares)}: give each replica its share")
        pp, shards = len(blocks), policy.shards(dp)
        if partial is not None:
            check_partial(policy, dp, offload_state)
        stages = tuple(
            StageInfo(pp, s, m, tuple(names),
                      tuple(block_bytes[s]) if block_bytes is not None else (0,) * len(names),
                      precision, shards,
                      tuple(offloaded[s]) if offloaded is not None else (), offload_state)
            for s, names in enumerate(blocks))
        carries = policy.carries

        def tier(actions, i):  # the tier's transfers in place (nothing without offload)
            return offload.place(actions, i.blocks, i.offload, i.offload_state)

        if offload_state == "masters" and not stages[0].separate_views:
            raise ValueError("offload.optimizer=masters: in fp32 with whole optimizer state the "
                             "working view is the master itself, which every forward reads; "
                             "use precision fp16, a policy that shards the optimizer state "
                             "(ratrain at dp > 1), or offload.optimizer=moments")
        plan = cls(policy, dp, stages,
                   tuple(tier(policy.build_step(i), i) for i in stages),
                   tuple(tier(policy.build_step(i, True) if carries(i) else policy.build_step(i),
                              i) for i in stages),
                   tuple(tier(policy.build_flush(i), i) for i in stages), shares, replica,
                   partial,
                   tuple(tuple(tuple(tier(lst, i) for lst in phase)
                               for phase in phase_lists(policy, i, partial))
                         for i in stages) if partial else ())
        if validate:
            plan.validate()
        return plan

    @classmethod
    def of_model(cls, model, policy: Policy, pp: int, dp: int, m: int, precision: str = "fp32",
                 layers_per_stage=None, validate: bool = True, shares=None,
                 replica: int = 0, offload_all: bool = False,
                 offload_state: str = "off", sync=None) -> PipelinePlan:
        """The plan of `model` cut into `pp` stages (`layers_per_stage`: None, even), its
        blocks sized from their parameter counts; `offload_all`: every layer's activations go
        to the tier (`offload.activations: all`); `sync`: a config's `sync` section (None:
        full)."""
        blocks = stage_block_names(model, pp, layers_per_stage)
        sizes = [tuple(GRAD_BYTES_PER_PARAM * block_params(model, block_role(b)) for b in names)
                 for names in blocks]
        offloaded = ([tuple(b for b in names if block_role(b) == "layer") for names in blocks]
                     if offload_all else None)
        partial = (PartialSync.of_sync(sync, [b for s in blocks for b in s])
                   if sync is not None else None)
        return cls.build(policy, blocks, m, precision, dp, sizes, validate, shares, replica,
                         offloaded, offload_state, partial)

    @classmethod
    def from_config(cls, cfg, policy=None, *, pp: int | None = None, dp: int | None = None,
                    m: int | None = None, layers_per_stage=_CONFIG, replica: int = 0,
                    validate: bool = True) -> PipelinePlan:
        """The plan of replica `replica` of `cfg` (its `parallel` layout, its micro-batches by
        `replica_shares`, unless `pp`/`dp`/`m` micro-batches or `layers_per_stage` are given;
        `policy`: see `resolve_policy`)."""
        par = cfg.parallel
        own = pp is None and dp is None and m is None  # the config's layout, its shares
        return cls.of_model(
            cfg.model, resolve_policy(cfg.schedule, policy), par.pp if pp is None else pp,
            par.dp if dp is None else dp, par.micro_batches_of(replica) if m is None else m,
            cfg.precision, par.stage_layers() if layers_per_stage is _CONFIG else layers_per_stage,
            validate, par.shares if own else None, replica if own else 0,
            cfg.offload.activations == "all", cfg.offload.optimizer, cfg.sync)

    def with_offload(self, offloaded, offload_state: str | None = None,
                     validate: bool = True) -> PipelinePlan:
        """This plan with the tier's transfers for `offloaded[s]` (stage s's layers whose
        activations go to the tier; the recovery choice) and `offload_state` (default this
        plan's)."""
        st = self.stages
        return PipelinePlan.build(
            self.policy, self.blocks, self.num_micro_batches, self.precision, self.dp,
            [i.block_bytes for i in st], validate, self.shares, self.replica,
            [tuple(o) for o in offloaded], st[0].offload_state if offload_state is None
            else offload_state, self.partial)

    @property
    def offload_state(self) -> str:
        """The optimizer state that lives in the tier (`offload.optimizer`)."""
        return self.stages[0].offload_state

    @property
    def offloaded(self) -> tuple[tuple[str, ...], ...]:
        """Every stage's layers whose activations go to the tier."""
        return tuple(i.offload for i in self.stages)

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
        """Steps after which the lists repeat (partial synchronization's period; 1: full)."""
        return self.partial.period if self.partial is not None else 1

    def step_list(self, stage: int, carry: bool = False, step: int = 0) -> tuple[Action, ...]:
        """Stage `stage`'s actions for step `step` (0-based; only partial synchronization's
        lists depend on it) (`carry`: after a step that was not flushed)."""
        if self.partial is not None:
            return self.phases[stage][step % self.period][1 if carry else 0]
        return (self.carried if carry else self.first)[stage]

    def flush_list(self, stage: int, step: int = 0) -> tuple[Action, ...]:
        """What ends a run (or precedes a checkpoint, an evaluation) after step `step`."""
        if self.partial is not None:
            return self.phases[stage][step % self.period][2]
        return self.flushes[stage]

    def stage_steps(self, stage: int, n: int, flush: bool = False) -> list[tuple[Action, ...]]:
        """Stage `stage`'s lists for `n` consecutive steps as the executor runs them (the first
        with nothing carried), then, with `flush`, the flush that ends a run."""
        out = [self.step_list(stage, k > 0, k) for k in range(n)]
        return out + [self.flush_list(stage, n - 1)] if flush else out

    def offloaded_steps(self, stage: int, offloaded, n: int) -> list[tuple[Action, ...]]:
        """Stage `stage`'s lists for `n` steps with the activation transfers of its `offloaded`
        layers in place, the rest of the plan untouched (what a recovery choice would run; the
        plan's stage must offload none yet)."""
        if self.stages[stage].offload:
            raise ValueError(f"stage {stage} offloads {list(self.stages[stage].offload)} already")
        blocks = self.stages[stage].blocks
        return [offload.place(lst, blocks, offloaded) for lst in self.stage_steps(stage, n)]

    def steps(self, n: int) -> list[list[tuple[Action, ...]]]:
        """`n` consecutive steps of every stage: `out[k][stage]` (no flush)."""
        return [[self.step_list(s, k > 0, k) for s in range(self.pp)] for k in range(n)]

    def grid(self, step: int = 1, **kw) -> str:
        """The step x rank picture of step `step` (1: a step after a step, so carried work
        shows; `lifecycle.grid.grid`'s keywords)."""
        return grid(self.steps(step + 1)[step], self.blocks, **kw)

    # -- checks ----------------------------------------------------------------------------

    def validate(self, steps: int = 3) -> None:
        """Every stage's lists: the pipeline pairs and cannot deadlock; every block's lifecycle
        is in order over `steps` steps (a whole period and one more under partial
        synchronization) and the flush (`lifecycle.validate`)."""
        steps = max(steps, self.period + 1)
        validate_stages([self.stage_steps(s, steps, flush=True) for s in range(self.pp)],
                        self.stages, steps, self.policy.components.lifecycle,
                        partial=self.partial is not None)


__all__ = ["PipelinePlan", "resolve_policy", "stage_block_names"]
