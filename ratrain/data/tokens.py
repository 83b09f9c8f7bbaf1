"""Token files: the format, the sidecar, the names beside a file, writing, opening, scanning.

Format
    A token file is a flat little-endian array of token ids: ``uint16`` when the vocabulary fits
    (``vocab_size <= 65536``), else ``uint32``. This is nanoGPT's ``.bin`` layout, so existing
    nanoGPT files load as they are. ``prepare`` and ``write_tokens`` also write a small JSON
    sidecar ``<file>.json`` beside each token file::

        {"format": "ratrain-tokens/1", "vocab_size": 256, "dtype": "uint16", "tokenizer": "byte",
         "num_tokens": 123, "sha256": "...", "source": "...", "split": "train", "eot": null}

    ``prepare`` adds ``eot`` (the id that ends each document, or null) and, for a Hugging Face
    tokenizer, ``tokenizer_path`` and ``tokenizer_sha256``.

    A file without a sidecar (plain nanoGPT) is read as ``uint16`` unless the caller says
    ``dtype="uint32"``; a hand-written sidecar holding only ``{"dtype": "uint32"}`` also works.

Names
    ``sidecar_path(f)`` is ``<f>.json``. ``val_path(f)`` is the held-out split beside a train
    file: a file called ``train<rest>`` gets ``val<rest>`` (nanoGPT's ``train.bin`` /
    ``val.bin``), any other name gets ``.val`` before its suffix (``corpus.bin`` ->
    ``corpus.val.bin``).

Writing
    Every file goes through ``ratrain.fileio`` (temporary name beside it, fsync, rename), the
    token file before its sidecar, so a sidecar always describes a complete file.
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
    """``uint16`` when every id of the vocabulary fits, else ``uint32`` (little-endian)."""
    if vocab_size < 1:
        raise DataError(f"vocab_size={vocab_size} must be >= 1")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def parse_dtype(value: Any, where: str) -> np.dtype:
    """A token dtype from its name (``uint16``, ``u2``, ``<u2``, ...) or a numpy dtype."""
    names = {"uint16": "<u2", "u2": "<u2", "<u2": "<u2", "uint32": "<u4", "u4": "<u4", "<u4": "<u4"}
    key = value if isinstance(value, str) else np.dtype(value).str
    if key not in names:
        raise DataError(f"{where}: dtype {value!r} is not a token dtype; use uint16 or uint32")
    return np.dtype(names[key])


def dtype_name(dtype: np.dtype) -> str:
    """``uint16`` or ``uint32``: a token dtype as the sidecar names it."""
    return {"<u2": "uint16", "<u4": "uint32"}[np.dtype(dtype).str]


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
               split: str, extra: dict | None = None) -> dict:
    """The sidecar of a token file of `num_tokens` ids whose bytes hash to `sha256` (`extra`:
    what prepare adds: the tokenizer's path and SHA-256, the end-of-text id)."""
    return {
        "format": FORMAT,
        "vocab_size": int(vocab_size),
        "dtype": dtype_name(dtype_for_vocab(vocab_size)),
        "tokenizer": tokenizer,
        "num_tokens": int(num_tokens),
        "sha256": sha256,
        "source": source,
        "split": split,
        **(extra or {}),
    }


def file_meta(path: str | os.PathLike, vocab_size: int, tokenizer: str, source: str,
              split: str, extra: dict | None = None) -> dict:
    """The sidecar of the token file at `path` (its size and SHA-256 read from disk)."""
    n = os.path.getsize(path) // dtype_for_vocab(vocab_size).itemsize
    return token_meta(n, file_sha256(path), vocab_size, tokenizer, source, split, extra)


def write_tokens(
    path: str | os.PathLike,
    ids: np.ndarray,
    vocab_size: int,
    tokenizer: str = "byte",
    source: str = "",
    split: str = "",
    extra: dict | None = None,
) -> dict:
    """Write `ids` as a token file plus its sidecar, each atomically (temp name, then rename).

    The token file is renamed into place before its sidecar, so a sidecar always describes a
    complete file. Returns the sidecar dict.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise DataError(
            f"write_tokens({path}): ids span [{ids.min()}, {ids.max()}], outside the vocabulary "
            f"[0, {vocab_size})"
        )
    raw = np.ascontiguousarray(ids, dtype=dtype).tobytes()
    meta = token_meta(len(raw) // dtype.itemsize, hashlib.sha256(raw).hexdigest(), vocab_size,
                      tokenizer, source, split, extra)
    atomic_write(path, raw)
    write_meta(path, meta)
    return meta


# --------------------------------------------------------------------------------------------
# Opening and scanning
# --------------------------------------------------------------------------------------------


def _file_dtype(path: Path, dtype, meta: dict | None, label: str) -> np.dtype:
    """The dtype asked for (checked against the sidecar), else the sidecar's, else uint16."""
    if dtype is not None:
        dt = parse_dtype(dtype, label)
        if meta and "dtype" in meta and parse_dtype(meta["dtype"], str(path)) != dt:
            raise DataError(
                f"{label}={str(path)!r}: dtype {dtype_name(dt)} was asked for but the sidecar "
                f"{sidecar_path(path)} says {meta['dtype']}: drop the argument or fix the sidecar"
            )
        return dt
    if meta and "dtype" in meta:
        return parse_dtype(meta["dtype"], str(sidecar_path(path)))
    return np.dtype("<u2")


def open_tokens(path, dtype, label: str) -> tuple[Path, np.dtype, dict | None, int]:
    """Check a token file's existence, sidecar and size; return (path, dtype, meta, num_tokens)."""
    path = Path(path)
    if str(path) == "":
        raise DataError(f"{label} is empty: give a token file (python -m ratrain.data prepare)")
    if not path.exists():
        raise DataError(
            f"{label}={str(path)!r} does not exist: prepare it with python -m ratrain.data "
            "prepare TEXT... --out PATH, or fix the path"
        )
    if not path.is_file():
        raise DataError(f"{label}={str(path)!r} is not a file: give the token file itself")
    meta = read_meta(path)
    dt = _file_dtype(path, dtype, meta, label)
    size = path.stat().st_size
    if size == 0:
        raise DataError(
            f"{label}={str(path)!r} is empty (0 bytes): prepare it again with python -m "
            "ratrain.data prepare"
        )
    if size % dt.itemsize:
        raise DataError(
            f"{label}={str(path)!r} is {size} bytes, not a multiple of {dt.itemsize} "
            f"({dtype_name(dt)} ids): the file is truncated or not a token file"
            + ("" if meta else "; if it holds uint32 ids, write a sidecar "
               f"{sidecar_path(path).name} containing {{\"dtype\": \"uint32\"}}")
        )
    n = size // dt.itemsize
    if meta and "num_tokens" in meta and int(meta["num_tokens"]) != n:
        raise DataError(
            f"{label}={str(path)!r} holds {n} tokens but its sidecar says {meta['num_tokens']}: "
            "the file changed after it was prepared; prepare it again"
        )
    return path, dt, meta, n


def scan_max_id(tokens: np.ndarray, limit: int | None = None) -> tuple[int, int | None]:
    """The largest id of `tokens` (chunked, for a memmap) and the first position of an id
    >= `limit` (None when there is none or no limit)."""
    best, first = -1, None
    for lo in range(0, len(tokens), _SCAN_CHUNK):
        chunk = np.asarray(tokens[lo: lo + _SCAN_CHUNK])
        m = int(chunk.max())
        best = max(best, m)
        if limit is not None and first is None and m >= limit:
            first = lo + int(np.argmax(chunk >= limit))
    return best, first
