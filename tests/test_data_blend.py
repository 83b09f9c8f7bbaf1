"""Mixtures (data.sources): Megatron-LM's blending rule (against a transcription of its
build_blending_indices written here), the realised shares, random access by step from any
known point, what a checkpoint records, per-source eval losses, and a run stopped at a random
step resuming bitwise equal to the uninterrupted one (1 x 1 here; pp 2 x dp 2 in
test_data_mpi.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ratrain import data as D
from ratrain.config import config_from_dict
from ratrain.data import blend as B


def megatron_blending(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-LM's build_blending_indices (megatron/core/datasets/helpers.cpp), transcribed:
    (dataset index, sample index within it) of each of `size` samples."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()  # BlendedMegatronDatasetConfig normalises the weights
    current = [0] * len(w)
    d_idx, s_idx = np.zeros(size, np.int16), np.zeros(size, np.int64)
    for sample in range(size):
        x = max(float(sample), 1.0)
        max_error_index, max_error = 0, w[0] * x - current[0]
        for d in range(1, len(w)):
            error = w[d] * x - current[d]
            if error > max_error:
                max_error, max_error_index = error, d
        d_idx[sample], s_idx[sample] = max_error_index, current[max_error_index]
        current[max_error_index] += 1
    return d_idx, s_idx


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [3, 1], [1, 1, 1, 1, 7], [0.1, 0.9]])
def test_the_rule_is_megatrons(weights):
    src, pos, counts = B.blend(B.normalise(weights), [0] * len(weights), 0, 4000)
    d, s = megatron_blending(weights, 4000)
    assert np.array_equal(src, d) and np.array_equal(pos, s)
    assert counts == np.bincount(d, minlength=len(weights)).tolist()


def sources(tmp_path: Path, n: int = 3, sizes=(3000, 5000, 4000)) -> list[Path]:
    """`n` token files whose ids tell them apart: source d holds ids 20d .. 20d + 19."""
    out = []
    for d in range(n):
        path = tmp_path / f"s{d}" / "train.bin"
        D.write_tokens(path, 20 * d + np.arange(sizes[d]) % 20, 64)
        D.write_tokens(path.parent / "val.bin", 20 * d + np.arange(400) % 20, 64)
        out.append(path)
    return out


def mixture(paths, weights, **parallel):
    cfg = config_from_dict({
        "model": {"vocab_size": 64, "seq_len": 7},
        "parallel": {"micro_batch": 4, "num_micro_batches": 5, **parallel},
        "data": {"order": "shuffled", "seed": 3,
                 "sources": [{"tokens": str(p), "weight": w} for p, w in zip(paths, weights)]}})
    return cfg, D.open_datasets(cfg, D.check_data(cfg))[0]


def test_three_sources_get_their_shares_within_one_percent(tmp_path):
    weights = [0.6, 0.3, 0.1]
    _, ds = mixture(sources(tmp_path), weights)
    steps = 10_000 // ds.layout.global_batch
    firsts = np.concatenate([ds.batch_for_step(s)[0][..., 0].ravel() for s in range(steps)])
    share = np.bincount(firsts // 20, minlength=3) / len(firsts)
    assert len(firsts) == 10_000 and np.abs(share - weights).max() < 0.01, share
    assert ds.state_dict(steps)["counts"] == np.bincount(firsts // 20).tolist()


def test_any_step_from_any_known_point_on_any_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "ANCHOR", 37)  # many kept points, none on a step's edge
    paths = sources(tmp_path)
    cfg, one = mixture(paths, [2, 1, 1])
    _, two = mixture(paths, [2, 1, 1], dp=2, micro_batch=2)  # the same 20 windows a step
    want = [one.batch_for_step(s) for s in range(30)]  # in order
    for s in random.Random(0).sample(range(30), 30):  # in any order, fresh counts each time
        fresh = mixture(paths, [2, 1, 1])[1]
        assert all(np.array_equal(a, b) for a, b in zip(fresh.batch_for_step(s), want[s]))
        halves = [two.batch_for_step(s, r)[0].reshape(-1, 7) for r in range(2)]
        assert np.array_equal(np.concatenate(halves), want[s][0].reshape(-1, 7))
    # a resumed run starts from the checkpoint's counts, and reads what the first run read
    state = json.loads(json.dumps(one.state_dict(23)))
    resumed = mixture(paths, [2, 1, 1])[1]
    resumed.load_state_dict(state)
    assert 23 * one.layout.global_batch in resumed._anchors
    assert np.array_equal(resumed.batch_for_step(23)[0], want[23][0])
    with pytest.raises(D.DataError, match="not one this mixture reaches"):
        resumed.load_state_dict({**state, "counts": [state["position"], 0, 0]})


def test_a_changed_mixture_is_noticed(tmp_path):
    paths = sources(tmp_path)
    _, ds = mixture(paths, [2, 1, 1])
    saved = json.loads(json.dumps(ds.state_dict(5)))
    assert D.data_resume_problem(saved, ds) == ""
    assert "source 0's share was 0.5 and is now 0.6" in D.data_resume_problem(
        saved, mixture(paths, [3, 1, 1])[1])
    assert "the mixture had 3 sources and has 2" in D.data_resume_problem(
        saved, mixture(paths[:2], [2, 1])[1])
    D.write_tokens(paths[1], 20 + np.arange(5000) % 19, 64)  # same size, other tokens
    assert "source 1's tokens changed" in D.data_resume_problem(saved, mixture(paths, [2, 1, 1])[1])
    single = D.TokenDataset(paths[0], 7, 64)
    assert "trained on a mixture (data.sources) and this run is not" in D.data_resume_problem(
        saved, single)
    assert D.data_resume_problem(single.state_dict(5), single) == ""


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------

JOB = """model: {vocab_size: 64, hidden: 32, layers: 2, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 7}
parallel: {micro_batch: 2, num_micro_batches: 2}
optim: {lr: 1.0e-2, warmup_steps: 2, decay_steps: 4}  # not run.steps: stops change no lr
run: {steps: 6, log_interval: 1, threads: 1}
"""


def train(job: Path, run: Path, *sets) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ratrain.train", "--config", str(job), "--set", f"run.dir={run}"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def records(run: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run / name).read_text().splitlines()]


def test_a_mixture_stopped_at_a_random_step_resumes_bitwise(tmp_path):
    paths = sources(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(JOB + "data: {order: shuffled, eval_interval: 3, eval_batches: 1, sources: ["
                   + ", ".join(f"{{tokens: {p}, weight: {w}}}" for p, w in zip(paths, (5, 3, 2)))
                   + "]}\n")
    full = train(job, tmp_path / "full")
    assert full.returncode == 0, full.stderr
    k = random.randint(1, 5)
    part = ("checkpoint.resume=auto", f"checkpoint.interval={k}")
    first = train(job, tmp_path / "part", *part, f"run.steps={k}")
    assert first.returncode == 0, first.stderr
    then = train(job, tmp_path / "part", *part)
    assert then.returncode == 0, then.stderr

    def losses(run):
        return [(r["loss"], r["grad_norm"]) for r in records(run, "metrics.jsonl") if "loss" in r]

    assert losses(tmp_path / "part") == losses(tmp_path / "full"), f"stopped at step {k}"
    ev = records(tmp_path / "full", "eval.jsonl")
    assert [r["step"] for r in ev] == [3, 6]
    each = [ev[0][f"eval_loss/s{d}"] for d in range(3)]
    assert ev[0]["eval_loss"] == pytest.approx(0.5 * each[0] + 0.3 * each[1] + 0.2 * each[2])
    assert len(set(each)) == 3 and "| s0 " in full.stdout
    # the mixture changed: the checkpoint's data position would not continue it
    job.write_text(job.read_text().replace("weight: 5", "weight: 4"))
    refused = train(job, tmp_path / "part", *part, "run.steps=8")
    err = refused.stderr.splitlines()
    assert refused.returncode == 2 and err[-1].startswith("error: checkpoint "), refused.stderr
    assert "cannot continue this run's data: source 0's share was 0.5 and is now" in err[-1]
    assert sum("error" in line for line in err) == 1
