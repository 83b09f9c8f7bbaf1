"""Token files, prepare, the batch contract, eval batches and the data errors."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ratrain import data as D
from ratrain.data import corpus, tokens
from ratrain.config import ConfigError, config_from_dict
from tests._prereq import need


def arange_file(path: Path, n: int, dtype: str = "<u2", sidecar: dict | None = None) -> Path:
    """A token file holding 0, 1, ..., n-1 (mod the dtype), optionally with a sidecar."""
    np.arange(n).astype(dtype).tofile(path)
    if sidecar is not None:
        D.sidecar_path(path).write_text(json.dumps(sidecar))
    return path


# --------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------


def test_prepare_byte_round_trip(tmp_path):
    src = tmp_path / "text"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text("second file\n")
    (src / "a.txt").write_text("first file, héllo\n")
    (src / "sub" / "c.md").write_text("third, in a folder\n")
    (src / ".hidden").write_text("never read")
    (src / "bin.dat").write_bytes(b"\xff\xfe\x00bad")  # not UTF-8: skipped
    out = tmp_path / "tok" / "train.bin"
    res = D.prepare([str(src)], out=out, val_fraction=0.25)
    text = "first file, héllo\nsecond file\nthird, in a folder\n"  # sorted: a, b, sub/c
    raw = text.encode()
    assert res.train == out and res.val == tmp_path / "tok" / "val.bin"
    # the held-out split takes whole documents: round(3 x 0.25) = 1, the last one
    assert res.num_train + res.num_val == len(raw) and res.num_val == len("third, in a folder\n")
    assert res.documents == 3 and res.val_documents == 1
    assert res.skipped == (str(src / "bin.dat"),)
    train = np.fromfile(out, dtype="<u2")
    val = np.fromfile(res.val, dtype="<u2")
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == raw
    meta = D.read_meta(out)
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16" and meta["tokenizer"] == "byte"
    assert meta["num_tokens"] == res.num_train and meta["split"] == "train"
    assert meta["layout"] == "megatron" and meta["documents"] == 2
    assert D.open_tokens(out, None, "t").index.lengths.tolist() == [19, 12]  # é: 2 bytes
    assert meta["sha256"] == D.file_sha256(out)
    assert D.read_meta(res.val)["sha256"] == D.file_sha256(res.val)
    assert not [p for p in out.parent.iterdir() if ".tmp." in p.name]  # no temporaries left behind
    # the same inputs give the same bytes
    res2 = D.prepare([str(src)], out=tmp_path / "again", val_fraction=0.25)
    assert res2.train == tmp_path / "again" / "train.bin"
    assert D.file_sha256(res2.train) == meta["sha256"]


def test_prepare_no_val_removes_stale_split(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(10):
        (tmp_path / "in" / f"{i}.txt").write_text("x" * 10)
    out = tmp_path / "corpus.bin"
    res = D.prepare([str(tmp_path / "in")], out=out, val_fraction=0.1)
    assert res.val == tmp_path / "corpus.val.bin" and res.val_documents == 1
    assert (tmp_path / "corpus.val.bin").exists() and (tmp_path / "corpus.val.idx").exists()
    res = D.prepare([str(tmp_path / "in")], out=out, val_fraction=0.0)
    assert res.val is None and res.num_train == 100
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("corpus.val")]


def test_naming_convention(tmp_path):
    assert D.val_path("data/x/train.bin") == Path("data/x/val.bin")
    assert D.val_path("d/train_big.bin") == Path("d/val_big.bin")
    assert D.val_path("d/corpus.bin") == Path("d/corpus.val.bin")
    assert D.sidecar_path("d/train.bin") == Path("d/train.bin.json")
    assert D.default_out([]) == Path("data/stdlib/train.bin")
    assert D.default_out(["notes/shakespeare.txt"]) == Path("data/shakespeare/train.bin")
    assert D.default_tokens_path(tmp_path) == tmp_path / "stdlib" / "train.bin"


def test_prepare_cli(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"text": "hello cli " * 5}) + "\n" for _ in range(10)))
    out = tmp_path / "o" / "train.bin"
    r = subprocess.run(
        [sys.executable, "-m", "ratrain.data", "prepare", str(f), "--out", str(out),
         "--val-fraction", "0.1"], check=False, capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "450 train tokens" in r.stdout and out.exists() and (out.parent / "val.bin").exists()
    assert "prepare: 100.0% | 10 documents" in r.stderr  # progress lines: not a terminal
    r = subprocess.run([sys.executable, "-m", "ratrain.data", "info", str(out.with_suffix(""))],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0 and "Megatron indexed dataset" in r.stdout and "9 documents" in r.stdout
    r = subprocess.run([sys.executable, "-m", "ratrain.data", "prepare", str(tmp_path / "nope")],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_prepare_errors(tmp_path):
    with pytest.raises(D.DataError, match="val-fraction"):
        D.prepare([str(tmp_path)], out=tmp_path / "t.bin", val_fraction=1.0)
    with pytest.raises(D.DataError, match="does not exist"):
        D.prepare([str(tmp_path / "missing.txt")], out=tmp_path / "t.bin")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xff")
    with pytest.raises(D.DataError, match="not UTF-8"):
        D.prepare([str(tmp_path / "bad.txt")], out=tmp_path / "t.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(D.DataError, match="no documents with text"):
        D.prepare([str(tmp_path / "empty")], out=tmp_path / "t.bin")
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(D.DataError, match="1 document.*--val-fraction 0"):
        D.prepare([str(tmp_path / "one.txt")], out=tmp_path / "t.bin")
    with pytest.raises(D.DataError, match="no such file"):
        D.prepare([], out=tmp_path / "t.bin", tokenizer=str(tmp_path / "tokenizer.json"))


def test_missing_tokenizers_package_is_named(tmp_path, monkeypatch):
    tj = tmp_path / "tokenizer.json"
    tj.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    with pytest.raises(D.DataError, match="pip install tokenizers"):
        D.load_tokenizer(str(tj))


def test_default_corpus_is_deterministic(tmp_path):
    a = D.prepare([], out=tmp_path / "a" / "train.bin", max_bytes=100_000)
    b = D.prepare([], out=tmp_path / "b" / "train.bin", max_bytes=100_000)
    ma, mb = D.read_meta(a.train), D.read_meta(b.train)
    assert ma["sha256"] == mb["sha256"] == D.file_sha256(b.train)
    assert D.read_meta(a.val)["sha256"] == D.read_meta(b.val)["sha256"]
    assert 100_000 <= a.num_train + a.num_val < 400_000 and "stdlib" in ma["source"]
    root, files = D.stdlib_files(100_000)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and not any("site-packages" in r for r in rel)


def test_ensure_default_corpus_once_and_concurrently(tmp_path, monkeypatch):
    calls = []
    real = D.prepare

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(corpus, "prepare", counting)  # the prepare ensure_default_corpus calls
    paths, errors = [], []

    def worker():
        try:
            paths.append(D.ensure_default_corpus(tmp_path / "data", max_bytes=50_000))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1
    assert set(paths) == {tmp_path / "data" / "stdlib" / "train.bin"}
    assert D.ensure_default_corpus(tmp_path / "data", max_bytes=50_000) == paths[0]
    assert len(calls) == 1  # reused, not prepared again
    D.TokenDataset(paths[0], 64, 256)
    D.TokenDataset(D.val_path(paths[0]), 64, 256)


class _FakeComm:
    """Two 'ranks' in one process: rank 0's sends land in rank 1's inbox."""

    def __init__(self, rank, box):
        self.rank, self.box = rank, box

    def Get_rank(self):  # mpi4py's names
        return self.rank

    def Get_size(self):
        return 2

    def send(self, obj, dest, tag):
        self.box.append((dest, tag, obj))

    def recv(self, source, tag):
        return self.box.pop(0)[2]


def test_ensure_default_corpus_with_comm(tmp_path):
    box = []
    p0 = D.ensure_default_corpus(tmp_path, comm=_FakeComm(0, box), max_bytes=20_000)
    assert box == [(1, 7301, None)]
    p1 = D.ensure_default_corpus(tmp_path, comm=_FakeComm(1, box), max_bytes=20_000)
    assert p0 == p1 and p0.exists()
    box.append((1, 7301, "OSError: disk full"))
    with pytest.raises(D.DataError, match="failed on rank 0: OSError: disk full"):
        D.ensure_default_corpus(tmp_path, comm=_FakeComm(1, box))


def test_hf_tokenizer(tmp_path):
    tokenizers = need("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = ["the", "cat", "sat", "on", "mat", "[UNK]"]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tdir = tmp_path / "mytok"
    tdir.mkdir()
    tok.save(str(tdir / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("the cat sat on the mat\n")
    (tmp_path / "b.txt").write_text("the dog sat\n")
    res = D.prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], out=tmp_path / "o.bin",
                    tokenizer=str(tdir / "tokenizer.json"), val_fraction=0.0)
    ids = np.fromfile(res.train, dtype="<u2").tolist()
    assert ids == [0, 1, 2, 3, 0, 4] + [0, 5, 2]
    meta = D.read_meta(res.train)
    assert meta["vocab_size"] == 6 and meta["tokenizer"].startswith("hf:")
    assert D.default_out(["x.txt"], str(tdir / "tokenizer.json")) == Path("data/x-mytok/train.bin")
    with pytest.raises(D.DataError, match="vocabulary of 6 tokens"):
        D.TokenDataset(res.train, 2, vocab_size=5)


@pytest.mark.parametrize("layout, dtype", [("megatron", "int32"), ("nanogpt", "uint32")])
def test_large_vocab_is_32_bit(tmp_path, layout, dtype):
    assert D.dtype_for_vocab(65536) == np.dtype("<u2")
    assert D.dtype_for_vocab(65537) == np.dtype("<u4")
    ids = np.array([0, 70000, 5, 65536, 1])
    meta = D.write_tokens(tmp_path / "big.bin", ids, vocab_size=70001, layout=layout)
    assert meta["dtype"] == dtype and (tmp_path / "big.bin").stat().st_size == 20
    assert (tmp_path / "big.idx").exists() == (layout == "megatron")
    ds = D.TokenDataset(tmp_path / "big.bin", 4, 70001)
    x, y = ds.batch_for_step(0)
    assert x.tolist() == [[[0, 70000, 5, 65536]]] and y.tolist() == [[[70000, 5, 65536, 1]]]


# --------------------------------------------------------------------------------------------
# The batch contract
# --------------------------------------------------------------------------------------------


def test_nanogpt_bin_without_sidecar(tmp_path):
    path = arange_file(tmp_path / "train.bin", 100)
    ds = D.TokenDataset(path, 4, 256)
    assert ds.meta is None and ds.dtype == np.dtype("<u2") and ds.num_windows == 20
    x, y = ds.micro_batch(0, 0, 0)
    assert x.tolist() == [[0, 1, 2, 3]] and y.tolist() == [[1, 2, 3, 4]]
    assert x.dtype == np.int64
    # uint32 without a sidecar: by argument, or by a minimal sidecar
    p32 = arange_file(tmp_path / "t32.bin", 40, "<u4")
    assert D.TokenDataset(p32, 4, 256, dtype="uint32").num_tokens == 40
    D.sidecar_path(p32).write_text('{"dtype": "uint32"}')
    assert D.TokenDataset(p32, 4, 256).num_tokens == 40
    with pytest.raises(D.DataError, match="sidecar .* says uint32"):
        D.TokenDataset(p32, 4, 256, dtype="uint16")


def test_sequential_windows_hand_computed(tmp_path):
    # seq_len 3 -> windows of 4 tokens: window j = [4j, 4j+1, 4j+2, 4j+3]
    ds = D.TokenDataset(arange_file(tmp_path / "t.bin", 400), 3, 400, dp=2, micro_batch=2,
                        num_micro_batches=3)
    # global batch 12 windows per step; replica r: 6 windows; micro-batch i: 2 windows
    # step 1, replica 1, micro-batch 2: stream positions 12 + 6 + 4 = 22, 23
    x, y = ds.micro_batch(1, 1, 2)
    assert x.tolist() == [[88, 89, 90], [92, 93, 94]]
    assert y.tolist() == [[89, 90, 91], [93, 94, 95]]
    X, Y = ds.batch_for_step(1, 1)
    assert X.shape == Y.shape == (3, 2, 3) and X.dtype == Y.dtype == np.int64
    assert X[:, :, 0].tolist() == [[72, 76], [80, 84], [88, 92]]  # windows 18..23
    assert np.array_equal(X[2], x) and np.array_equal(Y[2], y)
    X0, _ = ds.batch_for_step(0, 0)
    assert X0[0].tolist() == [[0, 1, 2], [4, 5, 6]]
    assert ds.batch_for_step(0, 0, dp=1, micro_batch=1, num_micro_batches=1)[0].shape == (1, 1, 3)


@pytest.mark.parametrize("order", ["sequential", "shuffled"])
def test_global_batch_is_layout_independent(tmp_path, order):
    path = arange_file(tmp_path / "t.bin", 5 * 60 + 3)  # 60 windows of 5 tokens, 3 left over
    one = D.TokenDataset(path, 4, 512, order=order, seed=3, dp=1, micro_batch=4,
                         num_micro_batches=2)
    two = D.TokenDataset(path, 4, 512, order=order, seed=3, dp=2, micro_batch=2,
                         num_micro_batches=2)
    for step in range(20):  # several epochs
        x1, y1 = one.batch_for_step(step)
        parts = [two.batch_for_step(step, r) for r in range(2)]
        x2 = np.concatenate([p[0].reshape(-1, 4) for p in parts])
        y2 = np.concatenate([p[1].reshape(-1, 4) for p in parts])
        assert np.array_equal(x1.reshape(-1, 4), x2) and np.array_equal(y1.reshape(-1, 4), y2)


def test_wrap_around(tmp_path):
    ds = D.TokenDataset(arange_file(tmp_path / "t.bin", 23), 3, 256, micro_batch=2)
    # 5 windows (the last 3 tokens never read); 2 windows a step: step 2 = windows 4, 0
    assert ds.num_windows == 5
    x, _ = ds.batch_for_step(2)
    assert x[0].tolist() == [[16, 17, 18], [0, 1, 2]]
    assert ds.epoch(5) == 2.0
    assert int(ds.tokens.max()) == 22 and x.max() < 20


def test_shuffled_is_deterministic_and_a_permutation(tmp_path):
    path = arange_file(tmp_path / "t.bin", 4 * 30)
    a = D.TokenDataset(path, 3, 256, order="shuffled", seed=7, micro_batch=5)
    b = D.TokenDataset(path, 3, 256, order="shuffled", seed=7, micro_batch=5)
    c = D.TokenDataset(path, 3, 256, order="shuffled", seed=8, micro_batch=5)
    firsts = [a.batch_for_step(s)[0][0, :, 0] // 4 for s in range(12)]  # window ids
    epoch0, epoch1 = np.concatenate(firsts[:6]), np.concatenate(firsts[6:])
    assert sorted(epoch0) == list(range(30)) == sorted(epoch1)
    assert not np.array_equal(epoch0, np.arange(30)) and not np.array_equal(epoch0, epoch1)
    perm = np.random.default_rng([7, 1]).permutation(30)
    assert np.array_equal(epoch1, perm)
    # random access: step 9 alone, on a fresh dataset, equals step 9 after a replay
    assert np.array_equal(b.batch_for_step(9)[0], a.batch_for_step(9)[0])
    assert not np.array_equal(c.batch_for_step(0)[0], a.batch_for_step(0)[0])
    assert a.state_dict(9)["step"] == 9 and a.state_dict(9)["order"] == "shuffled"


def test_eval_batches_are_first_windows(tmp_path):
    path = arange_file(tmp_path / "val.bin", 4 * 10)
    ds = D.TokenDataset(path, 3, 256, order="shuffled", seed=1, micro_batch=2,
                        num_micro_batches=2)
    ev = D.eval_batches(ds, 3)
    assert len(ev) == 3 and ev[0][0].shape == (2, 2, 3)
    starts = [x[:, :, 0].ravel().tolist() for x, _ in ev]
    assert starts == [[0, 4, 8, 12], [16, 20, 24, 28], [32, 36, 0, 4]]  # wraps at 10 windows
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(ev, D.eval_batches(ds, 3)))


def test_check_data_from_config(tmp_path):
    res = D.prepare([], out=tmp_path / "d" / "train.bin", max_bytes=30_000)
    cfg = config_from_dict({
        "model": {"seq_len": 32},
        "parallel": {"micro_batch": 2, "num_micro_batches": 2},
        "data": {"tokens": str(res.train), "eval_interval": 5},
    })
    paths = D.check_data(cfg)
    assert paths == D.DataPaths(res.train, res.val)
    train, ev = D.open_datasets(cfg, paths)
    assert train.batch_for_step(0)[0].shape == (2, 2, 32) and ev.order == "sequential"
    # eval wanted but no split beside the tokens
    alone = arange_file(tmp_path / "alone.bin", 1000)
    bad = config_from_dict({"model": {"seq_len": 32, "vocab_size": 1000},
                            "data": {"tokens": str(alone), "eval_interval": 5}})
    with pytest.raises(D.DataError, match="data.eval_interval=5 but there is no held-out file"):
        D.check_data(bad)
    no_eval = config_from_dict({"model": {"seq_len": 32, "vocab_size": 1000},
                                "data": {"tokens": str(alone)}})
    assert D.check_data(no_eval) == D.DataPaths(alone, None)
    missing = config_from_dict({"model": {"vocab_size": 1000},
                                "data": {"tokens": str(alone), "eval_tokens": "nope.bin"}})
    with pytest.raises(D.DataError, match="data.eval_tokens='nope.bin' does not exist"):
        D.check_data(missing)


# --------------------------------------------------------------------------------------------
# Errors: each names the value and the fix
# --------------------------------------------------------------------------------------------


def test_errors(tmp_path):
    with pytest.raises(D.DataError, match=r"data.tokens='.*nope.bin' does not exist.*prepare"):
        D.TokenDataset(tmp_path / "nope.bin", 8, 256)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(D.DataError, match=r"is empty \(0 bytes\)"):
        D.TokenDataset(tmp_path / "empty.bin", 8, 256)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(D.DataError, match="3 bytes, not a multiple of 2 .*uint32"):
        D.TokenDataset(tmp_path / "odd.bin", 1, 256)
    short = arange_file(tmp_path / "short.bin", 8)
    with pytest.raises(D.DataError, match=r"holds 8 tokens, fewer than model.seq_len \+ 1 = 9.*"
                       r"above what the data can give; lower it to at most 7"):
        D.TokenDataset(short, 8, 256)
    D.TokenDataset(short, 7, 256)  # exactly one window
    big = tmp_path / "ids.bin"
    ids = np.zeros(1000, dtype="<u2")
    ids[637], ids[900] = 300, 999
    ids.tofile(big)
    with pytest.raises(D.DataError, match=r"token id 300 at position 637 is >= model.vocab_size"
                       r"=256 \(largest id in the file: 999\).*vocab_size >= 1000"):
        D.TokenDataset(big, 8, 256)
    D.TokenDataset(big, 8, 1000)
    D.TokenDataset(big, 8, 256, check_ids=False)  # the caller already checked
    side = arange_file(tmp_path / "v.bin", 100, sidecar={"vocab_size": 50000, "dtype": "uint16"})
    with pytest.raises(D.DataError, match=r"vocabulary of 50000 tokens .* model.vocab_size=256: "
                       "set model.vocab_size >= 50000"):
        D.TokenDataset(side, 8, 256)
    lying = arange_file(tmp_path / "l.bin", 100, sidecar={"num_tokens": 99})
    with pytest.raises(D.DataError, match="its sidecar says 99"):
        D.TokenDataset(lying, 8, 256)
    ds = D.TokenDataset(arange_file(tmp_path / "ok.bin", 100), 4, 256, dp=2)
    with pytest.raises(D.DataError, match=r"replica=2 is outside \[0, dp=2\)"):
        ds.batch_for_step(0, 2)
    with pytest.raises(D.DataError, match="micro-batch 1 is outside"):
        ds.micro_batch(0, 0, 1)
    with pytest.raises(D.DataError, match="data.order='random'"):
        D.TokenDataset(tmp_path / "ok.bin", 4, 256, order="random")
    assert issubclass(D.DataError, ConfigError)  # the trainer reports both the same way


def test_scan_is_chunked(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "_SCAN_CHUNK", 7)
    ids = np.arange(100, dtype="<u2") % 50
    ids[93] = 77
    assert D.scan_max_id(ids, 60) == (77, 93)
    assert D.scan_max_id(ids, 100) == (77, None)


def test_token_files_follow_the_umask(tmp_path):
    """Token files and sidecars get the modes of any file the user creates (ratrain.fileio)."""
    old = os.umask(0o027)
    try:
        D.write_tokens(tmp_path / "t.bin", np.arange(10), vocab_size=16)
    finally:
        os.umask(old)
    for name in ("t.bin", "t.bin.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o640, name


@pytest.mark.mpi(min_size=2)
def test_ensure_default_corpus_under_mpi(tmp_path_factory):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    root = comm.bcast(str(tmp_path_factory.mktemp("corpus")) if comm.rank == 0 else None)
    path = D.ensure_default_corpus(root, comm=comm, max_bytes=20_000)
    sha = D.read_meta(path)["sha256"]
    assert comm.allgather(sha) == [sha] * comm.size  # the reference collective, in a test only


def test_a_saved_configs_tokenizer_is_used_only_with_a_matching_sha256(tmp_path):
    from tests._tokenizer_util import make_bpe

    tj, _ = make_bpe(tmp_path)
    sha = D.file_sha256(tj)
    assert D.load_tokenizer(str(tj), sha, stored=True).sha256 == sha
    with pytest.raises(D.DataError, match="without its SHA-256"):  # never skipped when empty
        D.load_tokenizer(str(tj), "", stored=True)
    tj.write_text("not json at all")  # swapped: refused by its hash, before it is parsed
    with pytest.raises(D.DataError, match=f"not the {sha[:16]}"):
        D.load_tokenizer(str(tj), sha, stored=True)
    assert D.load_tokenizer("byte", "", stored=True).name == "byte"


def test_the_package_docstring_names_each_module_once_with_its_job():
    import re

    owns = D.__doc__.split("Owns, module by module:")[1].split("May import:")[0]
    named = re.findall(r"^- (?:this )?`(\w+)`: \S", owns, re.M)
    files = sorted(p.stem for p in Path(D.__file__).parent.glob("*.py"))
    assert sorted(named) == files, (sorted(named), files)
