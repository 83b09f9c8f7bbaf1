"""Encoding in bounded memory: a long document encoded in pieces gives the tokens of encoding it
whole (real BPE tokenizers, long lines, streamed files), any number of workers gives the same
bytes, the held-out split takes whole documents, and the progress display."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from ratrain import data as D
from ratrain.data import encode as E
from ratrain.data import readers
from ratrain.data.progress import Progress
from tests._prereq import need

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "42", "dogs", "barked,", "and", "(x", "+", "y)", "==", "z;", "naïve", "café", "déjà", "vu", "東京", "don't", "return", "None\n"]


def long_docs(seed: int = 0) -> list[str]:
    """Documents with very long lines, runs of spaces and newlines, unicode, and a word with no
    place to cut."""
    rng = np.random.default_rng(seed)
    line = " ".join(rng.choice(WORDS, 2500))  # one line of ~16 K characters
    code = "\n".join(f"    x{i} = f(x{i - 1}, {i})  # step {i}" for i in range(1, 500))
    spaced = "".join(rng.choice(["a", " ", "  ", "\n", "\n\n", "b.", "\t", "é"], 6000))
    return [line, code, spaced, "z" * 3000, line[:3000] + "\n" + code[:3000], "short one"]


def bpe_tokenizer(tmp_path, kind: str):
    """A trained tokenizer.json: byte-level BPE (GPT-2 style), SentencePiece-style Metaspace
    BPE, a GPT-4-style regex split, or one that prepends to every text (no cut is exact)."""
    tk = need("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE(unk_token="<unk>" if kind != "bytelevel" else None))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    elif kind == "gpt4":
        pat = (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tk.Regex(pat), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    elif kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        alphabet = []
    else:  # "prepend": LLaMA-2's converted SentencePiece: a normalizer prepends, no pre-tokenizer
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<unk>"],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(long_docs(1) + [" ".join(WORDS)] * 20, trainer)
    path = tmp_path / kind / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return D.load_tokenizer(str(path))


@pytest.mark.parametrize("kind, cuts", [("bytelevel", ("space", "newline")),
                                        ("gpt4", ("space", "newline")),
                                        ("metaspace", ("space",)), ("prepend", ())])
def test_pieces_give_the_tokens_of_the_whole(tmp_path, kind, cuts):
    tok = bpe_tokenizer(tmp_path, kind)
    assert tok.cuts == cuts
    for doc in long_docs() if cuts else long_docs()[-2:]:  # no cut: BPE over a whole text
        for piece in (64, 1000):  # many cuts, and some
            parts = list(E.pieces([doc], tok.cuts, piece))
            assert "".join(parts) == doc
            if cuts and " " in doc and piece == 64 and "z" * 100 not in doc:
                assert len(parts) > len(doc) // 200  # it did cut
            got = np.concatenate([tok.encode(p) for p in parts])
            assert np.array_equal(got, tok.encode(doc)), (kind, piece, doc[:40])


def test_prepare_of_long_lines_equals_encoding_whole(tmp_path, monkeypatch):
    tok = bpe_tokenizer(tmp_path, "bytelevel")
    monkeypatch.setattr(E, "PIECE_CHARS", 100)  # every long document in many pieces
    monkeypatch.setattr(readers, "STREAM_BYTES", 1000)  # text files streamed in blocks ...
    monkeypatch.setattr(readers, "BLOCK_BYTES", 777)  # ... that cut characters in two
    monkeypatch.setattr(readers, "HEAD_CHARS", 500)
    docs = long_docs()
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i}.txt").write_text(d)
    res = D.prepare([str(folder)], out=tmp_path / "o" / "train.bin", tokenizer=str(tok.path),
                    val_fraction=0.0, workers=2)
    want = [np.append(tok.encode(d), tok.eot_id) for d in docs]
    idx = D.open_tokens(res.train, None, "t").index
    assert idx.lengths.tolist() == [len(w) for w in want]
    assert np.array_equal(np.fromfile(res.train, "<u2"), np.concatenate(want))


def test_a_streamed_file_counts_its_bytes_once_it_is_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "BLOCK_BYTES", 1000)
    path = tmp_path / "big.txt"
    path.write_text("word " * 3000)
    reading = readers.Reading()
    blocks = readers._blocks(path, reading)
    assert "".join(blocks) == "word " * 3000
    assert reading.bytes_read == 15000  # after the file is closed, as the encoder asks then


def test_any_number_of_workers_gives_the_same_bytes(tmp_path, monkeypatch):
    tok = bpe_tokenizer(tmp_path, "bytelevel")
    monkeypatch.setattr(E, "BATCH_CHARS", 2000)  # many batches in flight
    monkeypatch.setattr(E, "PIECE_CHARS", 300)
    src = tmp_path / "a.jsonl"
    rng = np.random.default_rng(1)
    src.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, int(n)))}) + "\n"
                           for n in rng.integers(1, 1500, 100)))
    digests = set()
    seen = []
    real = E.ThreadPoolExecutor

    def counting(n, *a, **k):
        seen.append((n, os.environ.get("TOKENIZERS_PARALLELISM")))
        return real(n, *a, **k)

    monkeypatch.setattr(E, "ThreadPoolExecutor", counting)
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    for workers in (1, 2, 5):
        out = tmp_path / f"w{workers}" / "train.bin"
        D.prepare([str(src)], out=out, tokenizer=str(tok.path), workers=workers)
        digests.add(tuple(D.file_sha256(p) for p in (out, out.with_suffix(".idx"),
                                                     out.parent / "val.bin")))
    assert len(digests) == 1
    assert seen == [(1, "false"), (2, "false"), (5, "false")]  # each thread encodes alone
    assert os.environ.get("TOKENIZERS_PARALLELISM") == before  # restored


def test_hash_split_keeps_documents_whole_and_duplicates_together(tmp_path):
    docs = [f"document number {i % 30} " * 5 for i in range(60)]  # each text twice
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    res = D.prepare([str(src)], out=tmp_path / "h" / "train.bin", val_fraction=0.3,
                    val_split="hash", seed=7, eot="0")
    train = bytes(np.fromfile(res.train, "<u2").astype(np.uint8)).split(b"\0")[:-1]
    val = bytes(np.fromfile(res.val, "<u2").astype(np.uint8)).split(b"\0")[:-1]
    assert sorted(train + val) == sorted(d.encode() for d in docs)  # whole documents
    assert not set(train) & set(val) and len(val) % 2 == 0 and 0 < len(val) < 40
    assert D.read_meta(res.val)["held_out"] == {"split": "hash", "fraction": 0.3, "seed": 7}
    again = D.prepare([str(src)], out=tmp_path / "h2" / "train.bin", val_fraction=0.3,
                      val_split="hash", seed=7, eot="0")
    assert D.file_sha256(again.val) == D.file_sha256(res.val)
    other = D.prepare([str(src)], out=tmp_path / "h3" / "train.bin", val_fraction=0.3,
                      val_split="hash", seed=8, eot="0")
    assert D.file_sha256(other.val) != D.file_sha256(res.val)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_lines_and_bar():
    clock, out = Clock(), io.StringIO()
    p = Progress(100e6, out, tty=False, interval=10, clock=clock)
    clock.t += 5
    p.update(10, 20e6, 5000)
    assert out.getvalue() == ""  # not yet time
    clock.t += 5
    p.update(20, 40e6, 9000)
    assert out.getvalue() == ("prepare:  40.0% | 20 documents | 40.0 / 100.0 MB read | 4.00 MB/s | "
                              "9,000 tokens | ETA 0:15\n")
    bar, term = Progress(100e6, io.StringIO(), tty=True, clock=clock), None
    clock.t += 10
    bar.update(1, 50e6, 7)
    term = bar.out.getvalue()
    assert term.startswith("\r[############............]  50.0% 1 documents") and "ETA 0:10" in term
    bar.close()
    assert bar.out.getvalue().endswith("\n")
