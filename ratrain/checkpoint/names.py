"""Where checkpoints live and what their files are called; which of them count.

    <checkpoint.dir>/                 checkpoint_root(): default <run.dir>/checkpoints
        ckpt-000100/                  checkpoint_name(100): one directory per saved step
            shard-s000.h5             shard_name(0): stage 0's state
            manifest.json             MANIFEST: present = committed
            .shard-s001.h5.tmp.PID.RANDOM   a shard being written (ratrain.fileio's temp name)

Only a directory with a manifest counts (`is_committed`); one without is the leftover of a
killed or failed save, whatever temporary files it holds: resume skips it and the next save
removes it. A `ckpt-NNNNNN` that is a symbolic link is never a checkpoint (`linked_checkpoints`
lists them so that resume can say so): nothing is read, pruned or removed through it. The
files a manifest names are plain shard names inside their checkpoint (`SHARD_RE`), and the
number in a checkpoint's name is its step (`checkpoint_step`).

Format versions: 1, the manifest unsealed; 2 (since issue 33), the manifest carries the SHA-256
of its own content (`SEAL`, `ratrain.checkpoint.audit`).
"""

from __future__ import annotations

import os
import re

from ratrain.config import CheckpointConfig

FORMAT = "ratrain-checkpoint"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
SEAL = "manifest_sha256"  # the manifest's key for the SHA-256 of the rest of it
# The state buffers of a shard -> their HDF5 group: fp32 masters and AdamW's two moments.
BUFFER_GROUPS = {"master": "master", "m": "optim/m", "v": "optim/v"}
_CKPT_RE = re.compile(r"^ckpt-(\d{6,})$")
SHARD_RE = re.compile(r"^shard-s\d{3,}\.h5$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, trusted or used; the message names file and fault."""


def checkpoint_root(ckpt: CheckpointConfig, run_dir: str) -> str:
    """Where checkpoints live: `checkpoint.dir`, or `<run.dir>/checkpoints` when empty."""
    return ckpt.dir or os.path.join(run_dir, "checkpoints")


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def checkpoint_step(path: str) -> int | None:
    """The step in a checkpoint directory's name (`ckpt-000100` -> 100); None for another name
    (a copy given by path under a name of its own)."""
    m = _CKPT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def shard_name(stage: int) -> str:
    return f"shard-s{stage:03d}.h5"


class CheckpointSpaceError(CheckpointError):
    """A checkpoint not written for lack of space (the message says so in its first words)."""


def is_committed(path: str) -> bool:
    return not os.path.islink(path) and os.path.isfile(os.path.join(path, MANIFEST))


def _entries(root: str, links: bool) -> list[tuple[int, str]]:
    try:
        entries = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for e in entries:
        m = _CKPT_RE.match(e)
        p = os.path.join(root, e)
        if m and (os.path.islink(p) if links else (os.path.isdir(p) and not os.path.islink(p))):
            out.append((int(m.group(1)), p))
    return sorted(out)


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every `ckpt-NNNNNN` directory under `root`, committed or not, by step
    (symbolic links excluded)."""
    return _entries(root, links=False)


def linked_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every `ckpt-NNNNNN` under `root` that is a symbolic link (refused)."""
    return _entries(root, links=True)
