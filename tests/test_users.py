"""What a user touches: the config's conveniences, data with end-of-text ids and a recorded
tokenizer, eval / generate / the Python API on a trained run, train's --print-config and
--dry-run, resume with nothing to do, metrics and eval files, the `ratrain` command, and help
on every flag of every command."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ratrain import api
from ratrain.config import ConfigError, load_config, shipped_jobs
from ratrain.data import DataError, prepare, read_meta, write_tokens
from ratrain.data.rundata import DataPaths
from ratrain.data.runtokenizer import record_tokenizer
from tests._tokenizer_util import make_bpe

ROOT = Path(__file__).resolve().parents[1]
TINY = """
model: {vocab_size: 256, hidden: 32, layers: 2, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}
parallel: {micro_batch: 2, num_micro_batches: 2}
optim: {lr: 1.0e-2, warmup_steps: 2}
checkpoint: {interval: 3, resume: auto}
run: {steps: 6, log_interval: 1, threads: 1}
"""


def run(*argv, check=True, cwd=None):
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                       cwd=cwd, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if check and p.returncode != 0:
        raise AssertionError(f"{argv} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run of 6 steps with an eval and a checkpoint every 3 (one subprocess)."""
    d = tmp_path_factory.mktemp("trained")
    rng = np.random.default_rng(0)
    write_tokens(d / "train.bin", rng.integers(97, 123, 20000), vocab_size=256)  # a..z
    write_tokens(d / "val.bin", rng.integers(97, 123, 4000), vocab_size=256)
    (d / "job.yaml").write_text(TINY + f"data: {{tokens: {d}/train.bin, eval_interval: 3, "
                                "eval_batches: 2}\n")
    p = run("-m", "ratrain.train", "--config", str(d / "job.yaml"), "--set", f"run.dir={d}/run")
    return d, p.stdout


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------


def test_set_takes_a_glob_and_a_shipped_job_by_name():
    cfg = load_config("tiny", ["optim.no_decay=*norm*"])
    assert cfg.optim.no_decay == ("*norm*",) and cfg.model.layers == 8
    cfg = load_config(str(ROOT / "jobs" / "tiny.yaml"), ["optim.no_decay=embed.*,*norm*"])
    assert cfg.optim.no_decay == ("embed.*", "*norm*")
    assert {"tiny", "llama2-7b", "correctness"} <= set(shipped_jobs())
    with pytest.raises(ConfigError, match="does not exist.*shipped jobs: .*tiny"):
        load_config("no-such-job")


def test_glob_on_the_command_line_is_no_traceback(tmp_path):
    p = run("-m", "ratrain.train", "--config", "tiny", "--set", "optim.no_decay=*norm*",
            "--print-config")
    assert "- '*norm*'" in p.stdout and p.stderr == ""


# --------------------------------------------------------------------------------------------
# data: end of text, the tokenizer recorded
# --------------------------------------------------------------------------------------------


def test_byte_prepare_separates_documents_only_when_asked(tmp_path):
    for name, text in (("a.txt", "first doc"), ("b.txt", "second")):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / name).write_text(text)
    prepare([str(tmp_path / "in")], tmp_path / "plain.bin", val_fraction=0.0)
    assert 0 not in np.fromfile(tmp_path / "plain.bin", "<u2")
    assert read_meta(tmp_path / "plain.bin")["eot"] is None
    prepare([str(tmp_path / "in")], tmp_path / "eot.bin", val_fraction=0.0, eot="0")
    ids = np.fromfile(tmp_path / "eot.bin", "<u2")
    assert list(np.flatnonzero(ids == 0)) == [9, 16]  # after "first doc" and after "second"
    assert read_meta(tmp_path / "eot.bin")["eot"] == 0
    with pytest.raises(DataError, match="outside the vocabulary"):
        prepare([str(tmp_path / "in")], tmp_path / "x.bin", eot="300")


@pytest.fixture()
def bpe(tmp_path):
    return make_bpe(tmp_path)


def test_tokenizer_prepare_ends_documents_and_is_recorded(bpe, tmp_path):
    path, docs = bpe
    res = prepare([str(docs)], tmp_path / "d" / "train.bin", tokenizer=str(path),
                  val_fraction=0.0)
    meta = read_meta(res.train)
    eot = meta["eot"]
    ids = np.fromfile(res.train, "<u2")
    assert eot is not None and int((ids == eot).sum()) == res.documents == 5
    assert ids[-1] == eot
    assert meta["tokenizer_path"] == str(path.resolve()) and len(meta["tokenizer_sha256"]) == 64
    cfg = load_config(None, [f"data.tokens={res.train}", "model.vocab_size=512"])
    rec = record_tokenizer(cfg, DataPaths(res.train, None))
    assert rec.data.tokenizer == str(path.resolve())
    assert rec.data.tokenizer_sha256 == meta["tokenizer_sha256"]
    with pytest.raises(DataError, match="not the tokenizer"):
        record_tokenizer(load_config(None, ["data.tokenizer=byte"]), DataPaths(res.train, None))
    with pytest.raises(DataError, match="the file changed"):
        record_tokenizer(load_config(None, ["data.tokenizer_sha256=" + "0" * 64]),
                         DataPaths(res.train, None))


def test_vocab_error_under_from_hf_names_a_fix_that_applies(tmp_path):
    from ratrain.config import ModelConfig
    from ratrain.data import TokenDataset
    from ratrain.exec.spec import init_param, model_blocks
    from ratrain.hf import export_hf

    m = ModelConfig(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn_hidden=64,
                    seq_len=16)
    hf = export_hf({p.name: init_param(p, 0) for b in model_blocks(m) for p in b.params}, m,
                   str(tmp_path / "hf"))
    write_tokens(tmp_path / "t.bin", np.arange(2000) % 1000, vocab_size=1000)
    cfg = load_config(None, [f"init.from_hf={hf}", "model.vocab_size=64", "model.seq_len=16"])
    with pytest.raises(DataError, match="init.from_hf=.*model.vocab_size does not apply"):
        TokenDataset.from_config(cfg, tmp_path / "t.bin")
    # a --set model.* that contradicts config.json: both values, before any work
    (tmp_path / "job.yaml").write_text(f"init: {{from_hf: {hf}}}\nmodel: {{seq_len: 8}}\n")
    p = run("-m", "ratrain.train", "--config", str(tmp_path / "job.yaml"), "--set",
            "model.hidden=64", "--print-config", check=False)
    assert p.returncode == 2
    assert "--set model.hidden=64 contradicts init.from_hf" in p.stderr and "hidden=32" in p.stderr
    p = run("-m", "ratrain.train", "--config", str(tmp_path / "job.yaml"), "--print-config")
    assert "hidden: 32" in p.stdout and "max_positions: 16" in p.stdout


# --------------------------------------------------------------------------------------------
# a trained run: files, eval, generate, the API
# --------------------------------------------------------------------------------------------


def test_run_files_keep_one_type_per_field(trained):
    d, out = trained
    recs = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for key in recs[0]:
        assert {type(r[key]) for r in recs} == {type(recs[0][key])}, key
    assert all(0 < r["mfu"] < 1 and r["elapsed_s"] > 0 for r in recs)
    evals = [json.loads(line) for line in open(d / "run" / "eval.jsonl")]
    assert [e["step"] for e in evals] == [3, 6]
    assert evals[0]["eval_ppl"] == pytest.approx(math.exp(evals[0]["eval_loss"]))
    assert "MFU" in out and "elapsed" in out
    assert out.count("checkpoint saved:") == 2 and "ckpt-000006" in out
    assert "tokenizer byte" in out  # the banner names the tokenizer the sidecar records
    cfg = load_config(str(d / "run" / "config.yaml"))
    assert cfg.data.tokenizer == "byte"


def test_resume_with_nothing_to_do_says_so(trained):
    d, _ = trained
    p = run("-m", "ratrain.train", "--config", str(d / "job.yaml"), "--set", f"run.dir={d}/run",
            "--set", "run.steps=3")
    assert "nothing to do: resumed at step 6" in p.stdout and "run.steps=3" in p.stdout
    assert len(open(d / "run" / "metrics.jsonl").readlines()) == 6  # untouched


def test_eval_command_gives_the_training_eval_loss(trained, capsys):
    from ratrain.eval import main

    d, _ = trained
    evals = [json.loads(line) for line in open(d / "run" / "eval.jsonl")]
    for ckpt, logged in ((d / "run" / "checkpoints", evals[1]), (
            d / "run" / "checkpoints" / "ckpt-000003", evals[0])):
        assert main(["--checkpoint", str(ckpt), "--json"]) == 0
        rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rec["step"] == logged["step"]
        assert rec["loss"] == logged["eval_loss"]  # bitwise: the same batches, the same layout
    assert main(["--checkpoint", str(d / "run" / "checkpoints"), "--batches", "all",
                 "--tokens", str(d / "val.bin")]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["--checkpoint", str(d / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_api_logits_loss_and_generation(trained):
    d, _ = trained
    with api.load(str(d / "run" / "checkpoints")) as model:
        assert model.step == 6 and model.vocab_size == 256
        ids = np.random.default_rng(1).integers(0, 256, (2, 17))
        z = model.logits(ids[:, :-1])  # (2, 16, 256)
        assert z.shape == (2, 16, 256) and z.dtype == np.float32
        lse = np.log(np.exp(z.astype(np.float64)).sum(-1))
        ce = (lse - np.take_along_axis(z, ids[:, 1:, None], -1)[..., 0]).mean()
        assert model.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(ce, rel=1e-5)
        np.testing.assert_allclose(model.logits(ids[:, :-1], last_only=True), z[:, -1],
                                   rtol=1e-5, atol=1e-5)
        greedy = model.generate([1, 2, 3], 10, temperature=0)
        assert len(greedy) == 13 and greedy[:3] == [1, 2, 3]
        assert model.generate([1, 2, 3], 10, temperature=0) == greedy
        assert model.generate([1, 2, 3], 10, top_k=1, seed=5) == greedy  # top-1 is greedy
        assert model.generate([1, 2, 3], 10, top_p=1e-6, seed=5) == greedy
        a = model.generate([1, 2, 3], 10, temperature=2.0, seed=1)
        assert a == model.generate([1, 2, 3], 10, temperature=2.0, seed=1)  # seeded
        long = model.generate(list(range(20)), 3, temperature=0)  # longer than seq_len: cropped
        assert len(long) == 23
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.logits([[256]])


def test_a_damaged_checkpoint_is_refused_by_eval_generate_and_the_api(trained, tmp_path,
                                                                     capsys):
    """One flipped byte in a shard's data: the shard's SHA-256 no longer matches, and every
    reader of model weights refuses in one line (exit 2) before reading a weight."""
    import shutil

    d, _ = trained
    ckpt = tmp_path / "ckpt-000006"
    shutil.copytree(d / "run" / "checkpoints" / "ckpt-000006", ckpt)
    shard = ckpt / "shard-s000.h5"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    from ratrain.eval import main

    assert main(["--checkpoint", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "damaged checkpoint" in err[0] and "shard-s000.h5" in err[0], err
    p = run("-m", "ratrain.generate", "--checkpoint", str(ckpt), "--prompt", "ab", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "damaged checkpoint" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="damaged checkpoint, not loaded: .*shard-s000.h5"):
        api.load(str(ckpt))


def test_sample_filters():
    z = np.array([0.0, 5.0, 4.0, -1.0])
    rng = np.random.default_rng(0)
    draws = {api.sample(z, 1.0, top_k=2, rng=rng) for _ in range(200)}
    assert draws == {1, 2}
    assert {api.sample(z, 1.0, top_p=0.5, rng=rng) for _ in range(50)} == {1}
    with pytest.raises(ValueError):
        api.sample(z, 0.0)


def test_generate_command(trained):
    d, _ = trained
    p = run("-m", "ratrain.generate", "--checkpoint", str(d / "run" / "checkpoints"), "--prompt",
            "ab", "--greedy", "--max-new-tokens", "5")
    assert p.stdout.startswith("ab") and len(p.stdout.rstrip("\n")) == 7
    p = run("-m", "ratrain.generate", "--checkpoint", str(d / "run" / "checkpoints"), "--prompt",
            "ab", "--top-p", "2", check=False)
    assert p.returncode == 2 and "--top-p=2.0 must be in (0, 1]" in p.stderr


# --------------------------------------------------------------------------------------------
# train --print-config / --dry-run
# --------------------------------------------------------------------------------------------


def test_print_config_and_dry_run(trained):
    d, _ = trained
    job = str(d / "job.yaml")
    p = run("-m", "ratrain.train", "--config", job, "--print-config")
    assert load_config(None).__class__  # a YAML config comes out
    assert "micro_batch: 2" in p.stdout and "threads: 1" in p.stdout
    p = run("-m", "ratrain.train", "--config", job, "--dry-run", "--set", f"run.dir={d}/dry")
    assert "memory plan" in p.stdout and "fits" in p.stdout and "nothing trained" in p.stdout
    assert not (d / "dry").exists()
    p = run("-m", "ratrain.train", "--config", job, "--dry-run", "--set", f"run.dir={d}/dry",
            "--set", "platform.ddr_bytes=100000", check=False)
    assert p.returncode == 2 and "over the DDR cap" in p.stderr and "OVER THE CAP" in p.stdout


# --------------------------------------------------------------------------------------------
# the `ratrain` command and the commands' help
# --------------------------------------------------------------------------------------------


def test_ratrain_command_runs_every_entry_point(trained):
    import importlib.util

    from ratrain.__main__ import COMMANDS, main

    for name, (module, _) in COMMANDS.items():
        assert importlib.util.find_spec(module) is not None, name
    assert main([]) == 2 and main(["--help"]) == 0 and main(["nope"]) == 2
    assert main(["jobs"]) == 0
    d, _ = trained
    p = run("-m", "ratrain", "checkpoint", "show", str(d / "run" / "checkpoints"))
    assert "ckpt-000006" in p.stdout
    p = run("-m", "ratrain", "train", "--config", "tiny", "--print-config")
    assert "layers: 8" in p.stdout
    assert run("-m", "ratrain", "eval", "--checkpoint", "/nonexistent", check=False).returncode == 2


class _Parsed(Exception):
    pass


def _parsers(main, argv, monkeypatch):
    """Every parser (and sub-parser) a command's main builds, captured at parse time."""
    seen = []

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed):
        main(argv)
    out = []
    for ap in seen:
        out.append(ap)
        for act in ap._actions:
            if isinstance(act, argparse._SubParsersAction):
                out += list(act.choices.values())
    return out


@pytest.mark.parametrize("module", [m for m, _ in __import__(
    "ratrain.__main__", fromlist=["COMMANDS"]).COMMANDS.values()])
def test_every_flag_has_help(module, monkeypatch):
    import importlib

    mod = importlib.import_module(module if module not in ("ratrain.data", "ratrain.checkpoint",
                                                           "ratrain.plan")
                                  else module + ".__main__")
    parsers = _parsers(mod.main, [], monkeypatch)
    assert parsers
    for ap in parsers:
        assert ap.description or ap.prog.count(" ") > 2, f"{ap.prog}: no description"
        for act in ap._actions:
            if isinstance(act, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert act.help, f"{ap.prog}: {act.option_strings or act.dest} has no help"


def test_comm_bench_refuses_one_rank(capsys):
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("one process only")
    from ratrain.comm import bench

    assert bench.main(["--op", "allreduce", "--sizes", "8"]) == 2
    assert "mpirun -n 2" in capsys.readouterr().err


def test_threads_follow_the_launchers_cores(monkeypatch):
    from ratrain.runtime import rank

    cfg = load_config(None)
    monkeypatch.setattr(rank, "_affinity", lambda: set(range(12)))
    assert rank.local_threads(cfg) == 12
    assert rank.local_threads(load_config(None, ["run.threads=3"])) == 3


def test_tensorboard_logs_through_tensorboardx(tmp_path, monkeypatch):
    import types

    from ratrain.job import tblog

    logged = []

    class Writer:
        def __init__(self, logdir):
            logged.append(("dir", logdir))

        def add_scalar(self, tag, value, step):
            logged.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=Writer))
    tblog.check()
    tb = tblog.TensorBoard(str(tmp_path))
    tb.log({"step": 3, "loss": 2.5, "skipped": False, "tokens": 64}, "train")
    assert ("train/loss", 2.5, 3) in logged and ("train/tokens", 64, 3) in logged
    assert not any(t[0] == "train/skipped" for t in logged)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ValueError, match="ratrain\\[tensorboard\\]"):
        tblog.check()
