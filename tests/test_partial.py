"""Partial synchronization (`sync.mode: partial`, `lifecycle.passes.partial`) without MPI: the
assignment, the step lists every policy gets, the validator's rules, the refusals, the
simulator's view of it, and dp = 1 bitwise equal to full sync."""

from dataclasses import replace

import pytest

from ratrain.config import ConfigError, SyncConfig, load_config
from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.passes.offload import Offload, OffloadPass, WaitFetch
from ratrain.lifecycle.passes.partial import AverageParams, PartialSync, WaitAverage
from ratrain.lifecycle.pipeline import PipelinePlan, check_passes
from ratrain.lifecycle.policies import POLICIES, Policy
from ratrain.lifecycle.validate import ScheduleError, check_lifecycle
from ratrain.plan.simulate import simulate_config
from tests._executor_util import params_digest, tiny_config, train

BLOCKS = [("embed", "layers.0", "layers.1"), ("layers.2", "layers.3", "head")]


def plan(policy="baseline-1f1b", period=3, dp=2, m=3, precision="fp32", blocks=BLOCKS,
         shard=None, after=False):
    every = [b for s in blocks for b in s]
    pol = Policy(policy)
    pol = Policy(policy, components=replace(pol.components, shard=pol.components.shard
                                            if shard is None else shard))
    return PipelinePlan.build(pol, blocks, m, precision, dp,
                              passes=(PartialSync.round_robin(every, period, after),))


PARTIAL = (PartialSync.round_robin([b for s in BLOCKS for b in s], 3),)  # the validator's pass


def test_round_robin_averages_every_block_once_a_period():
    blocks = [b for s in BLOCKS for b in s]
    ps = PartialSync.round_robin(blocks, 4)
    seen = [b for step in range(4) for b in sorted(ps.blocks_at(step))]
    assert sorted(seen) == sorted(blocks)  # each exactly once
    assert ps.blocks_at(0) == {"embed", "layers.3"} == ps.blocks_at(8)
    assert PartialSync.round_robin(blocks, 1).blocks_at(5) == set(blocks)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("period", [1, 2, 4])
def test_every_policy_averages_each_block_of_a_step_after_its_last_backward(policy, period,
                                                                            precision):
    p = plan(policy, period, precision=precision, shard=False)  # validated when made
    every = [b for s in BLOCKS for b in s]
    for k in range(2 * period):
        averaged = []
        for s in range(p.pp):
            events = [e for a in p.step_list(s, k > 0, k) for _, e in sched.expand(a, BLOCKS[s])]
            assert not any(isinstance(e, (sched.SyncGrad, sched.WaitGrad)) for e in events)
            averaged += [b for e in events if isinstance(e, AverageParams) for b in e.blocks]
        assert sorted(averaged) == sorted(b for b in every if every.index(b) % period == k % period)


def test_deferred_updates_wait_for_the_previous_steps_averages():
    p = plan("ratrain", period=2, shard=False)
    first = p.step_list(0, False, 0)
    avg = [b for a in first for _, e in sched.expand(a, BLOCKS[0])
           if isinstance(e, AverageParams) for b in e.blocks]
    assert avg == ["layers.1", "embed"]  # backward order
    nxt = [a for a in p.step_list(0, True, 1) if not isinstance(a, sched.Backward)]
    waits = [a.blocks[0] for a in nxt if isinstance(a, WaitAverage)]
    assert waits == ["embed", "layers.1"]  # before their (deferred) updates, model order
    for b in waits:
        i = nxt.index(WaitAverage((b,)))
        assert nxt[i + 1] == sched.Update(b)
    flush = p.flush_list(0, 0)
    assert WaitAverage(("embed",)) in flush and WaitAverage(("layers.0",)) not in flush


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("period", [1, 2, 4])
def test_after_update_averages_every_update_of_a_due_block_right_after_it(policy, period,
                                                                          precision):
    """`sync.average: after-update`: each update of a block in the step that averages it (a
    deferred update: the step before the list's; the flush: the last step's) is followed at
    once by the block's average; nothing else is averaged (the validator, run when the plan is
    made, checks each wait comes before the block's next read)."""
    p = plan(policy, period, precision=precision, shard=False, after=True)
    every = [b for s in BLOCKS for b in s]
    steps = 2 * period
    for s in range(p.pp):
        lists = [list(x) for x in p.stage_steps(s, steps, flush=True)]
        averaged, updated = [], []
        for k, lst in enumerate(lists):
            events = [e for a in lst for _, e in sched.expand(a, BLOCKS[s])]
            seen_norm = False  # updates before the list's norm (all of the flush's): step k - 1
            for i, e in enumerate(events):
                seen_norm |= isinstance(e, sched.GradNorm)
                j = k if seen_norm else k - 1
                if isinstance(e, sched.Update):
                    updated.append((j, e.block))
                if isinstance(e, AverageParams):
                    assert events[i - 1] == sched.Update(e.blocks[0]), (k, e)
                    averaged.append((j, e.blocks[0]))
        due = [(j, b) for j, b in updated if every.index(b) % period == j % period]
        assert sorted(averaged) == sorted(due) and len(updated) == steps * len(BLOCKS[s])


def test_after_update_waits_behind_the_next_forward_under_a_deferred_update():
    """Under `ratrain` (updates deferred into the next step's warm-up) a block's average is
    waited for as a hook of the next forward, just before that block's part of it: later blocks'
    averages run under the earlier blocks' forward; an fp16 view of the block is made after it."""
    for precision in ("fp32", "fp16"):
        p = plan("ratrain", period=2, shard=False, precision=precision, after=True)
        events = [(b, e) for a in p.step_list(0, True, 1) for b, e in sched.expand(a, BLOCKS[0])]
        i = events.index((None, WaitAverage(("layers.1",))))  # step 0 averaged embed, L1
        part = [(b, type(e)) for b, e in events]
        assert part[i - 1] == ("layers.0", sched.Forward)
        assert part[i + 1] == ((None, sched.MaterializeView) if precision == "fp16"
                               else ("layers.1", sched.Forward))
        assert events.index((None, AverageParams(("layers.1",)))) < \
            part.index(("embed", sched.Forward))


def test_validator_refuses_misplaced_averages_after_the_update():
    lists = [list(x) for x in plan("ratrain", 2, shard=False, after=True).stage_steps(0, 3, True)]
    check_lifecycle(lists, BLOCKS[0], 3, fp16=False, passes=PARTIAL)
    hooked = [a for a in lists[1] if isinstance(a, sched.Forward) and a.pre]
    bare = [replace(a, pre=()) if a in hooked else a for a in lists[1]]  # no wait
    with pytest.raises(ScheduleError, match="master of embed read while its average"):
        check_lifecycle([lists[0], bare], BLOCKS[0], 3, fp16=False, passes=PARTIAL)
    upd = lists[1].index(sched.Update("embed"))
    twice = lists[1][:upd + 2] + [WaitAverage(("embed",)), AverageParams(("embed",))]
    with pytest.raises(ScheduleError, match="average of embed neither"):
        check_lifecycle([lists[0], twice], BLOCKS[0], 3, fp16=False, passes=PARTIAL)
    half = [list(x) for x in plan("ratrain", 2, shard=False, precision="fp16",
                                  after=True).stage_steps(0, 2, True)]
    upd = half[1].index(sched.Update("embed"))
    early = half[1][:upd + 2] + [sched.MaterializeView("embed")]  # the view mid-average
    with pytest.raises(ScheduleError, match="view of embed made from its master while"):
        check_lifecycle([half[0], early], BLOCKS[0], 3, fp16=True, passes=PARTIAL)


def _lists(policy="baseline-1f1b", precision="fp32"):
    p = plan(policy, period=2, precision=precision)
    return [list(x) for x in p.stage_steps(0, 3, flush=True)]


def test_validator_refuses_misplaced_averages():
    steps = _lists()
    check_lifecycle(steps, BLOCKS[0], 3, fp16=False, passes=PARTIAL)
    with pytest.raises(ScheduleError, match="gradient sync under partial"):
        check_lifecycle([[sched.SyncGrad(("embed",))] + steps[0]], BLOCKS[0], 3, passes=PARTIAL)
    with pytest.raises(TypeError, match="no handler for AverageParams"):  # without the pass
        check_lifecycle(steps, BLOCKS[0], 3, fp16=False)
    early = [AverageParams(("embed",))] + steps[0]  # before its backward
    with pytest.raises(ScheduleError, match="average of embed neither between its last "
                       "backward and its update nor after"):
        check_lifecycle([early], BLOCKS[0], 3, passes=PARTIAL)
    no_wait = [a for a in steps[0] if not isinstance(a, WaitAverage)]
    with pytest.raises(ScheduleError, match="update of .* while its average is in flight"):
        check_lifecycle([no_wait], BLOCKS[0], 3, passes=PARTIAL)


def test_validator_refuses_a_master_read_while_averaged():
    """fp32 unsharded: the view is the master, so no forward may read it mid-average."""
    blocks = ("embed",)
    step = [sched.MaterializeView("embed"), sched.AllocGrad("embed"), sched.Forward(0),
            sched.Backward(0, post=(("embed", AverageParams(blocks)),)), sched.GradNorm()]
    late = [sched.Forward(0)]  # the next step's forward, its average still in flight
    with pytest.raises(ScheduleError, match="master of embed read while its average"):
        check_lifecycle([step, late], blocks, 1, fp16=False, passes=PARTIAL)


def test_partial_sync_picks_whole_optimizer_state_and_refuses_a_sharded_one_in_one_line():
    cfg = load_config("tiny", ["parallel.dp=2", "sync.mode=partial"])  # unset: whole, by itself
    assert cfg.schedule.shard_optimizer is False and PipelinePlan.from_config(cfg).shards == 1
    check_passes(cfg)
    assert load_config("tiny", ["parallel.dp=2"]).schedule.shard_optimizer is None  # full sync
    cfg = load_config("tiny", ["parallel.dp=2", "sync.mode=partial",
                               "schedule.shard_optimizer=true"])
    with pytest.raises(ValueError) as e:
        check_passes(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "sync.mode=partial" in msg
    assert "schedule.shard_optimizer=true" in msg and "parallel.dp=2" in msg
    with pytest.raises(ValueError, match="shard_optimizer"):
        PipelinePlan.from_config(cfg)
    with pytest.raises(ValueError, match="shard_optimizer"):
        plan("ratrain")
    check_passes(load_config("tiny", ["sync.mode=partial"]))  # dp 1: nothing is sharded


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_partial_sync_composes_with_the_tier(policy):
    """Each phase's lists carry both the averages and the tier's transfers, validated together;
    masters in the tier while they are averaged are refused in one line naming the keys."""
    every = [b for s in BLOCKS for b in s]
    offloaded = [tuple(b for b in s if b.startswith("layers.")) for s in BLOCKS]
    pol = Policy(policy)
    pol = Policy(policy, components=replace(pol.components, shard=False))
    ps = PartialSync.round_robin(every, 3)
    p = PipelinePlan.build(pol, BLOCKS, 3, "fp32", 2,
                           passes=(ps, OffloadPass(offloaded, "moments")))
    for step in range(3):
        kinds = {type(e) for a in p.step_list(0, step > 0, step)
                 for _, e in sched.expand(a, BLOCKS[0])}  # with the hooks on compute
        assert Offload in kinds and WaitFetch in kinds
        assert (AverageParams in kinds) == bool(ps.blocks_at(step) & set(BLOCKS[0]))
    with pytest.raises(ValueError) as e:
        PipelinePlan.build(pol, BLOCKS, 3, "fp16", 2, passes=(ps, OffloadPass((), "masters")))
    msg = str(e.value)
    assert "\n" not in msg and "sync.mode=partial" in msg and "offload.optimizer=moments" in msg
    with pytest.raises(ValueError, match="offload.optimizer=masters"):
        check_passes(load_config("tiny", ["sync.mode=partial", "offload.optimizer=masters",
                                          "precision=fp16"]))


@pytest.mark.parametrize("sets,words", [
    (["sync.mode=some"], "sync.mode='some' is not one of: full, partial"),
    (["sync.period=0"], "sync.period=0 must be >= 1"),
    (["sync.assign=greedy"], "sync.assign='greedy' is not one of"),
    (["sync.average=later"], "sync.average='later' is not one of: after-update, before-update"),
])
def test_bad_sync_keys(sets, words):
    with pytest.raises(ConfigError, match=words):
        load_config("tiny", sets)


def test_simulator_prices_partial_sync_on_a_slow_link():
    base = ["parallel.dp=4", "schedule.shard_optimizer=false", "platform.profile=mt3000",
            "platform.ranks_per_node=2", "platform.link_bandwidth=1e7",
            "platform.compute_flops=4e10"]
    full = simulate_config(load_config("tiny", base), with_memory=False)
    part = {h: simulate_config(load_config("tiny", [*base, "sync.mode=partial",
                                                    f"sync.period={h}"]), with_memory=False)
            for h in (1, 2, 4, 8)}
    assert full.comm_exposed_s > full.ranks[0].compute_s  # the link is the wall
    steps = [part[h].step_s for h in (1, 2, 4, 8)]
    assert steps == sorted(steps, reverse=True) and steps[-1] < full.step_s / 2
    assert part[1].step_s == pytest.approx(full.step_s, rel=0.05)  # every block every step
    # the compute of a step is the same; the period's mean is what is reported
    assert part[4].ranks[0].compute_s == pytest.approx(full.ranks[0].compute_s)


@pytest.mark.parametrize("average", SyncConfig.AVERAGES)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("policy", ["baseline-1f1b", "ratrain"])
def test_dp1_partial_is_bitwise_full(policy, precision, average):
    cfg = tiny_config(precision=precision, policy=policy, steps=3)
    full, _, ex_full = train(cfg)
    part, _, ex_part = train(replace(cfg, sync=SyncConfig(mode="partial", period=2,
                                                          average=average)))
    assert [(r.loss, r.grad_norm, r.skipped) for r in part] == \
        [(r.loss, r.grad_norm, r.skipped) for r in full]
    assert params_digest(ex_part.final_params) == params_digest(ex_full.final_params)


def test_planner_prints_full_against_partial_on_a_link(capsys):
    from ratrain.plan.__main__ import main

    assert main(["--config", "tiny", "--sync-periods", "2,4", "--set", "parallel.dp=4",
                 "--set", "platform.profile=mt3000", "--set", "platform.link_bandwidth=1e7",
                 "--set", "platform.ranks_per_node=2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("  full", "  partial"))]
    assert [r[0] for r in rows] == ["full", "full,", "partial,", "partial,"]  # tiny shards
    speedups = [float(r[-1].rstrip("x")) for r in rows]
    assert speedups[2] > 1.2 and speedups[3] > speedups[2]
    assert "the speed-up to a loss is this times" in out and "--step-efficiency" in out
    with pytest.raises(SystemExit) as e:
        main(["--config", "tiny", "--sync-periods", "0"])
    assert e.value.code == 2


def test_curves_override_each_run_alone_and_judge_each_seed(tmp_path):
    """`benchmarks/psync.py curves`: `--set` reaches both runs, `--full-set` / `--partial-set`
    one each (a learning rate of 1e-12 leaves that run's eval loss where it started); a verdict
    line per pair, and with `--seeds` a pair per seed and their summary."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    def curves(*args):
        res = subprocess.run(
            [sys.executable, "benchmarks/psync.py", "curves", "--config", "jobs/psync.yaml",
             "--out", str(tmp_path), "--period", "2", "--set", "run.steps=4", "--set",
             "data.eval_interval=2", "--set", "data.eval_batches=1", "--set",
             "optim.warmup_steps=0", *args], cwd=Path(__file__).parents[1],
            capture_output=True, text=True, check=False)
        return res.returncode, [json.loads(line) for line in res.stdout.splitlines()]

    def evals(run):
        return [json.loads(line)["eval_loss"] for line in (tmp_path / run / "eval.jsonl")
                .read_text().splitlines()]

    still = ["optim.lr=1e-12", "optim.min_lr=1e-12"]
    rc, out = curves(*(a for s in still for a in ("--partial-set", s)))
    full, part = evals("full"), evals("partial-2-after")  # the default placement
    assert abs(part[1] - part[0]) < 1e-6 and full[1] < full[0] - 1e-3
    verdict = out[0]  # the partial run that did not learn is judged worse, at the end too
    assert rc == 1 and not verdict["within"] and verdict["partial_final"] == round(part[1], 4)
    assert verdict["end_pct"] == round(100 * (part[1] / full[1] - 1), 3) > 2
    assert verdict["step_efficiency"] == 0.5  # full was further at its first eval (step 2 of 4)
    rc, out = curves(*(a for s in still for a in ("--full-set", s)), "--seeds", "1,2")
    for seed in (1, 2):
        full, part = evals(f"seed-{seed}/full"), evals(f"seed-{seed}/partial-2-after")
        assert abs(full[1] - full[0]) < 1e-6 and part[1] < part[0] - 1e-3
    assert evals("seed-1/full") != evals("seed-2/full")
    assert rc == 0 and [r["seed"] for r in out[:2]] == [1, 2] and out[2]["seeds"] == 2
    assert out[2]["within"] and out[2]["mean_end_pct"] < 0
    assert [r["step_efficiency"] for r in out[:2]] == [2.0, 2.0] == [out[2]["mean_step_efficiency"]] * 2


def test_curves_control_regroups_full_sync_alone(tmp_path):
    """`curves --control`: the second run is full sync again on the same tokens in half as many
    micro-batches of twice the sequences (rounding alone: its evals within 1e-5), judged either
    way; refused in one line, exit 2, when the count is odd or a partial run is asked for
    (its overrides, its placement)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    def curves(*args):
        res = subprocess.run(
            [sys.executable, "benchmarks/psync.py", "curves", "--config", "jobs/psync.yaml",
             "--out", str(tmp_path), "--control", "--set", "run.steps=4", "--set",
             "data.eval_interval=2", "--set", "data.eval_batches=1", "--set",
             "optim.warmup_steps=0", *args], cwd=Path(__file__).parents[1],
            capture_output=True, text=True, check=False)
        return res.returncode, res.stdout, res.stderr

    rc, out, err = curves()
    verdict = json.loads(out.splitlines()[0])
    full, other = ([json.loads(line)["eval_loss"] for line in (tmp_path / run / "eval.jsonl")
                    .read_text().splitlines()] for run in ("full", "full-regrouped"))
    assert rc == 0 and verdict["within"] and verdict["period"] == 0, err
    assert full[1] < full[0] - 1e-3 and all(abs(b / a - 1) < 1e-5 for a, b in zip(full, other))
    assert verdict["regrouped_final"] == round(other[-1], 4)
    for bad, named in ((("--set", "parallel.dp=1", "--set", "parallel.num_micro_batches=1"),
                        "1 x 1"), (("--partial-set", "optim.lr=1e-3"), "--partial-set"),
                       (("--average", "after-update"), "--average after-update")):
        rc, out, err = curves(*bad)
        assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and named in err


def _psync():
    """benchmarks/psync.py as a module."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import psync

    return psync


def test_psync_refuses_a_bad_average_in_one_line(capsys):
    """`benchmarks/psync.py --average`: a value that is no `sync.average`, or two where one run
    is trained, is refused in one line, exit 2, before any work; so is a negative
    `--extra-steps`."""
    psync = _psync()
    for argv, words in ((["curves", "--average", "later"], "'later' is not one of"),
                        (["quality", "--average", "after-update,before-update"],
                         "quality trains one placement"),
                        (["quality", "--extra-steps", "-5"], "--extra-steps -5: give 0")):
        assert psync.main([*argv, "--config", "jobs/psync.yaml", "--out", "/nonexistent"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err
    assert sorted(psync.variants([4], ["after-update", "before-update"])) == \
        ["full", "partial-4", "partial-4-after"]


@pytest.mark.parametrize("average", SyncConfig.AVERAGES)
def test_psync_assign_simulates_the_jobs_placement(average, capsys):
    """`benchmarks/psync.py assign`: its round-robin row is the simulator's step of the job
    itself, under the placement `--average` asks for."""
    import json

    psync = _psync()
    assert psync.main(["assign", "--config", "jobs/psync.yaml", "--periods", "4",
                       "--average", average]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    cfg = load_config("jobs/psync.yaml", ["sync.mode=partial", "sync.period=4",
                                          f"sync.average={average}"])
    want = simulate_config(cfg, with_memory=False).step_s * cfg.platform.time_scale
    assert row["round-robin"] == pytest.approx(want, abs=1e-4)


def test_reference_after_update_averages_the_updated_masters():
    """The reference under `sync.average: after-update`: the blocks a step averages leave it
    equal on every replica (averaged after the update); before the update they leave it apart
    (each replica's update after the average), and the blocks of other steps leave it apart
    under both."""
    import numpy as np

    from tests._executor_util import global_batch
    from tests._partial_ref import Replicas
    from tests.test_partial_mpi import partial_config

    cfg = partial_config(period=2, steps=1)
    m = cfg.parallel.num_micro_batches
    inputs, targets = global_batch(cfg, 0)
    batches = [(inputs[r * m:(r + 1) * m], targets[r * m:(r + 1) * m]) for r in range(2)]
    for after in (False, True):
        average = "after-update" if after else "before-update"
        reps = Replicas(replace(cfg, sync=replace(cfg.sync, average=average)))
        reps.step(0, batches)
        now = reps.executors[0].plan.pass_named("partial").blocks_at(0)
        for b in reps.executors[0].blocks:
            a, c = (ex.state.master_flat(b) for ex in reps.executors)
            assert np.array_equal(a, c) == (after and b in now), (after, b)
        reps.close()


def test_psync_quality_trains_both_and_reports_the_step_efficiency(tmp_path, monkeypatch,
                                                                   capsys):
    """`benchmarks/psync.py quality` end to end on a short job under mpirun: full, then partial
    trained half the job's steps past full's last (the default `--extra-steps`), judged by
    `ratrain.compare`, whose figures (the step efficiency among them) make the summary line."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    psync = _psync()
    assert Path(sys.executable).with_name("mpirun").exists(), "no mpirun beside the interpreter"
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    monkeypatch.chdir(root)
    sets = ["platform.emulate=false", "parallel.dp=2", "run.steps=4", "optim.warmup_steps=0",
            "optim.decay_steps=4", "data.eval_interval=2", "data.eval_batches=1"]
    psync.main(["quality", "--config", "jobs/psync.yaml", "--out", str(tmp_path), "--ranks",
                "2", "--period", "2", *(a for s in sets for a in ("--set", s))])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"step_efficiency", "time_to_final_a", "speedup", "final_rel_dev"} <= set(summary)
    from ratrain.compare import read_metrics

    assert sorted(read_metrics(str(tmp_path / "full"), "eval_loss")) == [2, 4]
    assert sorted(read_metrics(str(tmp_path / "partial-2-after"), "eval_loss")) == [2, 4, 6]
