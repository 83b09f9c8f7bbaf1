"""Token files: dtypes, the sidecar, the names beside a file, hashing and scanning.

The files themselves are Megatron-LM's indexed dataset (``<prefix>.bin`` of tokens and
``<prefix>.idx``, see ``megatron``), or a flat ``.bin`` without an index (nanoGPT's layout,
still read); ``tokenfile`` opens and writes both. This module holds what both share.

Sidecar
    ``prepare`` and ``write_tokens`` write a small JSON sidecar ``<file>.bin.json`` beside each
    token file::

        {"format": "ratrain-tokens/1", "layout": "megatron", "vocab_size": 256,
         "dtype": "uint16", "tokenizer": "byte", "num_tokens": 123, "documents": 4,
         "sha256": "...", "source": "...", "split": "train", "eot": null}

    ``prepare`` adds ``eot`` (the id that ends each document, or null), for a Hugging Face
    tokenizer ``tokenizer_path`` and ``tokenizer_sha256``, and what it read: ``inputs`` (each
    path given and its bytes), ``field``, ``bytes_read``, ``skipped_records`` with the first
    few (``skipped_examples``: file, line and why), ``skipped_files`` (folder members not
    UTF-8) and ``held_out`` (``split``, ``fraction``, ``seed``). A file without a sidecar (plain nanoGPT, or
    Megatron's own) is read as its index says, else as ``uint16`` unless the caller says
    ``dtype="uint32"``; a hand-written sidecar holding only ``{"dtype": "uint32"}`` also works.

Names
    ``sidecar_path(f)`` is ``<f>.json``. ``val_path(f)`` is the held-out split beside a train
    file: a file called ``train<rest>`` gets ``val<rest>`` (nanoGPT's ``train.bin`` /
    ``val.bin``), any other name gets ``.val`` before its suffix (``corpus.bin`` ->
    ``corpus.val.bin``); the same for a Megatron prefix (``data/x/train`` -> ``data/x/val``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ratrain.config import ConfigError
from ratrain.fileio import atomic_write

FORMAT = "ratrain-tokens/1"
_SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning a file for its largest id


class DataError(ConfigError):
    """Bad data or a data / config mismatch: the message names the value and the fix."""


# --------------------------------------------------------------------------------------------
# dtype, names, sidecar
# --------------------------------------------------------------------------------------------


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """``uint16`` when every id of the vocabulary fits, else ``uint32`` (nanoGPT's choice; the
    Megatron layout takes int32 instead, ``megatron.megatron_dtype``)."""
    if vocab_size < 1:
        raise DataError(f"vocab_size={vocab_size} must be >= 1")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


_DTYPES = {"uint8": "|u1", "int8": "|i1", "int16": "<i2", "uint16": "<u2", "int32": "<i4",
           "uint32": "<u4", "int64": "<i8"}  # token dtypes by name (Megatron's integers, uint32)


def parse_dtype(value: Any, where: str) -> np.dtype:
    """A token dtype from its name (``uint16``, ``u2``, ``<u2``, ``int32``, ...) or a numpy dtype."""
    key = value if isinstance(value, str) else np.dtype(value).str
    for name, code in _DTYPES.items():
        if key in (name, code, code[1:], code.replace("|", "<")):
            return np.dtype(code)
    raise DataError(f"{where}: dtype {value!r} is not a token dtype; use one of "
                    f"{', '.join(_DTYPES)}")


def dtype_name(dtype: np.dtype) -> str:
    """``uint16``, ``int32``, ...: a token dtype as the sidecar names it."""
    code = np.dtype(dtype).str
    return next(n for n, c in _DTYPES.items() if c == code or c == code.replace("<", "|"))


def sidecar_path(path: str | os.PathLike) -> Path:
    """The JSON sidecar of a token file: ``<file>.json``."""
    return Path(str(path) + ".json")


def val_path(path: str | os.PathLike) -> Path:
    """The held-out split beside a train file: ``train<rest>`` -> ``val<rest>``, else
    ``<stem>.val<suffix>`` (``data/x/train.bin`` -> ``data/x/val.bin``, ``c.bin`` -> ``c.val.bin``)."""
    p = Path(path)
    if p.name.startswith("train"):
        return p.with_name("val" + p.name[len("train"):])
    return p.with_name(f"{p.stem}.val{p.suffix}")


def read_meta(path: str | os.PathLike) -> dict | None:
    """The sidecar of `path` as a dict, or None when there is none (a plain nanoGPT file)."""
    side = sidecar_path(path)
    if not side.exists():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        raise DataError(
            f"{side}: not a readable JSON sidecar ({e}); fix or delete it (a token file without "
            "a sidecar is read as uint16)"
        ) from None
    if not isinstance(meta, dict):
        raise DataError(f"{side}: the sidecar must be a JSON object, got {type(meta).__name__}")
    return meta


def write_meta(path: str | os.PathLike, meta: dict) -> None:
    """Write the sidecar of token file `path` (atomically)."""
    atomic_write(sidecar_path(path), json.dumps(meta, indent=1) + "\n")


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def token_meta(num_tokens: int, sha256: str, vocab_size: int, tokenizer: str, source: str,
               split: str, extra: dict | None = None, dtype=None, layout: str = "nanogpt") -> dict:
    """The sidecar of a token file of `num_tokens` ids of `dtype` (default: ``dtype_for_vocab``)
    whose bytes hash to `sha256`; `layout`: ``megatron`` (an .idx beside it) or ``nanogpt`` (a flat file);
    `extra`: what prepare adds (the tokenizer's path and SHA-256, the end-of-text id, ...)."""
    dtype = dtype_for_vocab(vocab_size) if dtype is None else np.dtype(dtype)
    return {
        "format": FORMAT,
        "layout": layout,
        "vocab_size": int(vocab_size),
        "dtype": dtype_name(dtype),
        "tokenizer": tokenizer,
        "num_tokens": int(num_tokens),
        "sha256": sha256,
        "source": source,
        "split": split,
        **(extra or {}),
    }


def file_meta(path: str | os.PathLike, vocab_size: int, tokenizer: str, source: str,
              split: str, extra: dict | None = None, dtype=None, layout: str = "nanogpt") -> dict:
    """The sidecar of the token file at `path` (its size and SHA-256 read from disk)."""
    dt = dtype_for_vocab(vocab_size) if dtype is None else np.dtype(dtype)
    n = os.path.getsize(path) // dt.itemsize
    return token_meta(n, file_sha256(path), vocab_size, tokenizer, source, split, extra, dt,
                      layout)


# --------------------------------------------------------------------------------------------
# Scanning
# --------------------------------------------------------------------------------------------


def scan_max_id(tokens: np.ndarray, limit: int | None = None) -> tuple[int, int | None]:
    """The largest id of `tokens` (chunked, for a memmap) and the first position of an id
    >= `limit` or below 0 (None when there is none or no limit)."""
    best, first = -1, None
    for lo in range(0, len(tokens), _SCAN_CHUNK):
        chunk = np.asarray(tokens[lo: lo + _SCAN_CHUNK])
        m = int(chunk.max())
        best = max(best, m)
        bad_low = chunk.dtype.kind == "i" and int(chunk.min()) < 0
        if limit is not None and first is None and (m >= limit or bad_low):
            first = lo + int(np.argmax((chunk >= limit) | (chunk < 0)))
    return best, first
