"""The checkpoint corruption fuzzer, seeded and short (tests/_ckpt_fuzz.py; thousands of cases:
benchmarks/ckpt_fuzz.py).

One process: a real run at 1 x 1 with checkpoints at steps 2 and 4, random damage to them,
`resume auto` judged in-process for most cases and the trainer restarted for three: the two
holes of issue 33 (a manifest's step edited to another number, and to 999991 with the older
checkpoint damaged too) and one random case. Under mpirun at 4 ranks: the same at pp 2 x dp 2,
judged collectively, and restarts onto another layout (pp 1 x dp 4) against clean resumes.
"""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ratrain import checkpoint as ck
from ratrain.config import load_config
from ratrain.data import write_tokens
from tests import _ckpt_fuzz as fz

JOB = """
model: {vocab_size: 64, hidden: 32, layers: 4, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}
parallel: {micro_batch: 2, num_micro_batches: 2}
optim: {lr: 1.0e-2, warmup_steps: 2}
checkpoint: {interval: 2, keep: 3, resume: never}
run: {steps: 6, log_interval: 1, threads: 1}
"""
CASES = 60  # in-process cases per layout


def write_job(d: str) -> str:
    write_tokens(os.path.join(d, "t.bin"), np.random.default_rng(0).integers(0, 64, 20000),
                 vocab_size=64)
    job = os.path.join(d, "job.yaml")
    with open(job, "w") as f:
        f.write(JOB + f"data: {{tokens: {d}/t.bin}}\n")
    return job


def fuzz_dir(run_dir: str, to: str) -> str:
    """A copy of a finished run with its checkpoints of steps 2 and 4 (the last one, 6, gone):
    a restart resumes from one of them and trains to step 6."""
    shutil.copytree(run_dir, to)
    shutil.rmtree(os.path.join(to, "checkpoints", ck.checkpoint_name(6)))
    return to


def pristine_of(root: str) -> dict:
    return {os.path.basename(p): fz.snapshot(p) for p in fz.checkpoints(root)}


def in_process(root: str, cfg, seeds, comm=None, work=None) -> list[fz.Case]:
    """Judge each seeded case on a fresh damaged copy of `root` (collective over `comm`)."""
    rank = comm.Get_rank() if comm is not None else 0
    pristine = pristine_of(root) if rank == 0 else None
    cases = []
    for seed in seeds:
        case = fz.Case(seed)
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(root, work)
            fz.damage(random.Random(seed), work, pristine, case)
        if comm is not None:
            comm.Barrier()
        fz.judge(work, root, case, cfg, comm=comm)
        if comm is not None:  # every rank took the same verdict
            verdicts = comm.gather(case.failure or case.took or "refused", root=0)
            if rank == 0 and len({v for v in verdicts if not v.startswith("traceback")}) > 1:
                case.failure = case.failure or f"ranks disagree: {verdicts}"
        cases.append(case)
    return cases


def assert_passed(cases):
    failed = [(c.seed, c.damages, c.failure) for c in cases if c.failure]
    assert not failed, failed
    outcomes = {c.outcome.split()[0] for c in cases}
    assert outcomes == {"resume", "refuse"}, outcomes  # both kinds of verdict were exercised


# -- one process ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run1(tmp_path_factory):
    """The uninterrupted run at 1 x 1 (checkpoints 2, 4, 6) and its job."""
    d = str(tmp_path_factory.mktemp("fuzz1"))
    job = write_job(d)
    p = fz.train(job, f"{d}/run")
    assert p.returncode == 0, p.stderr
    return job, f"{d}/run"


def _edit_step(path: str, new: int) -> None:
    man = os.path.join(path, ck.MANIFEST)
    text = open(man).read()
    old = re.search(r'"step": (\d+)', text).group(0)
    with open(man, "w") as f:
        f.write(text.replace(old, f'"step": {new}', 1))


def test_fuzz_one_rank_in_process(run1, tmp_path):
    job, run = run1
    cfg = load_config(job, [])
    root = os.path.join(fuzz_dir(run, str(tmp_path / "pristine")), "checkpoints")
    assert_passed(in_process(root, cfg, range(CASES), work=str(tmp_path / "work")))


def test_fuzz_one_rank_restarts(run1, tmp_path):
    """The trainer on damaged copies: the issue's two holes and one random case; each resumed
    run ends bitwise where the uninterrupted run did (resuming at 1 x 1 is exact)."""
    job, run = run1
    cfg = load_config(job, [])
    want = fz.final_state(os.path.join(run, "checkpoints", ck.checkpoint_name(6)))
    pristine = os.path.join(fuzz_dir(run, str(tmp_path / "pristine")), "checkpoints")

    def restart(name, spoil, seed=None):
        d = fuzz_dir(run, str(tmp_path / name))
        root = os.path.join(d, "checkpoints")
        case = fz.Case(seed or 0)
        before = pristine_of(root)
        if seed is None:
            spoil(fz.checkpoints(root))
        else:
            fz.damage(random.Random(seed), root, before, case)
        case.damaged = {os.path.basename(p): fz.snapshot(p) != before[os.path.basename(p)]
                        for p in fz.checkpoints(root)}
        fz.judge(root, pristine, case, cfg)
        assert not case.failure, case.failure
        return case, fz.restart(job, d, case, lambda name: want)

    # hole 1: the newest manifest's step edited to another number: skipped, the older taken
    case, why = restart("step", lambda ckpts: _edit_step(ckpts[0], 3))
    assert case.expect == ck.checkpoint_name(2) and not why, why
    # hole 2: edited to 999991 ("nothing to do" before), the older damaged too: one refusal
    case, why = restart("finished", lambda ckpts: (
        _edit_step(ckpts[0], 999991), os.truncate(os.path.join(ckpts[1], "shard-s000.h5"), 999)))
    assert case.expect is None and not why, why
    case, why = restart("random", None, seed=7)
    assert not why, (case.damages, why)


def test_a_checkpoint_unreadable_after_verification_is_one_line(run1, tmp_path):
    """Verified at start-up, then unreadable when the rank reads it (changed since): one line,
    exit 2, no traceback (the load is made to fail as a file changed underneath would)."""
    job, run = run1
    d = fuzz_dir(run, str(tmp_path / "changed"))
    code = ("import sys; from ratrain.checkpoint import CheckpointError; "
            "import ratrain.train.trainer as T\n"
            "def boom(state, path, *a, **k): raise CheckpointError(path + '/shard-s000.h5: truncated')\n"
            "T.load_stage = boom\nfrom ratrain.train import main\n"
            f"sys.exit(main(['--config', {job!r}, '--set', 'run.dir={d}', "
            "'--set', 'checkpoint.resume=auto']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "resume auto" not in ln]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 1 and lines[0].startswith("error: cannot resume from "), lines
    assert "shard-s000.h5: truncated" in lines[0] and "changed since?" in lines[0]


# -- pp 2 x dp 2, resumed onto another layout ------------------------------------------------


@pytest.mark.mpi(min_size=4)
def test_fuzz_pp2_dp2_onto_another_layout(tmp_path_factory, capsys):
    from mpi4py import MPI

    from ratrain.train import main
    from tests._mpi_job import shared_dir

    comm = MPI.COMM_WORLD
    if comm.size != 4:
        pytest.skip("pp 2 x dp 2 needs exactly 4 ranks")
    d = shared_dir(comm, tmp_path_factory, "fuzz4")
    job = write_job(d) if comm.rank == 0 else os.path.join(d, "job.yaml")
    comm.Barrier()
    saved = ["--config", job, "--set", "parallel.pp=2", "--set", "parallel.dp=2"]
    assert main([*saved, "--set", "run.steps=4", "--set", f"run.dir={d}/run"]) == 0
    cfg = load_config(job, [])
    root = os.path.join(d, "run", "checkpoints")
    cases = in_process(root, cfg, range(CASES // 3), comm=comm, work=f"{d}/work")
    failed = comm.bcast([(c.seed, c.damages, c.failure) for c in cases if c.failure], root=0)
    assert not failed, failed  # on every rank: none goes on alone into a collective
    if comm.rank == 0:
        assert_passed(cases)
    other = ["--config", job, "--set", "parallel.pp=1", "--set", "parallel.dp=4"]

    @functools.cache
    def clean(name):  # a clean resume from the pristine checkpoint `name`, at pp 1 x dp 4
        out = f"{d}/clean-{name}"
        assert main([*other, "--set", f"run.dir={out}",
                     "--set", f"checkpoint.resume={root}/{name}"]) == 0
        last = fz.checkpoints(f"{out}/checkpoints")[0]
        return fz.final_state(last) if comm.rank == 0 else None

    def restart(name, spoil):
        run_dir = f"{d}/{name}"
        if comm.rank == 0:
            shutil.copytree(f"{d}/run", run_dir)
            spoil(fz.checkpoints(f"{run_dir}/checkpoints"))
        comm.Barrier()
        capsys.readouterr()
        rc = main([*other, "--set", f"run.dir={run_dir}", "--set", "checkpoint.resume=auto"])
        return rc, capsys.readouterr()

    want = clean(ck.checkpoint_name(2))
    rc, out = restart("newest-bad", lambda ckpts: fz.flip_bits(random.Random(1), ckpts[0], None))
    assert rc == 0
    if comm.rank == 0:  # the last collective is behind: rank 0 checks alone
        assert "steps 3..6" in out.out and "Traceback" not in out.err
        assert fz.final_state(fz.checkpoints(f"{d}/newest-bad/checkpoints")[0]) == want
    rc, out = restart("both-bad", lambda ckpts: [fz.manifest_digit(random.Random(2), c, None)
                                                 for c in ckpts])
    assert rc == 2
    if comm.rank == 0:
        lines = [ln for ln in out.err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: checkpoint.resume=auto"), lines
