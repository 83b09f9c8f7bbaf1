"""Files that are either whole or absent: the one write protocol of ratrain.

Every file ratrain writes for a user (configs, metrics rewrites, traces, token files, HDF5 shards,
manifests, Hugging Face exports, plots) goes through here:

    atomic_write(path, text_or_bytes)          # temp file, fsync, rename, fsync the directory
    with atomic_path(path) as tmp:             # for writers that want a path (h5py, safetensors)
        h5py.File(tmp, "w") ...
    fsync_dir(directory)
    f = open_append(path)                      # a log appended to (metrics.jsonl): no link followed
    append_whole(fd, line)                     # a record appended whole or not at all
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)   # a file updated in place (a lock)

The temporary file lies beside its target (same file system, so the rename is atomic), is
created exclusively and without following symbolic links (`O_CREAT | O_EXCL | O_NOFOLLOW`), so a
link planted at a predictable name can never redirect a write, and with mode 0666 filtered by
the process's umask, as any file the user creates (a writer that replaces the temporary file
with one of its own, as safetensors does with mode 0600, gets the umask's mode back). On any
failure (including a full disk) the
temporary file is removed and the target is left as it was. `durable=False` skips the fsyncs
(scratch output whose loss costs nothing, such as a plot).

Imports nothing of ratrain: any package may use it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (a rename, a new file) durable; a no-op where directories
    cannot be opened (not POSIX)."""
    try:
        fd = os.open(os.fspath(path) or ".", os.O_RDONLY | _CLOEXEC)
    except OSError:  # pragma: no cover - platforms without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def temp_name(path: str | os.PathLike) -> str:
    """A fresh hidden name beside `path`: `.NAME.tmp.PID.RANDOM`."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")


def create_exclusive(path: str | os.PathLike) -> int:
    """Open a new file for writing that did not exist (never through a symbolic link); mode
    0666 minus the umask. Returns the descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    return os.open(os.fspath(path), flags, 0o666)


def open_no_follow(path: str | os.PathLike, flags: int) -> int:
    """`os.open(path, flags)` that never goes through a symbolic link at `path` (ELOOP instead);
    a file it creates has mode 0666 minus the umask. For files updated in place (a lock)."""
    return os.open(os.fspath(path), flags | _NOFOLLOW | _CLOEXEC, 0o666)


def append_whole(fd: int, data: bytes) -> None:
    """Append `data` (one record: a line) to the file open at `fd` (O_APPEND, one writer) whole
    or not at all: a write cut short (a full disk, a quota) is cut back off before the error
    is raised, so a log never ends in a torn record."""
    start = os.fstat(fd).st_size
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def open_append(path: str | os.PathLike):
    """A text file opened for appending (created if absent), never through a symbolic link:
    a link at `path` is an OSError (ELOOP), not a redirected write."""
    return os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, durable: bool = True) -> Iterator[str]:
    """Yield a temporary path beside `path` (created empty and exclusively); when the block
    ends without an exception the file is fsynced and renamed over `path` and the directory
    fsynced; otherwise it is removed. The writer may reopen the temporary path by name (h5py,
    safetensors)."""
    path = os.fspath(path)
    tmp = temp_name(path)
    fd = create_exclusive(tmp)
    mode = os.fstat(fd).st_mode & 0o7777  # 0666 minus the umask
    os.close(fd)
    try:
        yield tmp
        # one descriptor, opened without following a link, for the check and every use after it
        try:
            fd = os.open(tmp, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        except OSError as e:
            if os.path.islink(tmp):  # the writer replaced our file with a link: refuse
                raise OSError(f"{tmp}: became a symbolic link while being written") from e
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{tmp}: became something other than a file while being written")
            if st.st_mode & 0o7777 != mode:  # a writer that made its own file (0600)
                os.fchmod(fd, mode)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path))


def atomic_write(path: str | os.PathLike, data: str | bytes, *, durable: bool = True) -> None:
    """Write `data` (text is UTF-8) to `path` atomically (see the module)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    with atomic_path(path, durable=durable) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | _NOFOLLOW | _CLOEXEC)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)


__all__ = ["append_whole", "atomic_path", "atomic_write", "create_exclusive", "fsync_dir", "open_append", "open_no_follow",
           "temp_name"]
