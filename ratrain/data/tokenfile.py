"""Opening and writing token files: a Megatron indexed dataset, or a flat nanoGPT ``.bin``.

What a path may name (``data.tokens``, ``data.eval_tokens``, a source's ``tokens``)
    a Megatron prefix ``P`` (``P.bin`` and ``P.idx`` beside each other), either of its two
    files (``P.bin``, ``P.idx``), or a flat token file without an index (nanoGPT's ``.bin``).
    ``resolve_tokens`` says which. A file is read flat only when nothing says otherwise. A
    prefix whose ``P.idx`` is missing is an error naming it, and so is a ``.bin`` whose sidecar
    says ``"layout": "megatron"`` with no index beside it, or ``"nanogpt"`` with one. A flat
    file's dtype is its sidecar's, else uint16. ``open_tokens`` checks the files (the index
    against the ``.bin``, the sidecar against both) and returns a ``TokenFile``: the ``.bin``
    read as one token stream, its dtype, sidecar, size and index.

Writing
    ``write_tokens`` writes the one format (``layout="megatron"``: ``.bin``, ``.idx`` and the
    sidecar) or a flat file and sidecar (``layout="nanogpt"``), each file through
    ``ratrain.fileio`` (temporary name, fsync, rename), the sidecar last, so a sidecar always
    describes complete files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ratrain.data.megatron import Index, megatron_dtype, read_index, write_index
from ratrain.data.tokens import (
    DataError,
    dtype_for_vocab,
    dtype_name,
    parse_dtype,
    read_meta,
    sidecar_path,
    token_meta,
    val_path,
    write_meta,
)
from ratrain.fileio import atomic_path, atomic_write

LAYOUTS = ("megatron", "nanogpt")


@dataclass(frozen=True)
class TokenFile:
    """An opened token file: the ``.bin`` (one token stream) and what describes it."""

    path: Path  # the .bin
    dtype: np.dtype
    meta: dict | None  # the sidecar, or None
    num_tokens: int
    index: Index | None  # the Megatron index, or None (a flat file)

    @property
    def num_documents(self) -> int | None:
        return self.index.num_documents if self.index is not None else None


def index_path(bin_path: str | os.PathLike) -> Path:
    """The ``.idx`` beside a ``.bin`` (``P.bin`` -> ``P.idx``)."""
    p = Path(bin_path)
    return p.with_suffix(".idx") if p.suffix == ".bin" else Path(str(p) + ".idx")


def resolve_tokens(path: str | os.PathLike, label: str) -> tuple[Path, Path | None]:
    """(the ``.bin``, its ``.idx`` or None) that `path` names (see the module doc)."""
    p = Path(path)
    if str(path) == "":
        raise DataError(f"{label} is empty: give a token file (python -m ratrain.data prepare)")
    if p.suffix == ".idx":
        bin_path = p.with_suffix(".bin")
        if not p.exists():
            raise DataError(f"{label}={str(path)!r} does not exist: fix the path")
        if not bin_path.exists():
            raise DataError(f"{label}={str(path)!r}: its tokens {bin_path} do not exist: a "
                            "Megatron index needs the .bin beside it")
        return bin_path, _checked_index(bin_path, p, False, f"{label}={str(path)!r}")
    prefix = not p.exists() and Path(str(p) + ".bin").exists()
    if prefix:
        p = Path(str(p) + ".bin")
    if not p.exists():
        raise DataError(
            f"{label}={str(path)!r} does not exist: prepare it with python -m ratrain.data "
            "prepare INPUTS... --out PATH, or fix the path (a token file, or a Megatron prefix "
            "P with P.bin and P.idx)")
    if p.is_dir():
        raise DataError(f"{label}={str(path)!r} is a folder: give the token file itself (e.g. "
                        f"{p / 'train.bin'}) or a Megatron prefix")
    idx = index_path(p)
    return p, _checked_index(p, idx if idx.exists() else None, prefix, f"{label}={str(path)!r}")


def _checked_index(bin_path: Path, idx: Path | None, prefix: bool, where: str) -> Path | None:
    """`idx`, once what says how to read `bin_path` agrees with it: the sidecar's ``layout``
    when it states one, else a name given as a Megatron `prefix`."""
    layout = (read_meta(bin_path) or {}).get("layout")
    side = sidecar_path(bin_path)
    if layout not in (None, *LAYOUTS):
        raise DataError(f"{where}: its sidecar {side} says layout {layout!r}, not one of "
                        f"{', '.join(LAYOUTS)}: fix the sidecar or prepare the data again")
    if idx is None and layout == "megatron":
        raise DataError(f"{where}: its sidecar {side} says layout megatron but its index "
                        f"{index_path(bin_path)} does not exist: put the .idx written with "
                        f"{bin_path.name} beside it, or prepare the data again")
    if idx is None and prefix and layout is None:
        raise DataError(f"{where} names a Megatron prefix but its index {index_path(bin_path)} "
                        f"does not exist: put the .idx written with {bin_path.name} beside it, "
                        f"or name {bin_path} itself to read it as a flat token file")
    if layout == "nanogpt" and idx is not None:
        raise DataError(f"{where}: its sidecar {side} says layout nanogpt (a flat file) but an "
                        f"index {idx} lies beside it: remove the stale index, or prepare the data "
                        "again")
    return idx


def held_out_beside(bin_path: Path, idx: Path | None, key: str) -> Path:
    """The held-out split beside a train file (``val_path``). Beside a Megatron train file (`idx`
    given) an existing one needs its index too, unless its sidecar says it is flat; `key` names
    where to give it instead (DataError otherwise)."""
    v = val_path(bin_path)
    if idx is not None and v.exists() and not index_path(v).exists() \
            and (read_meta(v) or {}).get("layout") != "nanogpt":
        raise DataError(f"{v}, the held-out split beside {bin_path}, has no index "
                        f"{index_path(v)} though the train file has one: put the .idx written "
                        f"with {v.name} beside it, or set {key}={v} to read it as a flat token "
                        "file")
    return v


def _file_dtype(path: Path, dtype, meta: dict | None, index: Index | None,
                label: str) -> np.dtype:
    """The index's dtype, else the one asked for, else the sidecar's, else uint16; any two that
    are given must agree."""
    told = [(f"the index {index.path}", index.dtype)] if index is not None else []
    if dtype is not None:
        told.append(("the argument", parse_dtype(dtype, label)))
    if meta and "dtype" in meta:
        told.append((f"the sidecar {sidecar_path(path)}",
                     parse_dtype(meta["dtype"], str(sidecar_path(path)))))
    for who, dt in told[1:]:
        if dt != told[0][1]:
            raise DataError(
                f"{label}={str(path)!r}: {told[0][0]} says {dtype_name(told[0][1])} but {who} "
                f"says {dtype_name(dt)}: drop the wrong one or prepare the data again")
    return told[0][1] if told else np.dtype("<u2")


def open_tokens(path, dtype, label: str) -> TokenFile:
    """Check a token file (or Megatron prefix): its existence, index, sidecar and size."""
    bin_path, idx = resolve_tokens(path, label)
    index = read_index(idx, bin_path) if idx is not None else None
    meta = read_meta(bin_path)
    dt = _file_dtype(bin_path, dtype, meta, index, label)
    size = bin_path.stat().st_size
    if size == 0:
        raise DataError(f"{label}={str(path)!r} is empty (0 bytes): prepare it again with "
                        "python -m ratrain.data prepare")
    if size % dt.itemsize:
        raise DataError(
            f"{label}={str(path)!r} is {size} bytes, not a multiple of {dt.itemsize} "
            f"({dtype_name(dt)} ids): the file is truncated or not a token file"
            + ("" if meta else "; if it holds uint32 ids, write a sidecar "
               f"{sidecar_path(bin_path).name} containing {{\"dtype\": \"uint32\"}}"))
    n = size // dt.itemsize
    if meta and "num_tokens" in meta and int(meta["num_tokens"]) != n:
        raise DataError(
            f"{label}={str(path)!r} holds {n} tokens but its sidecar says {meta['num_tokens']}: "
            "the file changed after it was prepared; prepare it again")
    return TokenFile(bin_path, dt, meta, n, index)


def write_tokens(
    path: str | os.PathLike,
    ids: np.ndarray,
    vocab_size: int,
    tokenizer: str = "byte",
    source: str = "",
    split: str = "",
    extra: dict | None = None,
    *,
    layout: str = "megatron",
    doc_lengths=None,
) -> dict:
    """Write `ids` as a token file plus its sidecar, each atomically: ``layout="megatron"``
    (the default: ``P.bin`` and ``P.idx`` for `path` ``P.bin``; `doc_lengths` the tokens of
    each document, default one document of all) or ``"nanogpt"`` (a flat ``.bin``, no index). The token
    files are renamed into place before the sidecar. Returns the sidecar dict."""
    if layout not in LAYOUTS:
        raise DataError(f"layout={layout!r} is not one of {', '.join(LAYOUTS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise DataError(
            f"write_tokens({path}): ids span [{ids.min()}, {ids.max()}], outside the vocabulary "
            f"[0, {vocab_size})")
    dtype = megatron_dtype(vocab_size) if layout == "megatron" else dtype_for_vocab(vocab_size)
    raw = np.ascontiguousarray(ids, dtype=dtype).tobytes()
    lengths = np.asarray([ids.size] if doc_lengths is None else doc_lengths, dtype=np.int64)
    if int(lengths.sum()) != ids.size:
        raise DataError(f"write_tokens({path}): doc_lengths add up to {int(lengths.sum())}, "
                        f"not the {ids.size} ids")
    meta = token_meta(ids.size, hashlib.sha256(raw).hexdigest(), vocab_size, tokenizer, source,
                      split, {"documents": int(lengths.size), **(extra or {})}, dtype, layout)
    with contextlib.suppress(FileNotFoundError):
        sidecar_path(path).unlink()  # no sidecar may describe files half replaced
    atomic_write(path, raw)
    if layout == "megatron":
        with atomic_path(index_path(path)) as tmp:
            write_index(tmp, dtype, lengths)
    else:
        with contextlib.suppress(FileNotFoundError):
            index_path(path).unlink()  # a stale index would be taken for this file's
    write_meta(path, meta)
    return meta


__all__ = ["LAYOUTS", "TokenFile", "held_out_beside", "index_path", "open_tokens", "resolve_tokens",
           "write_tokens"]
