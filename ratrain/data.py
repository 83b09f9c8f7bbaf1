"""Token files, the default corpus, and the batches of the design's data contract.

Token files
    A token file is a flat little-endian array of token ids: ``uint16`` when the vocabulary fits
    (``vocab_size <= 65536``), else ``uint32``. This is nanoGPT's ``.bin`` layout, so existing
    nanoGPT files load as they are. ``prepare`` also writes a small JSON sidecar ``<file>.json``
    beside each token file::

        {"format": "ratrain-tokens/1", "vocab_size": 256, "dtype": "uint16", "tokenizer": "byte",
         "num_tokens": 123, "sha256": "...", "source": "...", "split": "train"}

    A file without a sidecar (plain nanoGPT) is read as ``uint16`` unless the caller says
    ``dtype="uint32"``; a hand-written sidecar holding only ``{"dtype": "uint32"}`` also works.

File naming
    ``prepare --out PATH`` writes the training tokens to ``PATH`` and the held-out split beside it,
    named by ``val_path(PATH)``: a file called ``train<rest>`` gets ``val<rest>`` (nanoGPT's
    ``train.bin`` / ``val.bin``), any other name gets ``.val`` before its suffix
    (``corpus.bin`` -> ``corpus.val.bin``). ``data.eval_tokens: ""`` means that file, when it exists.
    ``--out`` naming a directory (no suffix) means ``DIR/train.bin``. Without ``--out`` the tokens
    go to ``data/<name>/train.bin`` under the current directory, ``<name>`` being ``stdlib`` for
    the default corpus and the first input's stem otherwise (``-<tokenizer dir>`` appended for a
    Hugging Face tokenizer).

Batches (``TokenDataset``)
    The file is cut into ``W = num_tokens // (seq_len + 1)`` consecutive non-overlapping windows of
    ``seq_len + 1`` tokens (a remainder shorter than a window is never read); a window gives
    ``input = window[:-1]`` and ``target = window[1:]``. Windows are consumed as one endless stream:
    stream position ``k`` is window ``k mod W`` of epoch ``k // W`` (``order: sequential``), or
    window ``perm_e[k mod W]`` where ``perm_e = default_rng([seed, e]).permutation(W)``
    (``order: shuffled``). When the data runs out the stream wraps round to the start: a new epoch.
    Step ``s`` takes stream positions ``[s*G, (s+1)*G)`` with ``G = micro_batch * num_micro_batches
    * dp``; replica ``r`` takes the contiguous share ``[s*G + r*M*B, s*G + (r+1)*M*B)`` (``M``
    micro-batches of ``B`` windows) and micro-batch ``i`` of that replica the ``B`` positions from
    ``s*G + r*M*B + i*B``. The global batch of a step is therefore the same for every ``dp``.
    Every batch is a pure function of (file, seq_len, order, seed, layout, step): random access,
    so resuming at step ``s`` replays nothing, and the data state a checkpoint needs is just the
    step (plus order and seed, which are in the config; see ``TokenDataset.state_dict``).
    Batches are ``int64`` arrays.

Eval
    ``eval_batches(ds, n)`` are the first ``n`` sequential batches of the held-out file (windows
    from 0, in file order, whatever ``data.order`` says), wrapping if the file is short.

CLI::

    python -m ratrain.data prepare                        # default corpus -> data/stdlib/train.bin
    python -m ratrain.data prepare notes/ a.txt --out data/mine/train.bin --val-fraction 0.1
    python -m ratrain.data prepare docs/ --tokenizer path/to/tokenizer.json
    python -m ratrain.data info data/stdlib/train.bin
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ratrain.config import Config, ConfigError

FORMAT = "ratrain-tokens/1"
DEFAULT_CORPUS_BYTES = 8_000_000  # about 8 MB of Python source: the default corpus
DEFAULT_VAL_FRACTION = 0.05
_SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning a file for its largest id
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


class DataError(ConfigError):
    """Bad data or a data / config mismatch: the message names the value and the fix."""


# --------------------------------------------------------------------------------------------
# Token files: dtype, sidecar, naming
# --------------------------------------------------------------------------------------------


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """``uint16`` when every id of the vocabulary fits, else ``uint32`` (little-endian)."""
    if vocab_size < 1:
        raise DataError(f"vocab_size={vocab_size} must be >= 1")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _parse_dtype(value: Any, where: str) -> np.dtype:
    names = {"uint16": "<u2", "u2": "<u2", "<u2": "<u2", "uint32": "<u4", "u4": "<u4", "<u4": "<u4"}
    key = value if isinstance(value, str) else np.dtype(value).str
    if key not in names:
        raise DataError(f"{where}: dtype {value!r} is not a token dtype; use uint16 or uint32")
    return np.dtype(names[key])


def _dtype_name(dtype: np.dtype) -> str:
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


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _mkstemp(path: Path) -> tuple[int, str]:
    """A temporary file beside `path` (same file system, so a rename is atomic), mode 0644."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; token files are shared by every rank and user
    return fd, tmp


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = _mkstemp(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_tokens(
    path: str | os.PathLike,
    ids: np.ndarray,
    vocab_size: int,
    tokenizer: str = "byte",
    source: str = "",
    split: str = "",
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
    fd, tmp = _mkstemp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(np.ascontiguousarray(ids, dtype=dtype).tobytes())
        meta = _meta(tmp, vocab_size, tokenizer, source, split)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _atomic_write_text(sidecar_path(path), json.dumps(meta, indent=1) + "\n")
    return meta


def _meta(tmp: str | Path, vocab_size: int, tokenizer: str, source: str, split: str) -> dict:
    dtype = dtype_for_vocab(vocab_size)
    return {
        "format": FORMAT,
        "vocab_size": int(vocab_size),
        "dtype": _dtype_name(dtype),
        "tokenizer": tokenizer,
        "num_tokens": os.path.getsize(tmp) // dtype.itemsize,
        "sha256": file_sha256(tmp),
        "source": source,
        "split": split,
    }


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


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
            import tokenizers
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


# --------------------------------------------------------------------------------------------
# Text sources
# --------------------------------------------------------------------------------------------


def _walk(folder: Path) -> list[Path]:
    """Regular files under `folder`, recursively, hidden ones and __pycache__ left out, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        out += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(out, key=lambda p: p.relative_to(folder).as_posix())


def _text_documents(inputs: list[str], max_bytes: int | None, skipped: list[str]):
    taken = 0
    for item in inputs:
        p = Path(item)
        explicit = p.is_file()
        for f in [p] if explicit else _walk(p):
            if max_bytes is not None and taken >= max_bytes:
                return
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if explicit:
                    raise DataError(
                        f"input {item!r} is not UTF-8 text ({e.reason} at byte {e.start}): "
                        "convert it to UTF-8 or leave it out"
                    ) from None
                skipped.append(str(f))
                continue
            taken += len(raw)
            yield str(f), text


def stdlib_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> tuple[Path, list[Path]]:
    """The default corpus's files: the standard library's ``.py`` sources (installed packages
    and test suites left out), sorted by relative path, taken while the total is under
    `max_bytes` (the last one may cross it). Deterministic for a given Python installation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(
            f"the Python standard library was not found at {root}: the default corpus needs its "
            "sources; prepare your own text with python -m ratrain.data prepare FILES --out PATH"
        )
    rel = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith(".")]
        rel += [Path(dirpath, f).relative_to(root) for f in filenames if f.endswith(".py")]
    rel.sort(key=lambda p: p.as_posix())
    out, total = [], 0
    for r in rel:
        if total >= max_bytes:
            break
        f = root / r
        raw = f.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(f)
        total += len(raw)
    return root, out


def _stdlib_documents(files: list[Path], root: Path):
    for f in files:
        yield f.relative_to(root).as_posix(), f.read_bytes().decode("utf-8")


# --------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------


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


def prepare(
    inputs: Iterable[str] = (),
    out: str | os.PathLike | None = None,
    tokenizer: str = "byte",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    max_bytes: int | None = None,
    log=None,
) -> Prepared:
    """Tokenize text files / folders (or, with no inputs, the default corpus) into a train file
    and a held-out split beside it (the last `val_fraction` of the token stream).

    Folders are read recursively in sorted order; every file is read as UTF-8 (folder members that
    are not UTF-8 are skipped and reported; a named file that is not is an error). `max_bytes`
    caps the text read (default: ``DEFAULT_CORPUS_BYTES`` for the default corpus, no cap
    otherwise). Every file is written to a temporary name and renamed into place, so an
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
    train = _resolve_out(out, inputs, tokenizer)
    val = val_path(train)
    skipped: list[str] = []
    if inputs:
        for item in inputs:
            if not Path(item).exists():
                raise DataError(f"input {item!r} does not exist: give text files or folders")
        docs = _text_documents(inputs, max_bytes, skipped)
        source = "text: " + ", ".join(inputs)
    else:
        cap = DEFAULT_CORPUS_BYTES if max_bytes is None else max_bytes
        root, files = stdlib_files(cap)
        docs = _stdlib_documents(files, root)
        source = (
            f"python {platform.python_version()} stdlib .py sources ({len(files)} files, "
            f"sorted, cap {cap} bytes)"
        )

    train.parent.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(tok.vocab_size)
    fd, tmp = _mkstemp(train)
    tmp_val = None
    try:
        n_docs = 0
        with os.fdopen(fd, "wb") as f:
            for _name, text in docs:
                ids = tok.encode(text)
                if ids.size and int(ids.max()) >= tok.vocab_size:  # pragma: no cover - defensive
                    raise DataError(f"tokenizer gave id {int(ids.max())} >= {tok.vocab_size}")
                f.write(ids.astype(dtype).tobytes())
                n_docs += 1
        n = os.path.getsize(tmp) // dtype.itemsize
        if n == 0:
            what = ", ".join(inputs) if inputs else "the default corpus"
            raise DataError(f"{what} gave no tokens (no readable UTF-8 text): nothing to prepare")
        n_val = round(n * val_fraction)
        if val_fraction > 0 and n_val == 0:
            n_val = 1
        if n_val >= n:
            raise DataError(f"--val-fraction={val_fraction} of {n} tokens leaves no training data")
        if n_val:
            fdv, tmp_val = _mkstemp(val)
            mm = np.memmap(tmp, dtype=dtype, mode="r")
            with os.fdopen(fdv, "wb") as fv:
                fv.write(np.asarray(mm[n - n_val:]).tobytes())
            del mm
            with open(tmp, "r+b") as f:
                f.truncate((n - n_val) * dtype.itemsize)
        train_meta = _meta(tmp, tok.vocab_size, tok.name, source, "train")
        # The val split first, the train sidecar last: the train sidecar marks a finished prepare.
        if n_val:
            val_meta = _meta(tmp_val, tok.vocab_size, tok.name, source, "val")
            os.replace(tmp_val, val)
            tmp_val = None
            _atomic_write_text(sidecar_path(val), json.dumps(val_meta, indent=1) + "\n")
        else:  # a stale split from an earlier prepare would be taken for this file's
            for stale in (val, sidecar_path(val)):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
        with contextlib.suppress(FileNotFoundError):
            sidecar_path(train).unlink()
        os.replace(tmp, train)
        tmp = None
        _atomic_write_text(sidecar_path(train), json.dumps(train_meta, indent=1) + "\n")
    finally:
        for t in (tmp, tmp_val):
            if t is not None:
                with contextlib.suppress(OSError):
                    os.unlink(t)
    result = Prepared(train, val if n_val else None, n - n_val, n_val, tok.vocab_size, n_docs,
                      tuple(skipped))
    if log is not None:
        log(
            f"prepared {result.num_train} train tokens -> {train}"
            + (f", {n_val} val tokens -> {val}" if n_val else "")
            + f" ({n_docs} documents, tokenizer {tok.name}, vocab {tok.vocab_size}, "
            f"{_dtype_name(dtype)})"
        )
        if skipped:
            log(f"skipped {len(skipped)} non-UTF-8 files (first: {skipped[0]})")
    return result


# --------------------------------------------------------------------------------------------
# The default corpus, prepared on first use
# --------------------------------------------------------------------------------------------


def default_tokens_path(root: str | os.PathLike | None = None) -> Path:
    """The default corpus's train file: ``<root>/stdlib/train.bin``, root = ``./data``."""
    base = Path(root) if root is not None else Path.cwd() / "data"
    return base / "stdlib" / "train.bin"


def _ready(train: Path, need_val: bool) -> bool:
    """A prepare finished here: the train sidecar (written last) matches the file."""
    try:
        meta = read_meta(train)
    except DataError:
        return False
    if not meta or not train.exists():
        return False
    try:
        itemsize = _parse_dtype(meta.get("dtype", "uint16"), str(train)).itemsize
    except DataError:
        return False
    if train.stat().st_size != int(meta.get("num_tokens", -1)) * itemsize:
        return False
    return not need_val or sidecar_path(val_path(train)).exists()


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock on `path` (POSIX flock); a no-op where there is none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_locked(train: Path, max_bytes: int, val_fraction: float, log) -> None:
    with _file_lock(train.parent / ".prepare.lock"):
        if not _ready(train, val_fraction > 0):
            prepare([], out=train, val_fraction=val_fraction, max_bytes=max_bytes, log=log)


def ensure_default_corpus(
    root: str | os.PathLike | None = None,
    comm=None,
    max_bytes: int = DEFAULT_CORPUS_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    log=None,
) -> Path:
    """The default corpus's train file, prepared on first use; returns its path.

    Safe to call from many processes at once: preparation runs under a file lock in the target
    folder and writes through temporary names, so no process ever sees a half-written file.
    Under MPI pass `comm` (an mpi4py communicator): rank 0 prepares while the others wait for
    its word (point-to-point, no collective); a failure on rank 0 is raised on every rank. Ranks
    whose file system does not show rank 0's files prepare their own copy.
    """
    train = default_tokens_path(root)
    if comm is None or comm.Get_size() == 1:
        _ensure_locked(train, max_bytes, val_fraction, log)
        return train
    tag = 7301
    if comm.Get_rank() == 0:
        error = None
        try:
            _ensure_locked(train, max_bytes, val_fraction, log)
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            for r in range(1, comm.Get_size()):
                comm.send(error, dest=r, tag=tag)
    else:
        error = comm.recv(source=0, tag=tag)
        if error is not None:
            raise DataError(f"preparing the default corpus failed on rank 0: {error}")
        _ensure_locked(train, max_bytes, val_fraction, None)
    return train


# --------------------------------------------------------------------------------------------
# Reading and batching
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchLayout:
    """How a step's windows are shared: ``dp`` replicas x ``num_micro_batches`` x ``micro_batch``."""

    dp: int = 1
    micro_batch: int = 1
    num_micro_batches: int = 1

    @property
    def replica_windows(self) -> int:
        return self.micro_batch * self.num_micro_batches

    @property
    def global_batch(self) -> int:
        return self.replica_windows * self.dp

    def check(self) -> None:
        for key in ("dp", "micro_batch", "num_micro_batches"):
            if getattr(self, key) < 1:
                raise DataError(f"parallel.{key}={getattr(self, key)} must be >= 1")


def _open_tokens(path, dtype, label: str) -> tuple[Path, np.dtype, dict | None, int]:
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
    if dtype is not None:
        dt = _parse_dtype(dtype, label)
        if meta and "dtype" in meta and _parse_dtype(meta["dtype"], str(path)) != dt:
            raise DataError(
                f"{label}={str(path)!r}: dtype {_dtype_name(dt)} was asked for but the sidecar "
                f"{sidecar_path(path)} says {meta['dtype']}: drop the argument or fix the sidecar"
            )
    elif meta and "dtype" in meta:
        dt = _parse_dtype(meta["dtype"], str(sidecar_path(path)))
    else:
        dt = np.dtype("<u2")
    size = path.stat().st_size
    if size == 0:
        raise DataError(
            f"{label}={str(path)!r} is empty (0 bytes): prepare it again with python -m "
            "ratrain.data prepare"
        )
    if size % dt.itemsize:
        raise DataError(
            f"{label}={str(path)!r} is {size} bytes, not a multiple of {dt.itemsize} "
            f"({_dtype_name(dt)} ids): the file is truncated or not a token file"
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


class TokenDataset:
    """Deterministic random-access batches over a token file (see the module doc for the rules).

    ``TokenDataset(path, seq_len, vocab_size, order=..., seed=..., dp=..., micro_batch=...,
    num_micro_batches=...)`` validates the file before returning: it exists, is non-empty, its
    size is a multiple of the dtype, it holds at least one window of ``seq_len + 1`` tokens, its
    sidecar's vocabulary is not larger than `vocab_size` and no id is >= `vocab_size` (a chunked
    scan over the memmap; ``check_ids=False`` skips it when ``check_data`` already did it).
    The file is read through ``np.memmap``: only the windows a batch needs are touched.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        vocab_size: int | None = None,
        *,
        order: str = "sequential",
        seed: int = 0,
        dp: int = 1,
        micro_batch: int = 1,
        num_micro_batches: int = 1,
        dtype: str | None = None,
        check_ids: bool = True,
        label: str = "data.tokens",
    ):
        if order not in ("sequential", "shuffled"):
            raise DataError(f"data.order={order!r} is not one of: sequential, shuffled")
        if seq_len < 1:
            raise DataError(f"model.seq_len={seq_len} must be >= 1")
        self.layout = BatchLayout(dp, micro_batch, num_micro_batches)
        self.layout.check()
        self.path, self.dtype, self.meta, self.num_tokens = _open_tokens(path, dtype, label)
        self.seq_len, self.order, self.seed, self.vocab_size = seq_len, order, int(seed), vocab_size
        where = f"{label}={str(self.path)!r}"
        if self.num_tokens < seq_len + 1:
            raise DataError(
                f"{where} holds {self.num_tokens} tokens, fewer than model.seq_len + 1 = "
                f"{seq_len + 1} for one window: model.seq_len={seq_len} is above what the data "
                f"can give; lower it to at most {self.num_tokens - 1} or use more data"
            )
        meta_vocab = (self.meta or {}).get("vocab_size")
        if vocab_size is not None and meta_vocab is not None and int(meta_vocab) > vocab_size:
            raise DataError(
                f"{where} was made with a vocabulary of {meta_vocab} tokens (tokenizer "
                f"{self.meta.get('tokenizer', '?')}) but model.vocab_size={vocab_size}: set "
                f"model.vocab_size >= {meta_vocab}, or prepare the data with the model's tokenizer"
            )
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")  # (N,)
        if vocab_size is not None and check_ids:
            top, pos = scan_max_id(self.tokens, vocab_size)
            if pos is not None:
                raise DataError(
                    f"{where}: token id {int(self.tokens[pos])} at position {pos} is >= "
                    f"model.vocab_size={vocab_size} (largest id in the file: {top}): set "
                    f"model.vocab_size >= {top + 1}, or prepare the data with the model's tokenizer"
                )
        self.num_windows = self.num_tokens // (seq_len + 1)
        self._windows = self.tokens[: self.num_windows * (seq_len + 1)].reshape(
            self.num_windows, seq_len + 1
        )  # (W, T+1), a view of the memmap
        self._perms: dict[int, np.ndarray] = {}  # the last two epochs' permutations
        self._perms_lock = threading.Lock()  # compute threads may ask for micro-batches at once

    @classmethod
    def from_config(cls, cfg: Config, path: str | os.PathLike, *, eval: bool = False,
                    check_ids: bool = True) -> TokenDataset:
        """The training (or, with `eval`, the held-out, always sequential) dataset of `cfg`."""
        m, p, d = cfg.model, cfg.parallel, cfg.data
        return cls(
            path, m.seq_len, m.vocab_size, order="sequential" if eval else d.order, seed=d.seed,
            dp=p.dp, micro_batch=p.micro_batch, num_micro_batches=p.num_micro_batches,
            check_ids=check_ids, label="data.eval_tokens" if eval else "data.tokens",
        )

    # -- the window stream ------------------------------------------------------------------

    def _perm(self, epoch: int) -> np.ndarray:
        """The window order of `epoch`: ``default_rng([seed, epoch]).permutation(W)``."""
        with self._perms_lock:
            perm = self._perms.get(epoch)
            if perm is None:
                rng = np.random.default_rng([self.seed, epoch])
                perm = rng.permutation(self.num_windows)
                if self.num_windows < 1 << 31:
                    perm = perm.astype(np.int32)  # half the memory; same values
                if len(self._perms) >= 2:  # a step straddles at most two epochs
                    self._perms.pop(next(iter(self._perms)))
                self._perms[epoch] = perm
            return perm

    def window_ids(self, start: int, count: int) -> np.ndarray:
        """File window indices of stream positions ``[start, start + count)`` (int64)."""
        k = np.arange(start, start + count, dtype=np.int64)
        epoch, pos = np.divmod(k, self.num_windows)
        if self.order == "sequential":
            return pos
        out = np.empty_like(pos)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._perm(int(e))[pos[sel]]
        return out

    def _read(self, start: int, count: int) -> np.ndarray:
        ids = self.window_ids(start, count)
        return self._windows[ids].astype(np.int64)  # (count, T+1)

    def _check(self, step: int, replica: int, layout: BatchLayout) -> None:
        layout.check()
        if step < 0:
            raise DataError(f"step={step} must be >= 0")
        if not 0 <= replica < layout.dp:
            raise DataError(f"replica={replica} is outside [0, dp={layout.dp})")

    # -- batches ----------------------------------------------------------------------------

    def batch_for_step(
        self,
        step: int,
        replica: int = 0,
        dp: int | None = None,
        micro_batch: int | None = None,
        num_micro_batches: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Replica `replica`'s share of step `step`: ``(inputs, targets)``, each int64 of shape
        ``(num_micro_batches, micro_batch, seq_len)``. Layout arguments default to the dataset's."""
        lay = BatchLayout(
            self.layout.dp if dp is None else dp,
            self.layout.micro_batch if micro_batch is None else micro_batch,
            self.layout.num_micro_batches if num_micro_batches is None else num_micro_batches,
        )
        self._check(step, replica, lay)
        start = step * lay.global_batch + replica * lay.replica_windows
        w = self._read(start, lay.replica_windows)  # (M*B, T+1)
        w = w.reshape(lay.num_micro_batches, lay.micro_batch, self.seq_len + 1)  # (M, B, T+1)
        return np.ascontiguousarray(w[..., :-1]), np.ascontiguousarray(w[..., 1:])

    def micro_batch(self, step: int, replica: int, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Micro-batch `i` of replica `replica` at step `step` (the dataset's layout):
        ``(inputs, targets)``, each int64 of shape ``(micro_batch, seq_len)``."""
        lay = self.layout
        self._check(step, replica, lay)
        if not 0 <= i < lay.num_micro_batches:
            raise DataError(f"micro-batch {i} is outside [0, num_micro_batches="
                            f"{lay.num_micro_batches})")
        start = step * lay.global_batch + replica * lay.replica_windows + i * lay.micro_batch
        w = self._read(start, lay.micro_batch)  # (B, T+1)
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])

    # -- bookkeeping ------------------------------------------------------------------------

    def epoch(self, step: int) -> float:
        """Epochs consumed before step `step` (fractional)."""
        return step * self.layout.global_batch / self.num_windows

    def state_dict(self, step: int) -> dict:
        """The data position of a checkpoint taken before step `step`. Batches are a pure
        function of the step, so resuming needs only ``step``; the rest is recorded to notice a
        changed file or config."""
        return {
            "step": int(step), "order": self.order, "seed": self.seed, "seq_len": self.seq_len,
            "num_tokens": self.num_tokens, "global_batch": self.layout.global_batch,
            "sha256": (self.meta or {}).get("sha256", ""),
        }

    def __len__(self) -> int:
        return self.num_windows

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.path)!r}, tokens={self.num_tokens}, "
                f"windows={self.num_windows}x{self.seq_len + 1}, {_dtype_name(self.dtype)}, "
                f"order={self.order}, seed={self.seed}, layout={self.layout})")


def eval_batches(
    dataset: TokenDataset, num_batches: int, replica: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed set of eval batches: the first `num_batches` sequential batches of `dataset`
    (windows from 0 in file order, whatever its order; wrapping if the file is short), replica
    `replica`'s share of each, shaped like training batches."""
    if num_batches < 1:
        raise DataError(f"data.eval_batches={num_batches} must be >= 1")
    seq = dataset
    if dataset.order != "sequential":
        seq = TokenDataset(
            dataset.path, dataset.seq_len, dataset.vocab_size, order="sequential",
            dp=dataset.layout.dp, micro_batch=dataset.layout.micro_batch,
            num_micro_batches=dataset.layout.num_micro_batches, dtype=_dtype_name(dataset.dtype),
            check_ids=False,
        )
    return [seq.batch_for_step(b, replica) for b in range(num_batches)]


# --------------------------------------------------------------------------------------------
# The trainer's entry: check before any work
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataPaths:
    """The resolved token files of a run (`eval_tokens` is None when there is no held-out file)."""

    tokens: Path
    eval_tokens: Path | None


def check_data(cfg: Config, comm=None, check_ids: bool = True) -> DataPaths:
    """Resolve and validate the run's token files before any work; return their paths.

    ``data.tokens: ""`` is the default corpus (prepared on first use, see
    ``ensure_default_corpus``; `comm` is passed on). ``data.eval_tokens: ""`` is the ``val_path``
    beside ``data.tokens`` when it exists. ``data.eval_interval > 0`` with no held-out file is an
    error. Raises ``DataError`` (a ``ConfigError``) naming the key, the value and the fix.
    """
    d = cfg.data
    tokens = Path(d.tokens) if d.tokens else ensure_default_corpus(comm=comm)
    TokenDataset.from_config(cfg, tokens, check_ids=check_ids)
    if d.eval_tokens:
        ev: Path | None = Path(d.eval_tokens)
    else:
        ev = val_path(tokens) if val_path(tokens).exists() else None
    if ev is None and d.eval_interval > 0:
        raise DataError(
            f"data.eval_interval={d.eval_interval} but there is no held-out file: "
            f"data.eval_tokens is empty and {val_path(tokens)} does not exist; prepare with "
            "--val-fraction > 0, set data.eval_tokens, or set data.eval_interval=0"
        )
    if ev is not None:
        TokenDataset.from_config(cfg, ev, eval=True, check_ids=check_ids)
    return DataPaths(tokens, ev)


def open_datasets(cfg: Config, paths: DataPaths) -> tuple[TokenDataset, TokenDataset | None]:
    """The (train, eval) datasets of checked `paths` (no second id scan)."""
    train = TokenDataset.from_config(cfg, paths.tokens, check_ids=False)
    ev = None
    if paths.eval_tokens is not None:
        ev = TokenDataset.from_config(cfg, paths.eval_tokens, eval=True, check_ids=False)
    return train, ev


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _info(path: str) -> str:
    p, dt, meta, n = _open_tokens(path, None, "token file")
    top, _ = scan_max_id(np.memmap(p, dtype=dt, mode="r"))
    lines = [f"{p}: {n} tokens, {_dtype_name(dt)}, largest id {top}",
             f"sidecar: {json.dumps(meta) if meta else 'none (plain nanoGPT layout)'}"]
    v = val_path(p)
    if v.exists():
        lines.append(f"held-out split: {v}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ratrain.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser(
        "prepare", help="text files / folders -> token files (no inputs: the default corpus)",
        description="Tokenize text into PATH and its held-out split val_path(PATH). With no "
        "inputs, the default corpus: the Python standard library's .py sources.",
    )
    pp.add_argument("inputs", nargs="*", help="text files or folders (recursive, sorted)")
    pp.add_argument("--out", default=None,
                    help="train token file (a folder means FOLDER/train.bin); default "
                    "data/stdlib/train.bin, or data/<first input>/train.bin")
    pp.add_argument("--tokenizer", default="byte",
                    help="'byte' (default, vocab 256) or a Hugging Face tokenizer.json")
    pp.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                    help="tail of the token stream held out (default 0.05; 0 = none)")
    pp.add_argument("--max-bytes", type=int, default=None,
                    help=f"cap on text read (default {DEFAULT_CORPUS_BYTES} for the default "
                    "corpus, none otherwise)")
    ip = sub.add_parser("info", help="describe a token file")
    ip.add_argument("path")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "prepare":
            prepare(args.inputs, args.out, args.tokenizer, args.val_fraction, args.max_bytes,
                    log=print)
        else:
            print(_info(args.path))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
