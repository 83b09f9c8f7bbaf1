"""The trainer under faults, end to end on one process: refusals before any work (exit 2), a run
that diverges (exit 4), a graceful stop on a signal (exit 75) that resumes bitwise, two runs on
one directory, a finished run, resume auto with nothing usable, a full checkpoint disk (exit 5,
never a damaged checkpoint nor a restart loop), and the CLI's one-line errors."""

import json
import os
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest

from ratrain.data import write_tokens
from tests._prereq import tmpfs
from tests.test_train import TINY, metrics, train

CMD = [sys.executable, "-m", "ratrain.train"]


@pytest.fixture()
def job(tmp_path):
    tokens = tmp_path / "train.bin"
    write_tokens(tokens, np.random.default_rng(0).integers(0, 64, 20000), vocab_size=64)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(TINY + f"data: {{tokens: {tokens}}}\n")
    return cfg


def start(cfg, run_dir, *sets):
    cmd = [*CMD, "--config", str(cfg), "--set", f"run.dir={run_dir}"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["optim.lr=.inf"], "optim.lr=inf must be a finite number"),
        (["platform.profile=nope"], "unknown platform profile 'nope'"),
        (["platform.ddr_bytes=100000"], "over the DDR cap"),
        (["parallel.micro_batch=5000000"], "available"),  # the host's memory, no cap
        (["comm.timeout=-1"], "comm.timeout=-1.0 must be 0"),
    ],
)
def test_checks_without_training_are_one_line_before_any_work(job, tmp_path, sets, needle):
    run = tmp_path / "run"
    p = train(job, run, *sets, check=False)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and p.stderr.startswith("error: ")
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1
    assert not run.exists()


def test_duplicated_yaml_section_is_refused(job, tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text(job.read_text() + "optim: {lr: 1.0}\n")
    p = train(dup, tmp_path / "run", check=False)
    assert p.returncode == 2 and "'optim' appears twice in one mapping" in p.stderr


def test_a_diverging_fp32_run_stops_at_the_first_non_finite_step(job, tmp_path):
    p = train(job, tmp_path / "run", "optim.lr=1e30", "optim.grad_clip=0", "run.steps=20",
              check=False)
    assert p.returncode == 4, p.stdout + p.stderr
    assert "training diverged" in p.stderr and "optim.max_nonfinite_steps=1" in p.stderr
    recs = metrics(tmp_path / "run")
    assert len(recs) < 20 and (recs[-1]["skipped"] or not np.isfinite(recs[-1]["loss"]))


def test_signal_stops_with_a_checkpoint_and_resumes_bitwise(job, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    sets = ["run.steps=60", "checkpoint.interval=25"]
    train(job, full, *sets)
    p = start(job, part, *sets)
    for line in p.stdout:  # the run is training
        if line.startswith("step") and "/60" in line:
            break
    p.send_signal(signal.SIGUSR1)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 75, out + err
    stopped = int(out.split("stopped at step ")[1].split()[0])
    assert f"checkpoint saved: {part}/checkpoints/ckpt-{stopped:06d} (" in out
    assert "run the same command again" in out
    assert (part / "checkpoints" / f"ckpt-{stopped:06d}" / "manifest.json").exists()
    again = train(job, part, *sets)
    assert f"steps {stopped + 1}..60" in again.stdout
    want = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(full)]
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(part)]
    assert got == want  # no step re-run, none lost, bitwise
    # the run is finished: a further start says so and does nothing
    done = train(job, part, *sets)
    assert "the run is finished" in done.stdout and len(metrics(part)) == 60
    assert "| loss" not in done.stdout and "ratrain: 1" not in done.stdout  # nothing built


def test_two_runs_on_one_directory(job, tmp_path):
    run = tmp_path / "run"
    first = start(job, run, "run.steps=100000", "checkpoint.interval=100")
    first.stdout.readline()  # the banner: the first run holds the directory
    second = train(job, run, "run.steps=100000", check=False)
    assert second.returncode == 2
    assert "is in use by another run (pid" in second.stderr and f"pid {first.pid}" in second.stderr
    first.send_signal(signal.SIGTERM)  # the first run ends its own way, untouched by the second
    out, err = first.communicate(timeout=300)
    assert first.returncode == 75, err
    n = int(out.split("stopped at step ")[1].split()[0])
    assert [r["step"] for r in metrics(run)] == list(range(1, n + 1))
    from ratrain.checkpoint import list_checkpoints, verify_checkpoint

    kept = list_checkpoints(str(run / "checkpoints"))
    assert kept[-1][0] == n and all(verify_checkpoint(p) == [] for _, p in kept)


def test_resume_auto_with_nothing_usable_refuses_and_keeps_the_history(job, tmp_path):
    run = tmp_path / "run"
    train(job, run, "run.steps=4", "checkpoint.interval=2")
    history = (run / "metrics.jsonl").read_text()
    for step in (2, 4):
        os.truncate(run / "checkpoints" / f"ckpt-00000{step}" / "shard-s000.h5", 64)
    p = train(job, run, "run.steps=6", check=False)
    assert p.returncode == 2 and "none usable" in p.stderr and "ckpt-000004" in p.stderr
    assert (run / "metrics.jsonl").read_text() == history
    p = train(job, run, "run.steps=2", "checkpoint.resume=never")  # starting over, explicitly
    recs = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert (run / "metrics.jsonl").read_text().startswith(history)
    assert [r.get("rerun", False) for r in recs if "loss" in r] == [False] * 4 + [True, True]


@pytest.fixture()
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "400k") as mnt:
        yield mnt


def test_a_full_checkpoint_disk_stops_cleanly_without_a_restart_loop(job, tmp_path, small_disk):
    run = tmp_path / "run"
    sets = ["run.steps=8", "checkpoint.interval=2", f"checkpoint.dir={small_disk}/ck"]
    p = train(job, run, *sets, check=False)
    assert p.returncode == 5, p.stdout + p.stderr
    err = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert err[0].startswith("error: no space left on device for the checkpoint of step ")
    from ratrain.checkpoint import list_checkpoints, verify_checkpoint

    kept = list_checkpoints(str(small_disk / "ck"))
    assert kept and all(verify_checkpoint(path) == [] for _, path in kept)
    again = train(job, run, *sets, check=False)  # the restart stops before training
    assert again.returncode == 2 and "\nerror: no space left on device" in again.stderr
    goes_on = train(job, run, *sets, "checkpoint.on_error=continue", check=False)
    assert goes_on.returncode == 0 and "warning: no space left on device" in goes_on.stderr


def test_export_refuses_a_non_empty_directory_and_follows_the_umask(tmp_path, capsys):
    from ratrain.export import main

    job_file = tmp_path / "job.yaml"
    job_file.write_text("model: {vocab_size: 64, hidden: 32, layers: 2, heads: 4, kv_heads: 2, "
                        "ffn_hidden: 64, seq_len: 16}\n")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["--hf", str(out), "--config", str(job_file), "--init"]) == 2
    assert "not empty" in capsys.readouterr().err
    old = os.umask(0o027)
    try:
        assert main(["--hf", str(out), "--config", str(job_file), "--init", "--force"]) == 0
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o640, name
    assert (out / "notes.txt").read_text() == "mine"


def test_prepare_on_an_empty_folder_leaves_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    p = subprocess.run([sys.executable, "-m", "ratrain.data", "prepare", str(tmp_path / "empty"),
                        "--out", str(tmp_path / "out" / "train.bin")], capture_output=True, text=True)
    assert p.returncode == 2 and "nothing to prepare" in p.stderr
    assert not (tmp_path / "out").exists()


def test_checkpoint_show_on_a_file_is_one_line(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text("x")
    p = subprocess.run([sys.executable, "-m", "ratrain.checkpoint", "show", str(f)],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "a file, not a checkpoint directory" in p.stdout


def test_time_limit_stops_with_a_checkpoint(job, tmp_path):
    # train()'s process timeout (300 s) is the bound: a run that ignored its limit would hit it
    p = train(job, tmp_path / "run", "run.steps=100000", "run.time_limit=8", check=False)
    assert p.returncode == 75, p.stderr
    assert "run.time_limit=8" in p.stdout
