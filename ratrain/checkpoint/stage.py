"""Finding a committed checkpoint and loading it into a stage, block by block: the one way the
trainer (resume), eval, generate and export take weights from a checkpoint.

    path = committed_path("runs/tiny/checkpoints")      # that ckpt-..., or the newest in a root
    path, cfg, step = checkpoint_config(path)           # reads no tensor
    ck = load_stage(state, path)                        # masters and moments; ck["step"], ...
    load_stage(state, path, buffers=("master",))        # masters only (eval, inference)

A stage state (`exec.params.StageState`, passed in: this package does not import it) that is
whole, loading every buffer, is read in place in one pass; otherwise (a sharded state, or some
buffers) one block at a time, each block's whole parameters read and this replica's segment
kept, so no more than one extra block is ever held.
"""

from __future__ import annotations

import os

from ratrain.checkpoint.load import load_checkpoint
from ratrain.checkpoint.names import BUFFER_GROUPS, is_committed, list_checkpoints


def newest_committed(root: str) -> str | None:
    """The newest committed checkpoint under a checkpoints directory, or None."""
    done = [p for _, p in list_checkpoints(root) if is_committed(p)]
    return done[-1] if done else None


def committed_path(path: str) -> str:
    """A committed checkpoint: `path` itself, or the newest one in a checkpoints directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if is_committed(path):
        return path
    newest = newest_committed(path)
    if newest is None:
        raise FileNotFoundError(
            f"{path}: neither a committed checkpoint (no manifest.json) nor a directory holding one"
        )
    return newest


def checkpoint_config(path: str):
    """(committed path, the run's config, step) of a checkpoint (reads no tensors)."""
    path = committed_path(path)
    ck = load_checkpoint(path, [], buffers=())
    return path, ck["config"], ck["step"]


def load_stage(state, path: str, buffers=tuple(BUFFER_GROUPS), replica: int | None = None) -> dict:
    """Put `buffers` of checkpoint `path` into `state` (see the module); `replica`: that
    replica's own state of a partial-sync checkpoint (`checkpoint.replicas`); returns the last
    `load_checkpoint` result (its step, scalars and config)."""
    buffers = tuple(buffers)
    if not state.sharded and buffers == tuple(BUFFER_GROUPS):
        return load_checkpoint(path, state.names, out=state.state_dict(), replica=replica)
    ck = None
    for b in state.blocks:
        ck = load_checkpoint(path, [p.name for p in b.params], buffers=buffers, replica=replica)
        for buf in buffers:
            state.load_named(ck[buf], buf, blocks=[b.name])
    return ck


__all__ = ["checkpoint_config", "committed_path", "load_stage", "newest_committed"]
