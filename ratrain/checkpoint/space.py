"""Room for a checkpoint: how big one is, how much the disk has, and pruning ahead of a save.

A save needs the room of a whole checkpoint while the previous ones are still there:
`checkpoint.keep=N` holds N committed checkpoints, so N + 1 at the peak of a save. When the
disk has less free than a checkpoint needs, `make_room` prunes the oldest committed
checkpoints first (never the newest committed one: it stays until the new one is committed)
and the leftovers of failed saves; when even that is not enough, the save is refused before a
byte is written, with an error that says so in its first words. A write that fails anyway (the
disk filled meanwhile, a quota) is recognised by `is_space_error` and reported the same way.

    need = expected_bytes(root, cfg)       # the newest committed checkpoint's size, or an estimate
    make_room(root, step, need, log)       # rank 0, before the save
"""

from __future__ import annotations

import errno
import os

from ratrain.checkpoint.model import expected_params
from ratrain.checkpoint.names import CheckpointSpaceError, is_committed, list_checkpoints
from ratrain.checkpoint.replicas import holds_replicas
from ratrain.config import Config

MARGIN = 1.05  # room asked for beyond the expected size (HDF5 metadata, a changed config)
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_SPACE_WORDS = ("no space left", "disk full", "quota exceeded", "file too large")


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system of `path` (or its
    nearest existing parent)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path.rstrip(os.sep)) or "."
    st = os.statvfs(path or ".")
    return st.f_bavail * st.f_frsize


def human_bytes(n: float) -> str:
    """`n` bytes for people: 512 B, 1.5 KiB, 17.8 MiB, 2.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def checkpoint_bytes(path: str) -> int:
    """Bytes the files of checkpoint directory `path` take."""
    total = 0
    for e in os.scandir(path):
        if e.is_file(follow_symlinks=False):
            total += e.stat(follow_symlinks=False).st_size
    return total


def expected_bytes(root: str, cfg: Config) -> int:
    """What the next checkpoint will take: the newest committed one's size, or (none yet) the
    model's fp32 master, m and v plus HDF5's metadata (measured: under 1 KiB per dataset),
    once more for each replica's own state under partial sync (`checkpoint.replicas`)."""
    done = [p for _, p in list_checkpoints(root) if is_committed(p)]
    if done:
        return checkpoint_bytes(done[-1])
    shapes = expected_params(cfg.model).values()
    n = sum(int(_prod(s)) for s in shapes)
    copies = 1 + (cfg.parallel.dp if holds_replicas(cfg) else 0)
    return copies * (12 * n + 1024 * 3 * len(shapes) + 16 * 1024 * cfg.parallel.pp)


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def is_space_error(e: BaseException) -> bool:
    """Whether `e` (or an exception it was raised from) says the disk or quota is full."""
    seen = 0
    while e is not None and seen < 8:
        if getattr(e, "errno", None) in _SPACE_ERRNOS:
            return True
        if any(w in str(e).lower() for w in _SPACE_WORDS):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def space_message(root: str, what: str, need: int, detail: str = "", kept: bool = True) -> str:
    """The one line a save that lacks room fails with (`what`: "the checkpoint of step 100")."""
    return (f"no space left on device for {what} in {root}: it needs about {human_bytes(need)}, "
            f"{human_bytes(free_bytes(root))} are free" + (f" ({detail})" if detail else "")
            + ("; the last committed checkpoint is intact" if kept else "")
            + ". Free space, lower checkpoint.keep, or set checkpoint.dir to a larger disk")


def make_room(root: str, step: int, need: int, remove, log) -> None:
    """Prune ahead of the save of `step` until `need` bytes (times MARGIN) are free; never the
    newest committed checkpoint. `remove(path)` deletes one. CheckpointSpaceError if even that
    is not enough (nothing is written then)."""
    want = int(need * MARGIN)
    if free_bytes(root) >= want:
        return
    older = [(s, p) for s, p in list_checkpoints(root) if s != step]
    committed = [p for s, p in older if is_committed(p) and s < step]
    prunable = [p for s, p in older if not is_committed(p)] + committed[:-1]
    for p in prunable:
        if free_bytes(root) >= want:
            return
        log(f"pruning {p} ahead of the save of step {step}: {human_bytes(free_bytes(root))} free, a "
            f"checkpoint needs about {human_bytes(need)} (checkpoint.keep=N needs room for N + 1)")
        remove(p)
    if free_bytes(root) < want:
        raise CheckpointSpaceError(space_message(root, f"the checkpoint of step {step}", need,
                                                 "nothing was written"))


def room_problem(root: str, cfg: Config) -> str | None:
    """At start-up: why the next checkpoint cannot fit even after pruning ahead (None: it can),
    so that a run on a full disk stops before training instead of at its first save."""
    need = expected_bytes(root, cfg)
    done = [p for _, p in list_checkpoints(root) if is_committed(p)]
    leftovers = [p for _, p in list_checkpoints(root) if not is_committed(p)]
    reclaim = sum(checkpoint_bytes(p) for p in done[:-1] + leftovers)
    if free_bytes(root) + reclaim >= int(need * MARGIN):
        return None
    return space_message(root, "a checkpoint", need, "even after pruning older checkpoints",
                         kept=False)


__all__ = ["checkpoint_bytes", "expected_bytes", "free_bytes", "human_bytes", "is_space_error",
           "make_room", "room_problem", "space_message"]
