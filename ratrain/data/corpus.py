"""The default corpus, prepared on first use: ``data.tokens: ""`` means ``./data/stdlib/train.bin``.

``ensure_default_corpus`` prepares the Python standard library's sources (see
``ratrain.data.default_corpus``) into that file and its held-out split the first time a run asks, and
reuses them afterwards (the train sidecar, written last, marks a finished prepare). Many
processes may ask at once: preparation runs under a file lock in the target folder, and under
MPI rank 0 prepares while the others wait for its word.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ratrain.data.prepare import DEFAULT_VAL_FRACTION, prepare
from ratrain.data.default_corpus import DEFAULT_CORPUS_BYTES
from ratrain.data.tokenfile import index_path
from ratrain.data.tokens import DataError, parse_dtype, read_meta, sidecar_path, val_path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None

_TAG = 7301  # the message tag of rank 0's word to the others


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
        itemsize = parse_dtype(meta.get("dtype", "uint16"), str(train)).itemsize
    except DataError:
        return False
    if train.stat().st_size != int(meta.get("num_tokens", -1)) * itemsize:
        return False
    if meta.get("layout") == "megatron" and not index_path(train).exists():
        return False
    return not need_val or sidecar_path(val_path(train)).exists()


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock on `path` (POSIX flock); a no-op where there is none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover - not POSIX
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
    if comm.Get_rank() == 0:
        error = None
        try:
            _ensure_locked(train, max_bytes, val_fraction, log)
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            for r in range(1, comm.Get_size()):
                comm.send(error, dest=r, tag=_TAG)
    else:
        error = comm.recv(source=0, tag=_TAG)
        if error is not None:
            raise DataError(f"preparing the default corpus failed on rank 0: {error}")
        _ensure_locked(train, max_bytes, val_fraction, None)
    return train
