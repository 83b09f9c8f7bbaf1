"""Every bad input of the data path is one line, exit 2, nothing damaged: bad records (file and
line; --on-bad-record skip counts them), a missing field or column, text that is not UTF-8, an
empty corpus, what an interrupted prepare leaves behind, and token files the trainer refuses (an
index of the wrong magic, version or dtype code, a .bin of the wrong size, ids outside the
vocabulary)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ratrain import data as D
from ratrain.config import config_from_dict
from ratrain.data.__main__ import main as data_main
from ratrain.data.tokens import write_meta
from tests._prereq import need


def prepare_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = data_main(["prepare", *map(str, argv), "--quiet"])
    out, err = capsys.readouterr()
    return rc, out, err


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())} if d.exists() else {}


@pytest.fixture()
def good(tmp_path):
    """A folder holding a finished prepare (its files must survive every failed rerun)."""
    src = tmp_path / "good.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(20)))
    out = tmp_path / "out"
    D.prepare([str(src)], out=out)
    return out, files(out)


def jsonl(path: Path, *records) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
                              for r in records))
    return path


def _prepared(d: Path, name: str) -> Path:
    """A corpus prepared in d/tok; returns d/tok/NAME (its train.bin, train.idx, ... or tok)."""
    D.prepare([str(jsonl(d / "src.jsonl", *({"text": f"doc {i} " * 9} for i in range(9))))],
              out=d / "tok", val_fraction=0.0)
    return d / "tok" / name


CASES = {
    "malformed line": (lambda d: jsonl(d / "a.jsonl", {"text": "x"}, {"text": "y"}, b'{"text": "z"',
                                       {"text": "w"}), ["a.jsonl:3: not JSON"]),
    "not an object": (lambda d: jsonl(d / "a.jsonl", {"text": "x"}, [1, 2]),
                      ["a.jsonl:2: a JSON list, not an object"]),
    "missing field": (lambda d: jsonl(d / "a.jsonl", {"text": "x"}, {"body": "y"}),
                      ["a.jsonl:2: no field 'text' (fields: body)", "--field NAME"]),
    "not a string": (lambda d: jsonl(d / "a.jsonl", {"text": 3}),
                     ["a.jsonl:1: field 'text' is int, not a string"]),
    "jsonl not utf-8": (lambda d: jsonl(d / "a.jsonl", {"text": "x"}, b'{"text": "caf\xe9"}'),
                        ["a.jsonl:2: not UTF-8 text (invalid continuation byte at byte 13)"]),
    "text not utf-8": (lambda d: (d / "a.txt").write_bytes(b"ok\xff\xfe") and d / "a.txt",
                       ["a.txt' is not UTF-8 text", "convert it to UTF-8"]),
    "empty corpus": (lambda d: jsonl(d / "a.jsonl"), ["gave no documents with text"]),
    "only empty texts": (lambda d: jsonl(d / "a.jsonl", {"text": ""}, {"text": ""}),
                         ["gave no documents with text"]),
    "missing input": (lambda d: d / "nope.jsonl", ["'", "nope.jsonl' does not exist"]),
    "a prepared token file": (lambda d: _prepared(d, "train.bin"),
                              ["train.bin' is a prepared token file", "data.tokens"]),
    "its index": (lambda d: _prepared(d, "train.idx"), ["train.idx' is a prepared token file"]),
    "a folder holding one": (lambda d: _prepared(d, ""), ["is a prepared token file",
                                                          "leave it out of the inputs"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_damages_nothing(tmp_path, capsys, good, case):
    make, words = CASES[case]
    out, before = good
    path = make(tmp_path)
    rc, _, err = prepare_cli(capsys, path, "--out", out)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    assert files(out) == before  # the earlier prepare is untouched, no temporary is left


def test_a_parquet_file_without_the_column(tmp_path, capsys, good):
    pa, pq = need("pyarrow", "the data extra"), need("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["a", "b"], "n": [1, 2]}), tmp_path / "a.parquet")
    out, before = good
    rc, _, err = prepare_cli(capsys, tmp_path / "a.parquet", "--out", out)
    assert rc == 2 and err.count("\n") == 1
    assert "a.parquet has no column 'text' (columns: body, n): give --field NAME" in err
    rc, _, err = prepare_cli(capsys, tmp_path / "a.parquet", "--out", out, "--field", "n")
    assert rc == 2 and "column 'n' is int64, not text" in err
    assert files(out) == before
    assert prepare_cli(capsys, tmp_path / "a.parquet", "--out", out, "--field", "body",
                       "--val-fraction", "0.5")[0] == 0


def test_skip_counts_and_reports_bad_records(tmp_path, capsys):
    src = jsonl(tmp_path / "a.jsonl", {"text": "one"}, b"{oops", {"body": "x"}, {"text": "two"},
                {"text": "three"})
    rc, out, err = prepare_cli(capsys, src, "--out", tmp_path / "o", "--on-bad-record", "skip",
                               "--val-fraction", "0")
    assert rc == 0, err
    assert "skipped 2 bad records (--on-bad-record skip); first: " in out
    assert f"{src}:2: not JSON" in out
    meta = D.read_meta(tmp_path / "o" / "train.bin")
    assert meta["skipped_records"] == 2 and meta["documents"] == 3
    assert meta["skipped_examples"][1].startswith(f"{src}:3: no field 'text'")


def test_a_rerun_removes_what_an_interrupted_prepare_left(tmp_path, capsys):
    fifo = tmp_path / "stuck.jsonl"
    os.mkfifo(fifo)  # the reader blocks here, after the temporaries are made
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "ratrain.data", "prepare", str(fifo), "--out",
                          str(out), "--quiet"])
    deadline = time.monotonic() + 60
    while len([f for f in out.glob(".*.tmp.*")]) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)  # as the kernel's OOM killer does
    p.wait()
    left = sorted(f.name for f in out.glob(".*.tmp.*"))
    assert len(left) == 3 and any(".lengths.tmp." in f for f in left), left
    # a rerun with another writer alive beside it is refused; a dead one's leftovers go
    alive = out / f".train.bin.tmp.{os.getppid()}.abcd"
    alive.write_bytes(b"")
    src = jsonl(tmp_path / "a.jsonl", *({"text": f"doc {i}"} for i in range(10)))
    rc, _, err = prepare_cli(capsys, src, "--out", out)
    assert rc == 2 and f"another prepare (pid {os.getppid()}) is writing" in err
    alive.unlink()
    rc, stdout, _ = prepare_cli(capsys, src, "--out", out)
    assert rc == 0 and stdout.count("left by an interrupted prepare") == 3
    assert not list(out.glob(".*.tmp.*"))
    assert sorted(f.name for f in out.iterdir()) == ["train.bin", "train.bin.json", "train.idx",
                                                     "val.bin", "val.bin.json", "val.idx"]


# --------------------------------------------------------------------------------------------
# Token files the trainer refuses
# --------------------------------------------------------------------------------------------


def _cfg(tokens, vocab=64):
    return config_from_dict({"model": {"vocab_size": vocab, "seq_len": 8},
                             "data": {"tokens": str(tokens)}})


def _corpus(d: Path) -> Path:
    D.write_tokens(d / "c.bin", np.arange(400) % 64, 64, doc_lengths=[100, 300])
    return d / "c"


def _patch(path: Path, offset: int, raw: bytes) -> None:
    b = bytearray(path.read_bytes())
    b[offset:offset + len(raw)] = raw
    path.write_bytes(bytes(b))


TRAIN_CASES = {
    "wrong magic": (lambda p: _patch(p.with_suffix(".idx"), 0, b"TNTIDX\x00\x00\x00"),
                    "not a Megatron index: it starts with b'TNTIDX"),
    "wrong version": (lambda p: _patch(p.with_suffix(".idx"), 9, struct.pack("<Q", 2)),
                      "Megatron index version 2; ratrain reads version 1"),
    "float dtype": (lambda p: _patch(p.with_suffix(".idx"), 17, b"\x07"),
                    "dtype code 7 (float32) is not a token dtype"),
    "unknown dtype": (lambda p: _patch(p.with_suffix(".idx"), 17, b"\x0c"),
                      "unknown dtype code 12"),
    "truncated index": (lambda p: p.with_suffix(".idx").write_bytes(
        p.with_suffix(".idx").read_bytes()[:-8]), "the file is truncated or damaged"),
    "bin too short": (lambda p: p.with_suffix(".bin").write_bytes(
        p.with_suffix(".bin").read_bytes()[:-2]), "describes 400 tokens of uint16 (800 bytes)"),
    "ids beyond vocab": (lambda p: _patch(p.with_suffix(".bin"), 20, struct.pack("<H", 99)),
                         "token id 99 at position 10 is >= model.vocab_size=64"),
    "gappy pointers": (lambda p: _patch(p.with_suffix(".idx"), 34 + 8 + 8, struct.pack("<q", 202)),
                       "sequence 1 starts at byte 202, not 200"),
}


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_a_bad_token_file_is_refused_before_training(tmp_path, case):
    damage, words = TRAIN_CASES[case]
    prefix = _corpus(tmp_path)
    D.check_data(_cfg(prefix))  # whole, it is fine
    D.sidecar_path(prefix.with_suffix(".bin")).unlink()  # a Megatron corpus has no sidecar
    damage(prefix)
    with pytest.raises(D.DataError) as e:
        D.check_data(_cfg(prefix))
    assert words in str(e.value) and "\n" not in str(e.value)


TRAINER_CASES = {
    "bad magic": (lambda idx: _patch(idx, 0, b"XXXXXXXXX"), "c.idx: not a Megatron index"),
    "no index": (lambda idx: [idx.unlink(), D.sidecar_path(idx.with_suffix(".bin")).unlink()],
                 "names a Megatron prefix but its index"),  # as Megatron-LM writes it: no sidecar
}


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_the_trainer_says_it_in_one_line_and_exits_2(tmp_path, case):
    damage, words = TRAINER_CASES[case]
    prefix = _corpus(tmp_path)
    damage(prefix.with_suffix(".idx"))
    job = tmp_path / "job.yaml"
    job.write_text("model: {vocab_size: 64, hidden: 32, layers: 2, heads: 4, kv_heads: 2, "
                   f"ffn_hidden: 64, seq_len: 8}}\nrun: {{steps: 1}}\ndata: {{tokens: {prefix}}}\n")
    p = subprocess.run([sys.executable, "-m", "ratrain.train", "--config", str(job), "--set",
                        f"run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert words in p.stderr and not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# A flat file only when nothing says otherwise
# --------------------------------------------------------------------------------------------


def _megatron_int32(d: Path, name: str = "m") -> Path:
    """A Megatron corpus of int32 ids 0..63 as Megatron-LM writes it (no sidecar): its prefix."""
    D.write_tokens(d / f"{name}.bin", np.arange(400) % 64, 70000, doc_lengths=[100, 300])
    D.sidecar_path(d / f"{name}.bin").unlink()
    return d / name


def _refused(path, *words) -> None:
    with pytest.raises(D.DataError) as e:
        D.check_data(_cfg(path))
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_a_megatron_file_without_its_index_is_not_read_flat(tmp_path, capsys):
    prefix = _megatron_int32(tmp_path)
    bin_path, idx = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    assert D.open_tokens(prefix, None, "t").dtype == np.int32  # whole: the index's int32
    idx.unlink()
    _refused(prefix, f"data.tokens='{prefix}' names a Megatron prefix but its index {idx} does "
             f"not exist: put the .idx written with m.bin beside it, or name {bin_path} itself")
    assert data_main(["info", str(prefix)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    flat = D.open_tokens(bin_path, None, "t")  # README: a plain .bin with nothing beside it
    assert flat.index is None and flat.dtype == np.uint16 and flat.num_tokens == 800
    write_meta(bin_path, {"layout": "megatron", "dtype": "int32"})  # as prepare writes it
    for name in (prefix, bin_path):
        _refused(name, f"its sidecar {D.sidecar_path(bin_path)} says layout megatron but its "
                 f"index {idx} does not exist")
    write_meta(bin_path, {"layout": "nanogpt", "dtype": "int32"})  # says flat, and int32
    flat = D.open_tokens(prefix, None, "t")
    assert flat.index is None and np.array_equal(np.memmap(bin_path, flat.dtype, "r"),
                                                 np.arange(400) % 64)
    idx.write_bytes(b"")
    _refused(bin_path, "says layout nanogpt (a flat file) but an index", "remove the stale index")
    idx.unlink()
    write_meta(bin_path, {"layout": "mmap"})
    _refused(bin_path, "says layout 'mmap', not one of megatron, nanogpt")


def test_the_held_out_split_beside_a_megatron_file_needs_its_index(tmp_path):
    from ratrain.api import eval_dataset

    train, val = _megatron_int32(tmp_path, "train"), _megatron_int32(tmp_path, "val")
    D.check_data(_cfg(train))
    val.with_suffix(".idx").unlink()
    _refused(train, f"{val}.bin, the held-out split beside {train}.bin, has no index "
             f"{val}.idx though the train file has one", f"set data.eval_tokens={val}.bin")
    with pytest.raises(D.DataError, match="set --tokens="):
        eval_dataset(_cfg(train))
    explicit = config_from_dict({"model": {"vocab_size": 64, "seq_len": 8},
                                 "data": {"tokens": str(train), "eval_tokens": f"{val}.bin"}})
    assert D.check_data(explicit).eval_tokens == Path(f"{val}.bin")  # named: read flat


def test_mixture_config_errors(tmp_path):
    from ratrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.tokens='a.bin' and data.sources are both set"):
        config_from_dict({"data": {"tokens": "a.bin", "sources": [{"tokens": "b.bin"}]}})
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight=0.0 must be > 0"):
        config_from_dict({"data": {"sources": [{"tokens": "a/train.bin"},
                                               {"tokens": "b/train.bin", "weight": 0}]}})
    with pytest.raises(ConfigError, match=r"both named 'train': give them names"):
        config_from_dict({"data": {"sources": [{"tokens": "train.bin"}, {"tokens": "train"}]}})
    a, b = tmp_path / "a" / "train.bin", tmp_path / "b" / "train.bin"
    D.write_tokens(a, np.arange(100) % 64, 64, tokenizer="byte")
    D.write_tokens(b, np.arange(100) % 64, 64, tokenizer="hf:/x/tokenizer.json sha256:ab",
                   extra={"tokenizer_path": "/x/tokenizer.json", "tokenizer_sha256": "ab" * 32})
    cfg = config_from_dict({"model": {"vocab_size": 64, "seq_len": 8},
                            "data": {"sources": [{"tokens": str(a)}, {"tokens": str(b)}]}})
    with pytest.raises(D.DataError, match=r"data.sources\[1\] was prepared with the tokenizer "
                       r"/x/tokenizer.json but data.sources\[0\] with byte"):
        D.record_tokenizer(cfg, D.check_data(cfg))
