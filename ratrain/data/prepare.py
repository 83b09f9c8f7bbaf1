"""``prepare``: text files and folders (or the default corpus) -> a train token file and its
held-out split.

Where the files go
    ``prepare --out PATH`` writes the training tokens to ``PATH`` and the held-out split beside
    it, named by ``val_path(PATH)`` (``data.eval_tokens: ""`` means that file, when it exists).
    ``--out`` naming a directory (no suffix) means ``DIR/train.bin``. Without ``--out`` the
    tokens go to ``data/<name>/train.bin`` under the current directory, ``<name>`` being
    ``stdlib`` for the default corpus and the first input's stem otherwise (``-<tokenizer dir>``
    appended for a Hugging Face tokenizer).

Documents
    Each input file is one document. With ``eot`` (``--eot``) every document is followed by an
    end-of-text id, so the model learns where one text ends and the next begins: ``auto`` (the
    default) is the tokenizer's end-of-text token (``<|endoftext|>``, ``</s>``, ...; see
    ``tokenizer.EOT_TOKENS``) for a Hugging Face tokenizer, and nothing for ``byte`` (its 256
    ids are all bytes; ``--eot 0`` uses NUL, which text never holds); ``none`` concatenates the
    documents; an integer is that id. The sidecar records it (``eot``), with the tokenizer's
    path and SHA-256, which a run then records in its config (``data.tokenizer``).

The held-out split is the last ``val_fraction`` of the token stream. Every file goes through
``ratrain.fileio`` (temporary name, fsync, rename): the held-out split and its sidecar first,
the train file next, the train sidecar last, so the train sidecar marks a finished prepare and
an interrupted run never leaves a damaged file. Deterministic: same inputs, same bytes.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ratrain.data.sources import (
    DEFAULT_CORPUS_BYTES,
    stdlib_documents,
    stdlib_files,
    text_documents,
)
from ratrain.data.tokenizer import EOT_TOKENS, load_tokenizer
from ratrain.data.tokens import (
    DataError,
    dtype_for_vocab,
    dtype_name,
    file_meta,
    sidecar_path,
    val_path,
    write_meta,
    write_tokens,
)
from ratrain.fileio import atomic_path

DEFAULT_VAL_FRACTION = 0.05


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` wrote."""

    train: Path
    val: Path | None
    num_train: int
    num_val: int
    vocab_size: int
    documents: int
    skipped: tuple[str, ...] = ()


def default_out(inputs: list[str], tokenizer: str = "byte", root: str | os.PathLike = "data"):
    """Where ``prepare`` writes without ``--out``: ``data/<name>/train.bin`` (see module doc)."""
    name = "stdlib" if not inputs else (Path(inputs[0]).resolve().stem or "corpus")
    if tokenizer not in ("", "byte"):
        t = Path(tokenizer)
        name += "-" + (t.name if t.is_dir() else t.resolve().parent.name or "hf")
    return Path(root) / name / "train.bin"


def _resolve_out(out: str | os.PathLike | None, inputs: list[str], tokenizer: str) -> Path:
    if out is None or str(out) == "":
        return default_out(inputs, tokenizer)
    p = Path(out)
    if p.is_dir() or str(out).endswith(("/", os.sep)) or not p.suffix:
        return p / "train.bin"
    return p


def _documents(inputs: list[str], max_bytes: int | None, skipped: list[str]):
    """The (name, text) documents to tokenize, and the sidecars' description of them."""
    if inputs:
        for item in inputs:
            if not Path(item).exists():
                raise DataError(f"input {item!r} does not exist: give text files or folders")
        return text_documents(inputs, max_bytes, skipped), "text: " + ", ".join(inputs)
    cap = DEFAULT_CORPUS_BYTES if max_bytes is None else max_bytes
    root, files = stdlib_files(cap)
    source = (
        f"python {platform.python_version()} stdlib .py sources ({len(files)} files, "
        f"sorted, cap {cap} bytes)"
    )
    return stdlib_documents(files, root), source


def resolve_eot(eot, tok, log=None) -> int | None:
    """The id that ends each document (see the module doc), or None."""
    if eot in (None, "none"):
        return None
    if eot == "auto":
        if tok.name != "byte" and tok.eot_id is None and log is not None:
            log(f"warning: {tok.spec} has no end-of-text special token ({', '.join(EOT_TOKENS)}):"
                " documents are concatenated; give --eot ID to separate them")
        return tok.eot_id
    try:
        i = int(eot)
    except (TypeError, ValueError):
        raise DataError(f"--eot={eot!r}: give auto, none or a token id") from None
    if not 0 <= i < tok.vocab_size:
        raise DataError(f"--eot={i} is outside the vocabulary [0, {tok.vocab_size}) of tokenizer "
                        f"{tok.spec}")
    return i


def _encode_into(tmp: str, docs, tok, dtype: np.dtype, eot: int | None) -> int:
    """Tokenize every document into the file `tmp`, in order, each followed by `eot` (unless
    None); return how many there were."""
    n_docs = 0
    end = np.array([] if eot is None else [eot], dtype)
    with open(tmp, "wb") as f:
        for _name, text in docs:
            ids = tok.encode(text)
            if ids.size and int(ids.max()) >= tok.vocab_size:  # pragma: no cover - defensive
                raise DataError(f"tokenizer gave id {int(ids.max())} >= {tok.vocab_size}")
            f.write(ids.astype(dtype).tobytes())
            f.write(end.tobytes())
            n_docs += 1
    return n_docs


def _meta_extra(tok, eot: int | None) -> dict:
    """What prepare adds to a sidecar: the end-of-text id, the tokenizer's path and hash."""
    extra = {"eot": eot}
    if tok.sha256:
        extra.update(tokenizer_path=tok.spec, tokenizer_sha256=tok.sha256)
    return extra


def _val_tokens(n: int, val_fraction: float, inputs: list[str]) -> int:
    """How many of the `n` tokens the held-out split takes (at least one when asked for)."""
    if n == 0:
        what = ", ".join(inputs) if inputs else "the default corpus"
        raise DataError(f"{what} gave no tokens (no readable UTF-8 text): nothing to prepare")
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    if n_val >= n:
        raise DataError(f"--val-fraction={val_fraction} of {n} tokens leaves no training data")
    return n_val


def _split_off(tmp: str, val: Path, keep: int, dtype: np.dtype, tok, source: str,
               extra: dict) -> None:
    """Move the tokens of `tmp` after the first `keep` into the held-out file `val` (and its
    sidecar); `tmp` keeps the first `keep`."""
    mm = np.memmap(tmp, dtype=dtype, mode="r")
    write_tokens(val, mm[keep:], tok.vocab_size, tok.name, source, "val", extra)
    del mm  # no view of the file may outlive its truncation
    with open(tmp, "r+b") as f:
        f.truncate(keep * dtype.itemsize)


def _write_splits(train: Path, docs, tok, source: str, val_fraction: float,
                  inputs: list[str], eot: int | None) -> tuple[int, int, int]:
    """Write the train file and its held-out split; return (tokens, held-out tokens, documents)."""
    dtype = dtype_for_vocab(tok.vocab_size)
    val = val_path(train)
    extra = _meta_extra(tok, eot)
    with atomic_path(train) as tmp:
        n_docs = _encode_into(tmp, docs, tok, dtype, eot)
        n = os.path.getsize(tmp) // dtype.itemsize
        n_val = _val_tokens(n, val_fraction, inputs)
        if n_val:
            _split_off(tmp, val, n - n_val, dtype, tok, source, extra)
        else:  # a stale split from an earlier prepare would be taken for this file's
            for stale in (val, sidecar_path(val)):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
        train_meta = file_meta(tmp, tok.vocab_size, tok.name, source, "train", extra)
        with contextlib.suppress(FileNotFoundError):
            sidecar_path(train).unlink()
    write_meta(train, train_meta)  # last: the mark of a finished prepare
    return n, n_val, n_docs


def prepare(
    inputs: Iterable[str] = (),
    out: str | os.PathLike | None = None,
    tokenizer: str = "byte",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    max_bytes: int | None = None,
    log=None,
    eot: str | int | None = "auto",
) -> Prepared:
    """Tokenize text files / folders (or, with no inputs, the default corpus) into a train file
    and a held-out split beside it (the last `val_fraction` of the token stream).

    Folders are read recursively in sorted order; every file is read as UTF-8 (folder members that
    are not UTF-8 are skipped and reported; a named file that is not is an error). `max_bytes`
    caps the text read (default: ``DEFAULT_CORPUS_BYTES`` for the default corpus, no cap
    otherwise). `eot`: what ends each document (``auto``, ``none`` or an id; module doc).
    Every file is written to a temporary name and renamed into place, so an
    interrupted run never leaves a damaged file. Deterministic: same inputs, same bytes.
    """
    inputs = [str(i) for i in inputs]
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(
            f"--val-fraction={val_fraction} must be in [0, 1), e.g. 0.05 (0 = no held-out split)"
        )
    if max_bytes is not None and max_bytes < 1:
        raise DataError(f"--max-bytes={max_bytes} must be >= 1")
    tok = load_tokenizer(tokenizer)  # errors about the tokenizer come before any reading
    eot_id = resolve_eot(eot, tok, log)
    train = _resolve_out(out, inputs, tokenizer)
    skipped: list[str] = []
    docs, source = _documents(inputs, max_bytes, skipped)
    made = [d for d in (train.parent, *train.parent.parents) if not d.exists()]
    train.parent.mkdir(parents=True, exist_ok=True)
    try:
        n, n_val, n_docs = _write_splits(train, docs, tok, source, val_fraction, inputs, eot_id)
    except BaseException:
        for d in made:  # innermost first; only folders this call made, and only if empty
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    val = val_path(train) if n_val else None
    result = Prepared(train, val, n - n_val, n_val, tok.vocab_size, n_docs, tuple(skipped))
    if log is not None:
        log(
            f"prepared {result.num_train} train tokens -> {train}"
            + (f", {n_val} val tokens -> {val}" if n_val else "")
            + f" ({n_docs} documents, tokenizer {tok.name}, vocab {tok.vocab_size}, "
            f"{dtype_name(dtype_for_vocab(tok.vocab_size))}, "
            + (f"end-of-text id {eot_id} after each document)" if eot_id is not None
               else "documents concatenated, no end-of-text id)")
        )
        if skipped:
            log(f"skipped {len(skipped)} non-UTF-8 files (first: {skipped[0]})")
    return result
