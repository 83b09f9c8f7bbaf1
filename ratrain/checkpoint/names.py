"""Where checkpoints live and what their files are called; which of them count.

    <checkpoint.dir>/                 checkpoint_root(): default <run.dir>/checkpoints
        ckpt-000100/                  checkpoint_name(100): one directory per saved step
            shard-s000.h5             shard_name(0): stage 0's state
            manifest.json             MANIFEST: present = committed
            .shard-s001.h5.tmp.PID.RANDOM   a shard being written (ratrain.fileio's temp name)

Only a directory with a manifest counts (`is_committed`); one without is the leftover of a
killed or failed save, whatever temporary files it holds: resume skips it and the next save
removes it.
"""

from __future__ import annotations

import os
import re

from ratrain.config import CheckpointConfig

FORMAT = "ratrain-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# The state buffers of a shard -> their HDF5 group: fp32 masters and AdamW's two moments.
BUFFERS = {"master": "master", "m": "optim/m", "v": "optim/v"}
_CKPT_RE = re.compile(r"^ckpt-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, trusted or used; the message names file and fault."""


def checkpoint_root(ckpt: CheckpointConfig, run_dir: str) -> str:
    """Where checkpoints live: `checkpoint.dir`, or `<run.dir>/checkpoints` when empty."""
    return ckpt.dir or os.path.join(run_dir, "checkpoints")


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def shard_name(stage: int) -> str:
    return f"shard-s{stage:03d}.h5"


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every `ckpt-NNNNNN` directory under `root`, committed or not, by step."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        m = _CKPT_RE.match(e)
        if m and os.path.isdir(os.path.join(root, e)):
            out.append((int(m.group(1)), os.path.join(root, e)))
    return sorted(out)
