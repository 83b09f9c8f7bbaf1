"""Token formats and inputs: Megatron-LM's indexed dataset read and written against the
published format (fixtures written and read here, independently of ratrain's code), the same
documents as jsonl (.gz, .zst), parquet (a file, a folder of shards), Arrow (as Hugging Face
`datasets` saves them) and text giving the same token files, and a Megatron corpus training to
the losses of the same tokens in the flat nanoGPT layout."""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ratrain import data as D
from tests._prereq import need
from tests._tokenizer_util import make_bpe

# the format, from Megatron-LM's megatron/core/datasets/indexed_dataset.py (index version 1)
MAGIC = b"MMIDIDX\x00\x00"
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
         7: np.float32, 8: np.uint16}


def write_megatron(prefix: Path, seqs: list[list[int]], code: int = 8, modes=None,
                   docs=None) -> None:
    """A Megatron corpus written from the format's description: `seqs` back to back, document i
    being sequences docs[i] .. docs[i+1] - 1 (default: one sequence each); with `modes`, one
    int8 per sequence after the document indices (the multimodal builder's variant)."""
    dt = np.dtype(CODES[code]).newbyteorder("<")
    lengths = [len(q) for q in seqs]
    pointers = np.concatenate(([0], np.cumsum(lengths)[:-1])) * dt.itemsize
    docs = np.arange(len(seqs) + 1) if docs is None else np.asarray(docs)
    with open(f"{prefix}.bin", "wb") as f:
        for q in seqs:
            f.write(np.asarray(q, dtype=dt).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(docs)))  # the document indices, documents + 1
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(np.asarray(pointers, dtype="<i8").tobytes())
        f.write(np.asarray(docs, dtype="<i8").tobytes())
        if modes is not None:
            f.write(np.asarray(modes, dtype="i1").tobytes())


def read_megatron(prefix: Path) -> list[np.ndarray]:
    """Each sequence of a Megatron corpus, read from the format's description."""
    raw = Path(f"{prefix}.idx").read_bytes()
    assert raw[:9] == MAGIC and struct.unpack("<Q", raw[9:17])[0] == 1
    code = raw[17]
    n_seq, n_doc = struct.unpack("<QQ", raw[18:34])
    lengths = np.frombuffer(raw, "<i4", n_seq, 34)
    pointers = np.frombuffer(raw, "<i8", n_seq, 34 + 4 * n_seq)
    docs = np.frombuffer(raw, "<i8", n_doc, 34 + 12 * n_seq)
    assert len(raw) == 34 + 12 * n_seq + 8 * n_doc and docs[0] == 0 and docs[-1] == n_seq
    tokens = Path(f"{prefix}.bin").read_bytes()
    dt = np.dtype(CODES[code]).newbyteorder("<")
    return [np.frombuffer(tokens, dt, int(n), int(p)) for n, p in zip(lengths, pointers)]


DOCS = [f"def f{i}(x):\n    return x * {i}  # {'a long comment ' * (i % 7)}\n" for i in range(40)]
DOCS[5] = "héllo wörld, ünïcode " * 50  # characters of several bytes
DOCS[9] = "one long line of words without a newline " * 40


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return make_bpe(tmp_path_factory.mktemp("bpe"))[0]


# --------------------------------------------------------------------------------------------
# Megatron's format, both ways
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [8, 4])
def test_a_megatron_corpus_written_from_the_spec_is_read(tmp_path, code):
    docs = [list(range(i, i + 10 + i)) for i in range(12)]
    write_megatron(tmp_path / "corpus_text_document", docs, code)
    for name in ("corpus_text_document", "corpus_text_document.bin",
                 "corpus_text_document.idx"):  # the prefix or either file
        ds = D.TokenDataset(tmp_path / name, 7, 64)
        assert ds.path == tmp_path / "corpus_text_document.bin"
        assert ds.file.num_documents == 12 and ds.dtype == np.dtype(CODES[code])
        assert np.array_equal(ds.tokens, np.concatenate(docs))


def test_a_multimodal_index_of_text_is_read_and_another_mode_is_named(tmp_path, capsys):
    from ratrain.data.__main__ import main as data_main

    seqs = [list(range(i, i + 10 + i)) for i in range(6)]
    write_megatron(tmp_path / "text", seqs, 4, modes=[0] * 6, docs=[0, 2, 4, 6])
    ds = D.TokenDataset(tmp_path / "text", 7, 64)  # every mode 0: read like any other
    assert ds.file.num_documents == 3 and ds.file.index.modes.tolist() == [0] * 6
    assert np.array_equal(ds.tokens, np.concatenate(seqs))
    assert data_main(["info", str(tmp_path / "text")]) == 0
    assert "6 sequences, each of mode 0: text" in capsys.readouterr().out
    # tools/preprocess_mmdata.py's layout: per document, its text, then an image's bytes (mode 1)
    write_megatron(tmp_path / "img", seqs, 4, modes=[0, 1] * 3, docs=[0, 2, 4, 6])
    with pytest.raises(D.DataError) as e:
        D.TokenDataset(tmp_path / "img", 7, 64)
    assert "img.idx: a multimodal index (a mode per sequence): sequence 1 has mode 1, not 0 " \
        "(text)" in str(e.value) and "\n" not in str(e.value)
    raw = (tmp_path / "text.idx").read_bytes()
    (tmp_path / "text.idx").write_bytes(raw[:-1])  # a byte short of the modes: damaged
    with pytest.raises(D.DataError, match=r"make 138 \(144 with sequence modes\): the file is "
                       "truncated or damaged"):
        D.TokenDataset(tmp_path / "text", 7, 64)


def test_prepare_writes_what_an_independent_reader_reads(tmp_path, bpe):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    res = D.prepare([str(src)], out=tmp_path / "o" / "train.bin", tokenizer=str(bpe),
                    val_fraction=0.1)
    tok = D.load_tokenizer(str(bpe))
    want = [np.append(tok.encode(d), tok.eot_id) for d in DOCS]
    got = read_megatron(tmp_path / "o" / "train") + read_megatron(tmp_path / "o" / "val")
    assert len(got) == len(DOCS) and res.val_documents == 4
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    meta = D.read_meta(res.train)
    assert meta["tokenizer_sha256"] == D.file_sha256(bpe) and meta["documents"] == 36
    assert meta["inputs"] == [{"path": str(src), "bytes": src.stat().st_size}]
    assert meta["skipped_records"] == 0 and meta["held_out"]["split"] == "tail"


def test_a_document_past_an_int32_length_is_several_sequences(tmp_path, monkeypatch):
    from ratrain.data import megatron

    monkeypatch.setattr(megatron, "MAX_SEQUENCE", 5)  # as 2**31 - 1 tokens would be
    D.write_tokens(tmp_path / "c.bin", np.arange(15), 64, doc_lengths=[12, 3])
    assert [s.tolist() for s in read_megatron(tmp_path / "c")] == [
        [0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    idx = D.open_tokens(tmp_path / "c", None, "t").index
    assert idx.documents.tolist() == [0, 3, 4] and idx.num_tokens == 15


def _train_losses(tmp_path, name: str, tokens: str) -> list[float]:
    job = tmp_path / f"{name}.yaml"
    job.write_text(
        "model: {vocab_size: 64, hidden: 32, layers: 2, heads: 4, kv_heads: 2, ffn_hidden: 64,"
        " seq_len: 16}\nparallel: {micro_batch: 2, num_micro_batches: 2}\n"
        "run: {steps: 3, threads: 1}\n" + f"data: {{tokens: {tokens}, order: shuffled}}\n")
    p = subprocess.run([sys.executable, "-m", "ratrain.train", "--config", str(job), "--set",
                        f"run.dir={tmp_path / name}"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if '"loss"' in x]


def test_a_megatron_corpus_trains_to_the_losses_of_the_flat_layout(tmp_path):
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 64, int(n)).tolist() for n in rng.integers(20, 400, 60)]
    write_megatron(tmp_path / "mega", docs, code=4)  # int32, as Megatron writes big vocabularies
    D.write_tokens(tmp_path / "flat.bin", np.concatenate(docs), 64, layout="nanogpt")
    assert not (tmp_path / "flat.idx").exists()
    mega = _train_losses(tmp_path, "mega", str(tmp_path / "mega"))
    assert mega == _train_losses(tmp_path, "flat", str(tmp_path / "flat.bin")) and len(mega) == 3


# --------------------------------------------------------------------------------------------
# The same documents in every input format
# --------------------------------------------------------------------------------------------


def _write_inputs(d: Path, docs: list[str]) -> dict[str, Path]:
    """The documents as every kind of input prepare reads."""
    pa = need("pyarrow", "parquet and Arrow inputs (the data extra)")
    pq = need("pyarrow.parquet")
    zstd = need("zstandard", ".zst inputs (the data extra)")
    lines = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs)).encode()
    out = {}
    (d / "a.jsonl").write_bytes(lines)
    out["jsonl"] = d / "a.jsonl"
    (d / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    out["jsonl.gz"] = d / "a.jsonl.gz"
    (d / "a.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(lines))
    out["jsonl.zst"] = d / "a.jsonl.zst"
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, d / "a.parquet", row_group_size=7)
    out["parquet"] = d / "a.parquet"
    shards = d / "shards"
    shards.mkdir()
    half = len(docs) // 2
    pq.write_table(table.slice(0, half), shards / "part-00000.parquet")
    pq.write_table(table.slice(half), shards / "part-00001.parquet")
    out["parquet shards"] = shards
    arrow = d / "saved"  # Hugging Face datasets' save_to_disk: Arrow IPC streams + state.json
    arrow.mkdir()
    names = []
    for i, part in enumerate((table.slice(0, half), table.slice(half))):
        names.append(f"data-{i:05d}-of-00002.arrow")
        with pa.OSFile(str(arrow / names[-1]), "wb") as sink, \
                pa.ipc.new_stream(sink, part.schema) as w:
            w.write_table(part, max_chunksize=5)
    (arrow / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                  "_fingerprint": "x", "_split": None}))
    (arrow / "dataset_info.json").write_text("{}")
    out["arrow"] = arrow
    text = d / "text"
    text.mkdir()
    for i, t in enumerate(docs):
        (text / f"{i:03d}.txt").write_text(t)
    out["text"] = text
    return out


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_the_same_documents_in_every_format_give_the_same_token_files(tmp_path, bpe, tokenizer):
    inputs = _write_inputs(tmp_path, DOCS)
    spec = str(bpe) if tokenizer == "bpe" else "byte"
    digests = {}
    for kind, path in inputs.items():
        out = tmp_path / "out" / kind.replace(" ", "_").replace(".", "_") / "train.bin"
        res = D.prepare([str(path)], out=out, tokenizer=spec, val_fraction=0.1, eot="0")
        assert res.documents == len(DOCS) and res.val_documents == 4, kind
        digests[kind] = [hashlib.sha256(p.read_bytes()).hexdigest() for p in
                         (out, out.with_suffix(".idx"), res.val, res.val.with_suffix(".idx"))]
    assert all(v == digests["jsonl"] for v in digests.values()), digests


def test_a_datasetdict_folder_names_its_splits(tmp_path):
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "train" / "state.json").write_text('{"_data_files": []}')
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(D.DataError, match="DatasetDict with the splits train: give one split's"):
        D.prepare([str(tmp_path / "dd")], out=tmp_path / "o.bin")
