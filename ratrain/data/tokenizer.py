"""Tokenizers: byte-level (the default, vocabulary 256) or a local Hugging Face tokenizer.json.

    tok = load_tokenizer("byte")                       # or "path/to/tokenizer.json" / its folder
    ids = tok.encode(text); text = tok.decode(ids)     # tok.vocab_size, tok.name (for sidecars)
    tok.eot_id                                         # end-of-text id (None: byte / none found)
    tok.spec, tok.sha256                               # what data.tokenizer / _sha256 record

End of text: a Hugging Face tokenizer's end-of-text token is the first of `EOT_TOKENS` it has
as a special (added) token; the byte tokenizer has none (its 256 ids are all bytes).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ratrain.data.tokens import DataError


EOT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


class ByteTokenizer:
    """Byte-level: the ids of a text are its UTF-8 bytes (vocabulary 256)."""

    name = "byte"
    spec = "byte"
    sha256 = ""
    vocab_size = 256
    eot_id = None
    eot_token = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

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
        self.path = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.spec = str(path.resolve())
        self.name = f"hf:{self.spec} sha256:{self.sha256[:16]}"
        special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()
                   if t.special}
        self.eot_token = next((t for t in EOT_TOKENS if t in special), None)
        self.eot_id = special[self.eot_token] if self.eot_token else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        """The id of `token` (a vocabulary entry), or None."""
        return self._tok.token_to_id(token)


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
