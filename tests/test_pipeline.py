"""The PipelinePlan: one pure object per pipeline, made before any buffer."""

import dataclasses

import pytest

from ratrain.lifecycle.grid import grid
from ratrain.lifecycle.pipeline import PipelinePlan, resolve_policy
from ratrain.lifecycle.policies import Policy
from ratrain.lifecycle.schedule import gpipe, one_f_one_b
from ratrain.lifecycle.validate import ScheduleError

from _executor_util import tiny_config


def test_plan_from_config_is_the_policys_lists_and_prints_without_buffers():
    cfg = tiny_config(pp=2, dp=2, m=4, precision="fp16", policy="ratrain")
    plan = PipelinePlan.from_config(cfg)
    assert plan.pp == 2 and plan.dp == 2 and plan.num_micro_batches == 4 and plan.shards == 2
    assert plan.blocks[0][0] == "embed" and plan.blocks[-1][-1] == "head"
    for s, info in enumerate(plan.stages):
        assert plan.stage_steps(s, 3, flush=True) == Policy("ratrain").steps(info, 3)
    assert plan.carries() and plan.steps(2)[1] == [plan.step_list(s, True) for s in range(2)]
    text = grid(plan.steps(2)[1], plan.blocks)
    assert "F mb0" in text and "update" in text and plan.grid() == text


@pytest.mark.parametrize("name,order", [("1f1b-bare", one_f_one_b), ("gpipe-bare", gpipe)])
def test_bare_order_is_a_policy_without_lifecycle(name, order):
    cfg = tiny_config(pp=2, m=3)
    plan = PipelinePlan.from_config(cfg, name)
    assert isinstance(plan.policy, Policy) and not plan.policy.components.lifecycle
    assert plan.policy.label == name and resolve_policy(cfg.schedule, name) == plan.policy
    assert [plan.step_list(s) for s in range(2)] == [order(2, s, 3) for s in range(2)]
    assert plan.flush_list(0) == () and not plan.carries()


def test_plan_is_validated_once_when_made():
    blocks = [("layers.0",), ("layers.1",)]
    plan = PipelinePlan.build(Policy("baseline-1f1b"), blocks, 2)
    first, carried, flush = plan.lists[0][0]
    broken = tuple(a for a in first if type(a).__name__ != "SendForward")
    bad = PipelinePlan(plan.policy, 1, plan.stages,
                       (((broken, carried, flush),), plan.lists[1]))
    with pytest.raises(ScheduleError):
        bad.validate()


def test_executor_is_handed_its_parts_and_runs_no_collective_when_made():
    """An engine that fails on any use: making the executor of a dp=2 rank never touches it
    (the collective measurement is `build_rank`'s explicit step, not the constructor's)."""
    from types import SimpleNamespace

    import numpy as np

    from ratrain.exec.context import ExecContext
    from ratrain.exec.params import StageState
    from ratrain.exec.spec import stage_blocks
    from ratrain.runtime.executor import Executor
    from ratrain.shim.ledger import Ledger

    class NoEngine:
        def __getattr__(self, name):
            raise AssertionError(f"engine.{name} used while the executor is made")

    cfg = tiny_config(pp=1, dp=2, policy="ratrain", recompute="auto")
    plan = PipelinePlan.from_config(cfg)
    ledger = Ledger(None, 1)
    state = StageState(stage_blocks(cfg.model, 1, 0), cfg.precision, ledger, np, 1, shard=(1, 2))
    ctx = ExecContext(cfg.model, cfg.precision, np, ledger, threads=1)
    topo = SimpleNamespace(stage=0, replica=1, rank=1)
    ex = Executor(cfg, plan, topo, state, ctx, NoEngine(), ledger)
    assert ex.predicted_peak is None and set(ex.compute.recompute.values()) == {"none"}
    assert ex.info is plan.stages[0] and ex.sharded
    with pytest.raises(ValueError, match="holds blocks"):  # a state of another stage
        other = StageState(stage_blocks(cfg.model, 2, 1), cfg.precision, ledger, np, 1,
                           shard=(1, 2))
        Executor(cfg, plan, topo, other, ctx, NoEngine(), ledger)
    ctx.close()


def test_a_plan_holds_every_replicas_share_checked_when_made():
    cfg = tiny_config(pp=2, dp=2, m=4)
    plan = PipelinePlan.from_config(cfg)
    assert plan.shares == (4, 4) and plan.replica == 0
    par = dataclasses.replace(cfg.parallel, replica_shares=(6, 2))
    uneven = PipelinePlan.from_config(dataclasses.replace(cfg, parallel=par), replica=1)
    assert uneven.shares == (6, 2) and uneven.num_micro_batches == 2 and uneven.replica == 1
    with pytest.raises(ValueError, match=r"replica 1 of 2 runs 3 micro-batches, but the shares "
                                         r"of the replicas are \[6, 2\]"):
        PipelinePlan.build(plan.policy, plan.blocks, 3, dp=2, shares=(6, 2), replica=1)
