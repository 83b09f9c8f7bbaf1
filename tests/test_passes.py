"""Passes over the step (`lifecycle.passes`, `runtime.passes`): a toy pass registered from
outside the package, as a new feature would be (one file per side, here both in this test),
runs a step of training with its own action, checked by the validator, walked by the memory
model, played by the simulator, run by its runner; a pass that leaves an interpreter without a
handler for its action fails when the interpreter's table is made; built-in passes come in
their order, and `PipelinePlan.build` takes passes, not per-feature arguments."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest

from ratrain.config import OffloadConfig, SyncConfig
from ratrain.lifecycle import passes, validate
from ratrain.lifecycle.memory import simulate_peak, stage_sizes
from ratrain.lifecycle.passes import Handlers, Pass
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.lifecycle.policies import StageInfo
from ratrain.lifecycle.schedule import Action, Update, expand
from ratrain.lifecycle.validate import Extension, ScheduleError, check_lifecycle
from ratrain.plan.memory import stage_peaks
from ratrain.plan.simulate import simulate_config
from ratrain.plan.steps import recompute_for
from ratrain.runtime import passes as runners
from tests._executor_util import params_digest, tiny_config, train

# -- the plan-time side: one action, placed after each block's update ---------------------------


@dataclass(frozen=True)
class Mark(Action):
    """Note that the block's update ran (the toy pass's one action)."""

    block: str
    group: ClassVar[str] = "lifecycle"
    word: ClassVar[str] = "mark"


class MarkCheck(Extension):
    """A mark comes right after its block's update, once per update."""

    def __init__(self, life):
        self.life, self.last = life, None

    def handlers(self):
        return {Mark: self._mark}

    def _mark(self, e, b, x):
        if self.last != b:
            self.life.fail(e, f"mark of {b} not right after its update")
        self.last = None

    def after(self, blk, e):
        self.last = e.block if isinstance(e, Update) else None


@dataclass(frozen=True)
class MarkUpdates(Pass):
    name: ClassVar[str] = "toy"
    actions: ClassVar[tuple] = (Mark,)

    def rewrite(self, lists, info, phase, policy):
        def one(lst):
            return tuple(x for a in lst for x in ((a, Mark(a.block)) if isinstance(a, Update)
                                                  else (a,)))
        return tuple(one(lst) for lst in lists)

    def validator(self, life):
        return MarkCheck(life)

    def memory(self, walk):  # a mark holds no bytes
        return Handlers({Mark: lambda blk, e: None})

    def simulator(self, flat):  # nor takes time
        return Handlers({Mark: lambda a: None})


# -- the run-time side: count the marks -----------------------------------------------------------


class Counter(runners.Runner):
    seen: ClassVar[list] = []

    def handlers(self):
        return {Mark: lambda a: Counter.seen.append(a.block)}


@pytest.fixture
def toy():
    passes.register("toy", lambda cfg, blocks: MarkUpdates())
    runners.register("toy", lambda executor, p, resource: Counter())
    Counter.seen.clear()
    yield
    passes.unregister("toy")
    runners.unregister("toy")


def test_a_toy_pass_from_outside_runs_a_step_as_every_interpreter_sees_it(toy):
    cfg = tiny_config(pp=1, precision="fp16", steps=2)
    plan = PipelinePlan.from_config(cfg)  # validated with the toy's check
    assert [p.name for p in plan.passes] == ["toy"] and "toy" in passes.registered()
    marks = [a for a in plan.step_list(0, True) if isinstance(a, Mark)]
    assert [m.block for m in marks] == list(plan.blocks[0])
    res, _, ex = train(cfg)
    assert Counter.seen == list(plan.blocks[0]) * 2  # two steps' updates (the last flushed)
    rec, mb = recompute_for(plan.blocks, "none"), cfg.parallel.micro_batch
    mt = replace(cfg, platform=replace(cfg.platform, profile="mt3000"))
    peaks, step_s = stage_peaks(plan, cfg.model, mb, rec), simulate_config(mt).step_s
    passes.unregister("toy")  # the same training, memory and step without it
    ref, _, ex0 = train(cfg)
    assert [r.loss for r in res] == [r.loss for r in ref]
    assert params_digest(ex.final_params) == params_digest(ex0.final_params)
    assert peaks == stage_peaks(PipelinePlan.from_config(cfg), cfg.model, mb, rec)
    assert step_s == simulate_config(mt).step_s


def test_its_misplaced_action_is_refused_by_its_own_check(toy):
    plan = PipelinePlan.from_config(tiny_config(pp=1))
    lists = [list(x) for x in plan.stage_steps(0, 2, flush=True)]
    i = next(i for i, a in enumerate(lists[1]) if isinstance(a, Mark))
    lists[1].insert(0, lists[1].pop(i))  # a mark before its update
    with pytest.raises(ScheduleError, match="not right after its update"):
        check_lifecycle(lists, plan.blocks[0], plan.num_micro_batches, 0, False, False,
                        plan.passes)


def test_a_pass_without_a_handler_fails_when_a_table_is_made():
    class Silent(MarkUpdates):
        def memory(self, walk):
            return None  # the memory model gets no handler for Mark

    cfg = tiny_config()
    plan = PipelinePlan.build(*_layout(), passes=(Silent(),))  # validated: its check is there
    sizes = stage_sizes(cfg.model, 1, "fp32", plan.blocks[0])
    with pytest.raises(TypeError, match=r"neither handles nor ignores \['Mark \(pass toy\)'\]"):
        simulate_peak(plan.stage_steps(0, 2), plan.blocks[0], sizes, plan.passes)
    plan = PipelinePlan.build(*_layout(), passes=(MarkUpdates(),))
    with pytest.raises(TypeError, match="no handler for Mark"):  # the plan's passes not given
        simulate_peak(plan.stage_steps(0, 2), plan.blocks[0], sizes)


def test_a_pass_without_a_runner_is_refused_by_name(toy):
    runners.unregister("toy")
    with pytest.raises(ValueError, match="pass 'toy' has no runner"):
        train(tiny_config(pp=1, steps=1))


def _layout():
    from ratrain.exec.spec import stage_blocks
    from ratrain.lifecycle.policies import Policy

    cfg = tiny_config()
    return Policy("baseline-1f1b"), [tuple(b.name for b in stage_blocks(cfg.model, 1, 0))], 2


def test_builtin_passes_come_in_order_and_build_takes_no_feature_arguments():
    cfg = tiny_config(pp=2, dp=2, precision="fp16", steps=1)
    cfg = replace(cfg, sync=SyncConfig(mode="partial", period=2),
                  offload=OffloadConfig(activations="all"),
                  schedule=replace(cfg.schedule, shard_optimizer=False))
    plan = PipelinePlan.from_config(cfg)
    assert [p.name for p in plan.passes] == ["partial", "offload"] and plan.period == 2
    for fn in (PipelinePlan.build, PipelinePlan.of_model):
        params = set(inspect.signature(fn).parameters)
        assert not params & {"offloaded", "offload_state", "offload_all", "partial", "sync"}
    assert not {"offload", "offload_state"} & set(StageInfo.__dataclass_fields__)
    for fn in (validate.check_lifecycle, validate.validate_stages):
        assert "partial" not in inspect.signature(fn).parameters
    # each stage's lists: the averages and the tier's transfers in the same list
    words = {e.name().split()[0] for a in plan.step_list(0, True, 1)
             for _, e in expand(a, plan.blocks[0])}
    assert {"avg", "offload", "fetch"} <= words or {"wait-avg", "offload"} <= words
