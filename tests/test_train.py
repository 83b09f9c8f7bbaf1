"""The trainer end to end on one process: contract files, refusals before work, exact resume."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ratrain.data import write_tokens
from ratrain.exec.backends import kernel_table

TINY = """
model: {vocab_size: 64, hidden: 32, layers: 2, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}
parallel: {micro_batch: 2, num_micro_batches: 2}
optim: {lr: 1.0e-2, warmup_steps: 2}
run: {steps: 4, log_interval: 1, threads: 1}
"""


@pytest.fixture()
def job(tmp_path):
    rng = np.random.default_rng(0)
    tokens = tmp_path / "train.bin"
    write_tokens(tokens, rng.integers(0, 64, 20000), vocab_size=64)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(TINY + f"data: {{tokens: {tokens}}}\n")
    return cfg


def train(cfg, run_dir, *sets, check=True):
    cmd = [sys.executable, "-m", "ratrain.train", "--config", str(cfg), "--set", f"run.dir={run_dir}"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"train failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def test_run_writes_the_contract_files(job, tmp_path):
    run = tmp_path / "run"
    p = train(job, run)
    assert "step     4/4" in p.stdout and "tok/s" in p.stdout
    assert "1 node x 1 rank (pp)" in p.stdout  # the banner names the nodes and the placement
    # and the kernel table (exec.backends) the rank chose
    assert kernel_table().describe() in p.stdout and ", attention tiled-64, " in p.stdout
    recs = metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for key in ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped", "tokens", "step_time_s",
                "tokens_per_s", "peak_ddr_bytes"):
        assert key in recs[0]
    assert all(np.isfinite(r["loss"]) for r in recs)
    assert recs[0]["loss"] == pytest.approx(np.log(64), rel=0.05)  # random init: ~uniform
    assert recs[0]["tokens"] == 2 * 2 * 16 and recs[0]["peak_ddr_bytes"] > 0
    assert "model:" in (run / "config.yaml").read_text()


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["model.heads=3"], "model.heads=3 does not divide model.hidden=32"),
        (["model.seq_len=100000"], "seq_len"),
        (["data.tokens=/nonexistent/x.bin"], "/nonexistent/x.bin"),
        (["model.vocab_size=32"], "vocab"),
        (["parallel.pp=2"], "world size 1 != parallel.pp x parallel.dp"),
        (["checkpoint.resume=/nonexistent/ckpt"], "/nonexistent/ckpt"),
        (["run.attention=cudnn", "precision=bf16"], "run.attention=cudnn runs on a GPU rank"),
    ],
)
def test_bad_input_is_refused_before_any_work(job, tmp_path, sets, needle):
    run = tmp_path / "run"
    p = train(job, run, *sets, check=False)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr
    assert "Traceback" not in p.stderr
    assert not run.exists()


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_resume_is_bitwise_exact(job, tmp_path, precision):
    full, part = tmp_path / "full", tmp_path / "part"
    train(job, full, f"precision={precision}", "run.steps=6")
    train(job, part, f"precision={precision}", "run.steps=3", "checkpoint.interval=3")
    train(job, part, f"precision={precision}", "run.steps=6", "checkpoint.interval=3")
    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"], (ra, rb)
