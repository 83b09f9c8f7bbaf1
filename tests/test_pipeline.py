"""The PipelinePlan: one pure object per pipeline, made before any buffer."""

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
    broken = tuple(a for a in plan.first[0] if type(a).__name__ != "SendForward")
    bad = PipelinePlan(plan.policy, 1, plan.stages, (broken, plan.first[1]), plan.carried,
                       plan.flushes)
    with pytest.raises(ScheduleError):
        bad.validate()
