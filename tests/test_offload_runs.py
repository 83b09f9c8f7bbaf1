"""Runs with the memory tier through `python -m ratrain.train`: checkpoints resume bitwise with or
without the tier, and the tier's faults end a run in one line naming the path and the key (exit
2 before any work, 5 during the run)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ratrain.data import write_tokens
from tests._prereq import tmpfs

JOB = ("model: {vocab_size: 64, hidden: 32, layers: 2, heads: 4, kv_heads: 2, ffn_hidden: 64, "
       "seq_len: 16}\nparallel: {micro_batch: 2, num_micro_batches: 2}\nprecision: fp16\n"
       "run: {log_interval: 1000, threads: 1}\ndata: {tokens: TOKENS, eval_interval: 0}\n"
       "checkpoint: {interval: 2}\n")
TIER = ["offload.activations=all", "offload.optimizer=masters"]
FAIL_AT = """
import errno, sys
from ratrain.shim import tierstore
move, calls = tierstore.TierStore._move, [0]
def failing(self, pairs):
    calls[0] += 1
    if calls[0] > {n}:
        raise OSError(errno.ENOSPC, "No space left on device")
    return move(self, pairs)
tierstore.TierStore._move = failing
from ratrain.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture()
def job(tmp_path):
    tokens = tmp_path / "train.bin"
    write_tokens(tokens, np.random.default_rng(0).integers(0, 64, 4000), vocab_size=64)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(JOB.replace("TOKENS", str(tokens)))
    return cfg


def run(job, run_dir, *sets, program=None):
    head = [sys.executable, "-c", program] if program else [sys.executable, "-m", "ratrain.train"]
    cmd = head + ["--config", str(job), "--set", f"run.dir={run_dir}"]
    cmd += [a for s in sets for a in ("--set", s)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(ckpt):
    import h5py

    out = {}
    for shard in sorted(ckpt.glob("*.h5")):
        with h5py.File(shard, "r") as f:
            f.visititems(lambda n, d: out.setdefault(n, d[()].tobytes())
                         if isinstance(d, h5py.Dataset) else None)
    return out


def test_checkpoints_resume_bitwise_with_or_without_the_tier(job, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for first, then, d in ((TIER, [], a), ([], TIER, b)):  # the tier on the first leg or on the resume
        p = run(job, d, "run.steps=2", *first)
        assert p.returncode == 0, p.stderr
        p = run(job, d, "run.steps=3", *then)
        assert p.returncode == 0, p.stderr
        assert not (d / "tier").exists()  # the tier's directory goes with the run
    assert losses(a) == losses(b) and len(losses(a)) == 3
    for step in ("ckpt-000002", "ckpt-000003"):
        assert weights(a / "checkpoints" / step) == weights(b / "checkpoints" / step)


def test_a_tier_that_fails_during_the_run_ends_it_in_one_line_exit_5(job, tmp_path):
    d = tmp_path / "run"
    p = run(job, d, "run.steps=4", "checkpoint.interval=0", *TIER,
            program=FAIL_AT.format(n=40))  # a step has 13 transfers: past the first step
    assert p.returncode == 5, p.stdout + p.stderr
    err = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr
    assert err[0].startswith(f"error: the memory tier at offload.path={d}/tier failed (No space "
                             "left on device)"), err[0]
    status = json.loads((d / "status.json").read_text())
    assert status["exit"] == 5 and status["why"].startswith("the memory tier")


def test_a_tier_without_room_is_refused_at_start_up(tmp_path):
    """Start-up's check (`train.startup.check_tier`, which `agree` turns into one line and exit
    2 before any work, as every start-up check): the storage's free space against the tier
    bytes the memory plan predicts for the node's ranks."""
    from dataclasses import replace

    from ratrain.config import OffloadConfig
    from ratrain.train.startup import check_tier
    from tests._executor_util import tiny_config

    with tmpfs(tmp_path / "disk", "64k") as disk:
        cfg = replace(tiny_config(precision="fp16"), offload=OffloadConfig(
            activations="all", optimizer="masters", path=str(disk)))
        with pytest.raises(OSError, match=rf"^the memory tier at offload.path={disk} has 64.0 "
                                          r"KiB free, the 1 rank\(s\) of this node need about"):
            check_tier(cfg, 0)
        assert list(disk.iterdir()) == []
