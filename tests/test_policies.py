"""Lifecycle policies: placement is legal, compute is the same under every policy (no MPI)."""

import pytest

from ratrain.lifecycle.grid import grid
from ratrain.lifecycle.policies import POLICIES, Policy, StageInfo, buckets
from ratrain.lifecycle.schedule import (
    AllocGrad,
    Backward,
    DropView,
    Forward,
    FreeGrad,
    GradNorm,
    MaterializeView,
    SyncGrad,
    Update,
    WaitGrad,
)
from ratrain.lifecycle.validate import ScheduleError, check_lifecycle, validate_policy


def infos(pp, m, precision="fp16", per_stage=2):
    out = []
    for s in range(pp):
        blocks = (["embed"] if s == 0 else []) + [
            f"layers.{i}" for i in range(per_stage * s, per_stage * (s + 1))
        ] + (["head"] if s == pp - 1 else [])
        out.append(StageInfo(pp, s, m, tuple(blocks), tuple(100 for _ in blocks), precision))
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_every_policy_validates(name, pp, precision):
    for m in range(1, 9):
        validate_policy(Policy(name, bucket_bytes=150), infos(pp, m, precision), steps=3)


@pytest.mark.parametrize("pp,m", [(1, 1), (2, 3), (4, 2), (4, 8)])
def test_policies_compute_the_same_thing(pp, m):
    def order(name, carry):
        return [
            [(type(a).__name__, getattr(a, "mb", None)) for a in Policy(name).build_step(i, carry)
             if not isinstance(a, (MaterializeView, DropView, AllocGrad, FreeGrad, SyncGrad,
                                   WaitGrad, GradNorm, Update))]
            for i in infos(pp, m)
        ]
    ref = order("baseline-1f1b", False)
    assert order("megatron-1f1b", False) == ref
    assert order("ratrain", False) == ref == order("ratrain", True)


def test_ratrain_syncs_each_block_after_its_last_backward():
    info = infos(2, 4)[1]
    step = Policy("ratrain").build_step(info, carry=True)
    last = next(a for a in step if isinstance(a, Backward) and a.mb == 3)
    assert [(b, type(h).__name__) for b, h in last.post] == [
        ("head", "SyncGrad"), ("head", "DropView"),
        ("layers.3", "SyncGrad"), ("layers.3", "DropView"),
        ("layers.2", "SyncGrad"), ("layers.2", "DropView")]
    first = next(a for a in step if isinstance(a, Backward) and a.mb == 0)
    assert {type(h) for _, h in first.pre} == {AllocGrad}
    # deferred updates run before anything else (before the first receive is waited on)
    assert isinstance(step[0], Update) and isinstance(step[1], FreeGrad)
    assert isinstance(step[-1], GradNorm)


def test_ratrain_fp32_keeps_views():
    info = infos(2, 2, "fp32")[0]
    p = Policy("ratrain")
    assert not any(isinstance(a, (DropView, MaterializeView)) for a in p.build_step(info, True))
    assert sum(isinstance(a, MaterializeView) for a in p.build_step(info, False)) == 3
    assert p.build_flush(info) == tuple(
        a for b in info.blocks for a in (Update(b), FreeGrad(b)))


def test_baseline_holds_everything_for_the_step():
    info = infos(2, 4)[0]
    step = Policy("baseline-1f1b").build_step(info)
    first_compute = next(i for i, a in enumerate(step) if isinstance(a, Forward))
    assert {type(a) for a in step[:first_compute]} == {MaterializeView, AllocGrad}
    syncs = [a for a in step if isinstance(a, SyncGrad)]
    assert syncs == [SyncGrad(("layers.1", "layers.0", "embed"))]
    assert Policy("baseline-1f1b").build_flush(info) == ()


def test_megatron_buckets():
    info = StageInfo(1, 0, 2, ("embed", "layers.0", "layers.1", "head"), (300, 100, 100, 300))
    assert buckets(info, 250) == [("head",), ("layers.1", "layers.0", "embed")]
    assert buckets(info, 10**9) == [("head", "layers.1", "layers.0", "embed")]
    step = Policy("megatron-1f1b", bucket_bytes=250).build_step(info)
    last = next(a for a in step if isinstance(a, Backward) and a.mb == 1)
    assert last.post == (("head", SyncGrad(("head",))),
                         ("embed", SyncGrad(("layers.1", "layers.0", "embed"))))


def test_lifecycle_checker_catches_misplaced_actions():
    info = infos(1, 1)[0]
    good = Policy("ratrain").steps(info, 2)
    check_lifecycle(good, info.blocks, 1)

    def edit(steps, k, fn):
        return [fn(list(s)) if i == k else s for i, s in enumerate(steps)]

    # update before the step's norm
    base = list(Policy("baseline-1f1b").steps(info, 1)[0])
    i = base.index(Update("head"))
    moved = base[:i] + base[i + 1:]
    moved.insert(base.index(GradNorm()), Update("head"))
    with pytest.raises(ScheduleError, match="norm"):
        check_lifecycle([moved, ()], info.blocks, 1)
    # free before update
    j = base.index(FreeGrad("head"))
    freed = base[:j] + base[j + 1:]
    freed.insert(base.index(GradNorm()), FreeGrad("head"))
    with pytest.raises(ScheduleError, match="freed before"):
        check_lifecycle([freed, ()], info.blocks, 1)
    # next step's view made before the deferred update: stale
    carry = list(good[1])
    carry.remove(MaterializeView("head"))
    carry.insert(0, MaterializeView("head"))
    with pytest.raises(ScheduleError, match="stale"):
        check_lifecycle([good[0], carry, good[2]], info.blocks, 1)
    # missing flush leaves work pending
    with pytest.raises(ScheduleError, match="pending"):
        check_lifecycle(good[:2], info.blocks, 1)


def test_grid_shows_lifecycle():
    inf = infos(2, 2)
    text = grid([Policy("ratrain").build_step(i, True) for i in inf], [i.blocks for i in inf])
    assert "update head" in text and "sync L3" in text and "norm" in text and "B mb1" in text


def _combinations():
    from itertools import product

    from ratrain.lifecycle.policies import BUFFER_MODES, ORDERS, SYNCS, UPDATES, Components

    for order, sync, update, buffers, shard, prefetch in product(
            ORDERS, SYNCS, UPDATES, BUFFER_MODES, (False, True), (False, True)):
        if prefetch and not shard:
            continue  # prefetch is about gathers: the same lists without sharding
        yield Components(sync=sync, update=update, buffers=buffers, shard=shard,
                         prefetch=prefetch, order=order)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("pp,m", [(1, 2), (2, 3), (3, 2), (4, 6)])
def test_every_combination_of_components_validates_and_computes_the_same(pp, m, precision):
    from dataclasses import replace

    ref = None
    for comp in _combinations():
        pol = Policy("baseline-1f1b", bucket_bytes=150, components=comp)
        dp = 2 if comp.shard else 1
        stage_infos = [replace(i, shards=pol.shards(dp)) for i in infos(pp, m, precision)]
        validate_policy(pol, stage_infos, steps=3)
        compute = [[(type(a).__name__, a.mb) for a in pol.build_step(i, False)
                    if a.group != "lifecycle"] for i in stage_infos]
        if comp.order == "1f1b":
            ref = ref or compute
            assert compute == ref, pol.label


def test_presets_are_components():
    from ratrain.lifecycle.policies import PRESETS, Components

    assert Policy("ratrain").components == PRESETS["ratrain"]
    custom = Policy("baseline-1f1b", components=Components(sync="layer"))
    assert custom.label == "baseline-1f1b(sync=layer)" and Policy("ratrain").label == "ratrain"
    with pytest.raises(ValueError, match="schedule.sync='eager' is not one of"):
        Components(sync="eager")


def test_the_schedule_section_switches_components():
    from ratrain.config import ConfigError, load_config
    from ratrain.runtime.bench import variant_sets
    from ratrain.lifecycle.policies import policy_of

    cfg = load_config("jobs/tiny.yaml", variant_sets("baseline-1f1b+sync=layer+update=next-step"))
    pol = policy_of(cfg.schedule)
    assert pol.label == "baseline-1f1b(sync=layer,update=next-step)"
    assert (pol.components.buffers, pol.components.shard) == ("resident", False)
    assert policy_of(cfg.schedule, "ratrain").label == "ratrain"  # ratrain already syncs per layer
    sharded = load_config("jobs/tiny.yaml", variant_sets("baseline-1f1b+shard_optimizer=true"))
    assert policy_of(sharded.schedule).shards(4) == 4
    off = load_config("jobs/tiny.yaml", ["schedule.shard_optimizer=false"])
    assert policy_of(off.schedule).shards(4) == 1 and policy_of(off.schedule).label == "ratrain(shard=False)"
    with pytest.raises(ConfigError, match="schedule.update='later' is not one of: end, next-step"):
        load_config("jobs/tiny.yaml", ["schedule.update=later"])
    with pytest.raises(ConfigError, match="'sync' is not KEY=VALUE"):
        variant_sets("ratrain+sync")


def test_the_planner_plays_the_configured_components():
    from ratrain.config import load_config
    from ratrain.plan.check import run_plan
    from ratrain.plan.simulate import simulate_config

    base = load_config("jobs/bench-lifecycle.yaml", ["schedule.policy=baseline-1f1b"])
    layered = load_config("jobs/bench-lifecycle.yaml",
                          ["schedule.policy=baseline-1f1b", "schedule.sync=layer"])
    # the same compute; syncs started per layer overlap the backward: never slower
    assert simulate_config(layered).step_s < simulate_config(base).step_s
    # uniform recovery recomputes every layer of a stage or none
    per_layer = run_plan(base).full
    uniform = run_plan(load_config("jobs/bench-lifecycle.yaml", [
        "schedule.policy=baseline-1f1b", "schedule.recovery=uniform"])).full
    assert any(0 < n < 4 for n in per_layer)  # the cap binds: some layers of a stage
    assert all(n in (0, 4) for n in uniform) and sum(uniform) > sum(per_layer)
