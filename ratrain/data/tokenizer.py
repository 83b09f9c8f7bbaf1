"""Tokenizers: byte-level (the default, vocabulary 256) or a local Hugging Face tokenizer.json.

    tok = load_tokenizer("byte")                       # or "path/to/tokenizer.json" / its folder
    ids = tok.encode(text); text = tok.decode(ids)     # tok.vocab_size, tok.name (for sidecars)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ratrain.data.tokens import DataError, file_sha256


class ByteTokenizer:
    """Byte-level: the ids of a text are its UTF-8 bytes (vocabulary 256)."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` through the optional ``tokenizers`` package.

    Documents are encoded without special tokens; the vocabulary size counts added tokens.
    """

    def __init__(self, path: str | os.PathLike):
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
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exceptions
            raise DataError(f"--tokenizer {str(path)!r}: not a tokenizer.json ({e})") from None
        self.path = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.name = f"hf:{path.resolve()} sha256:{file_sha256(path)[:16]}"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str = "byte") -> ByteTokenizer | HFTokenizer:
    """``"byte"`` or the path of a Hugging Face ``tokenizer.json`` (or a folder holding one)."""
    return ByteTokenizer() if spec in ("", "byte") else HFTokenizer(spec)
