"""Tokenizers: byte-level (the default, vocabulary 256) or a local Hugging Face tokenizer.json.

    tok = load_tokenizer("byte")                       # or "path/to/tokenizer.json" / its folder
    ids = tok.encode(text); text = tok.decode(ids)     # tok.vocab_size, tok.name (for sidecars)
    tok.eot_id                                         # end-of-text id (None: byte / none found)
    tok.spec, tok.sha256                               # what data.tokenizer / _sha256 record
    ids, lengths = tok.encode_batch(texts)             # many at once: all ids, each one's count

End of text: a Hugging Face tokenizer's end-of-text token is the first of `EOT_TOKENS` it has
as a special (added) token; the byte tokenizer has none (its 256 ids are all bytes).

Cuts: ``tok.cuts`` are the places where a text may be cut so that its pieces' tokens equal the
whole text's (``prepare`` encodes long documents in pieces): ``any`` for the byte tokenizer;
for a Hugging Face tokenizer, of ``space`` (before a single space between two non-space
characters) and ``newline`` (after a single newline between two non-space characters), those
that pass `probe_cuts` on `CUT_PROBES` (both do for byte-level BPE such as GPT-2's, LLaMA 3's
or Qwen's; ``space`` only for SentencePiece-style Metaspace; none where a normalizer prepends
to every text, and such a document is encoded whole; never a kind whose mark is inside an added
token, which a cut could split). A Hugging Face tokenizer encodes without
special tokens, truncation or padding, whatever its tokenizer.json says.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from itertools import chain
from pathlib import Path

import numpy as np

from ratrain.data.tokens import DataError


EOT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
CUT_PROBES = (
    "def f(x):\n    return x + 1\nprint(f(2))",
    "The cat sat on the mat.\nIt was 2024, and 37 cats agreed: don't move!",
    "héllo wörld ünïcode ça va\nÄpfel 1234567 z",
    "日本語 の テキスト\n中文 文本 测试\nмир дом",
    "a\tb c  d\n\ne f (g) [h] {i} <j> k=l m-n o.p q,r s;t",
    "x=1 y==2 z!=3 #comment\n  indented line\nurl http://a.b/c?d=e f",
)


class ByteTokenizer:
    """Byte-level: the ids of a text are its UTF-8 bytes (vocabulary 256)."""

    name = "byte"
    spec = "byte"
    sha256 = ""
    vocab_size = 256
    eot_id = None
    eot_token = None

    cuts = ("any",)
    parallel = False  # encoding is a copy: no thread would help

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(every text's ids back to back, each text's count)."""
        raw = [t.encode("utf-8") for t in texts]
        return (np.frombuffer(b"".join(raw), dtype=np.uint8),
                np.fromiter(map(len, raw), dtype=np.int64, count=len(raw)))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` through the optional ``tokenizers`` package.

    Documents are encoded without special tokens; the vocabulary size counts added tokens.
    """

    def __init__(self, path: str | os.PathLike, sha256: str = ""):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(
                f"--tokenizer {str(path)!r}: no such file; give 'byte' or the path of a Hugging "
                "Face tokenizer.json"
            )
        try:
            import tokenizers  # optional dependency: only a Hugging Face tokenizer needs it
        except ImportError:
            raise DataError(
                f"--tokenizer {str(path)!r} needs the optional 'tokenizers' package: "
                "pip install tokenizers   (or pip install 'ratrain[tokenizers]'), or use "
                "--tokenizer byte"
            ) from None
        self.raw = path.read_bytes()  # read once: what is hashed is what is parsed and shipped
        self.sha256 = hashlib.sha256(self.raw).hexdigest()
        if sha256 and sha256 != self.sha256:
            raise DataError(
                f"tokenizer {path} has SHA-256 {self.sha256[:16]}..., not the {sha256[:16]}... the "
                "data was prepared with (data.tokenizer_sha256): the file changed; give the "
                "original file, or prepare the data again"
            )
        try:
            self._tok = tokenizers.Tokenizer.from_str(self.raw.decode())
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exceptions
            raise DataError(f"--tokenizer {str(path)!r}: not a tokenizer.json ({e})") from None
        self._tok.no_truncation()  # a document's every token, whatever the file says
        self._tok.no_padding()
        self._batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        self.path = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.spec = str(path.resolve())
        self.name = f"hf:{self.spec} sha256:{self.sha256[:16]}"
        special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()
                   if t.special}
        self.eot_token = next((t for t in EOT_TOKENS if t in special), None)
        self.eot_id = special[self.eot_token] if self.eot_token else None
        added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
        self.cuts = tuple(k for k in probe_cuts(self.encode)  # never through an added token
                          if not any((" " if k == "space" else "\n") in t for t in added))

    parallel = True  # encode_batch releases the GIL: threads encode at once

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(every text's ids back to back, each text's count), as ``encode`` gives them."""
        ids = [e.ids for e in self._batch(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.uint32, count=int(lengths.sum()))
        return flat, lengths

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        """The id of `token` (a vocabulary entry), or None."""
        return self._tok.token_to_id(token)


def cut_points(text: str, kind: str) -> list[int]:
    """Where `text` may be cut by `kind` (see the module doc): positions p, text[:p] | text[p:]."""
    if kind == "any":
        return list(range(1, len(text)))
    mark = " " if kind == "space" else "\n"
    shift = 0 if kind == "space" else 1  # a space starts the next piece; a newline ends this one
    out = []
    for i, ch in enumerate(text):
        if ch == mark and 0 < i < len(text) - 1 and not text[i - 1].isspace() \
                and not text[i + 1].isspace():
            out.append(i + shift)
    return out


def probe_cuts(encode) -> tuple[str, ...]:
    """The kinds of cut (``space``, ``newline``) at which `encode` gives the same tokens for
    the two pieces as for the whole, on every cut of every text of `CUT_PROBES`."""
    ok = []
    for kind in ("space", "newline"):
        if all(np.array_equal(np.concatenate([encode(t[:p]), encode(t[p:])]), encode(t))
               for t in CUT_PROBES for p in cut_points(t, kind)):
            ok.append(kind)
    return tuple(ok)


def load_tokenizer(spec: str = "byte", sha256: str = "", *,
                   stored: bool = False) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` or the path of a Hugging Face ``tokenizer.json`` (or a folder holding one);
    with `sha256`, the file must hash to it before it is parsed (DataError otherwise).
    `stored`: the path comes from a saved config (a checkpoint's, a run's), not from the user,
    so a Hugging Face file is used only with a SHA-256 to match: an empty one is refused."""
    if spec in ("", "byte"):
        return ByteTokenizer()
    if stored and not sha256:
        raise DataError(
            f"the saved config names the tokenizer {spec} (data.tokenizer) without its SHA-256 "
            "(data.tokenizer_sha256 is empty), so it cannot be checked: give the tokenizer "
            "yourself (--tokenizer PATH, or load(tokenizer=PATH))"
        )
    return HFTokenizer(spec, sha256)


def tokenizer_of_meta(meta: dict | None) -> tuple[str, str]:
    """(data.tokenizer, data.tokenizer_sha256) a token file's sidecar records: ("byte", ""),
    (tokenizer.json path, its SHA-256), or ("", "") when it says nothing (a nanoGPT file)."""
    name = (meta or {}).get("tokenizer", "")
    if not name or name == "byte":
        return name, ""
    if name.startswith("hf:"):
        path = name[3:].rsplit(" sha256:", 1)[0]
        return meta.get("tokenizer_path", path), meta.get("tokenizer_sha256", "")
    return name, meta.get("tokenizer_sha256", "")
