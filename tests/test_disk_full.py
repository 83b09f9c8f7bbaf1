"""A full disk under run.dir, wherever the run meets it (metrics, status, checkpoints): one line
naming what could not be written, where and the key that moves it, exit 5, no traceback, no torn
line, status.json saying so, the last committed checkpoint intact. The disk is a small tmpfs
(root), filled to a few pages from full."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ratrain.data import write_tokens
from ratrain.fileio import append_whole
from tests._prereq import tmpfs

JOB = ("model: {vocab_size: 64, hidden: 32, layers: 2, heads: 4, kv_heads: 2, ffn_hidden: 64, "
       "seq_len: 16}\nparallel: {micro_batch: 2, num_micro_batches: 2}\n"
       "run: {log_interval: 1000, threads: 1}\ndata: {tokens: TOKENS, eval_interval: 0}\n")
PAGE = 4096


@pytest.fixture()
def disk(tmp_path):
    with tmpfs(tmp_path / "disk", "4m") as mnt:
        yield mnt


def fill(mnt, pages_left: int):
    """Fill the disk, then give back `pages_left` pages."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while os.write(fd, b"\0" * PAGE) == PAGE:
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    size = filler.stat().st_size // PAGE * PAGE
    os.truncate(filler, max(0, size - pages_left * PAGE))


def _train(tmp_path, run_dir, *sets):
    tokens = tmp_path / "train.bin"
    if not tokens.exists():
        write_tokens(tokens, np.random.default_rng(0).integers(0, 64, 4000), vocab_size=64)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(JOB.replace("TOKENS", str(tokens)))
    cmd = [sys.executable, "-m", "ratrain.train", "--config", str(cfg), "--set",
           f"run.dir={run_dir}"] + [a for s in sets for a in ("--set", s)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _whole_lines(path):
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n")
    return [json.loads(x) for x in raw.splitlines()]


def test_metrics_on_a_full_disk_stop_with_one_line_and_whole_records(tmp_path, disk):
    run = disk / "run"
    first = _train(tmp_path, run, "run.steps=2")  # the directory, config and status exist
    assert first.returncode == 0, first.stderr
    fill(disk, 2)  # config.yaml rewritten (a page, then one freed), metrics.jsonl fills the rest
    p = _train(tmp_path, run, "run.steps=100000", "checkpoint.resume=never")
    assert p.returncode == 5, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr
    assert err[0].startswith(f"error: cannot write run.dir={run} (No space left on device: "
                             f"{run}/metrics.jsonl)") and "set run.dir to" in err[0]
    recs = _whole_lines(run / "metrics.jsonl")  # nothing torn
    status = json.loads((run / "status.json").read_text())
    assert status["exit"] == 5 and status["state"] == "write failed"
    assert "No space left on device" in status["why"] and status["step"] == recs[-1]["step"] + 1


def test_a_disk_that_fills_while_checkpointing_under_run_dir_records_why(tmp_path, disk):
    run = disk / "run"
    tokens_run = _train(tmp_path, tmp_path / "warm", "run.steps=1")  # the token file, elsewhere
    assert tokens_run.returncode == 0
    cmd_sets = ["run.steps=100000", "checkpoint.interval=2", "checkpoint.keep=100"]
    p = subprocess.Popen([sys.executable, "-m", "ratrain.train", "--config",
                          str(tmp_path / "job.yaml"), "--set", f"run.dir={run}"]
                         + [a for s in cmd_sets for a in ("--set", s)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = run / "checkpoints" / "ckpt-000002" / "manifest.json"
    while not first.exists():
        assert p.poll() is None, p.communicate()
    fill(disk, 0)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 5, out + err
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and ("no space left on device for the checkpoint of step" in line[0]
                               or "No space left on device: " in line[0]), err
    status = json.loads((run / "status.json").read_text())
    assert status["exit"] == 5 and status["state"] in ("checkpoint failed", "write failed")
    assert "space" in status["why"]
    _whole_lines(run / "metrics.jsonl")
    from ratrain.checkpoint import list_checkpoints, verify_checkpoint

    kept = list_checkpoints(str(run / "checkpoints"))
    assert kept and all(verify_checkpoint(path) == [] for _, path in kept)


def test_a_record_cut_short_is_cut_back_off(tmp_path, monkeypatch):
    log = tmp_path / "log"
    log.write_bytes(b'{"step": 1}\n')
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    real = os.write

    def short(fd_, data):  # half of it lands, then the disk is full
        if len(data) > 4:
            return real(fd_, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", short)
    with pytest.raises(OSError):
        append_whole(fd, b'{"step": 2, "loss": 1.0}\n')
    monkeypatch.setattr(os, "write", real)
    os.close(fd)
    assert log.read_bytes() == b'{"step": 1}\n'
