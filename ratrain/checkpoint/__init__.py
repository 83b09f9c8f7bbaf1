"""HDF5 checkpoints that survive crashes, resume bit for bit, and reshard on load.

Owns: the checkpoint directory layout and names (`names`), the one-process communicator and the
rank-0-then-broadcast helper (`collective`), writing one stage's shard, fast and plain
(`shard`), what a model's checkpoint must hold (`model`), the collective save, manifest, commit
and `keep` (`commit`), room on the disk: sizes, pruning ahead, space errors (`space`), what a
checkpoint's files must agree on: the manifest's seal, its fields and each shard's record
(`audit`), verification, the one place that decides whether a checkpoint is usable, and the
choice of the checkpoint to resume from (`verify`), loading into any
layout (`load`), finding a committed checkpoint and loading it into a stage block by block, the
one way the trainer, eval, generate and export take weights (`stage`), each replica's own
state under partial synchronization (`replicas`), and the `show` CLI (`show`, `__main__`).

May import: `ratrain` (its version), `ratrain.config`, `ratrain.device` (device arrays to the
host), `ratrain.fileio` (every file is written
through its one atomic-write protocol), `ratrain.exec.spec` from `model` only (the model's
parameter names and stage split, a pure description: no kernels, no MPI) and third-party
packages (numpy, h5py, yaml). Never comm, lifecycle, plan, train: collectives come in as a
`comm` argument, the schedule is not its business.

Layout of one checkpoint (`<checkpoint.dir>/ckpt-000100/`, default dir `<run.dir>/checkpoints`):

    shard-s000.h5     stage 0's state, written by replica 0 of stage 0
    shard-s001.h5     ...one file per pipeline stage
    manifest.json     written last, by rank 0, after every shard is on disk: the commit mark,
                      sealed with the SHA-256 of its own content
    shard-s000-r001.h5   under partial sync (dp > 1): replica 1 of stage 0's own state, one
                      per replica and stage; the stage shards then hold the replicas' mean

    path = save_checkpoint(root, step, cfg, state.state_dict(), scalars, stage=s, replica=r, comm=c)
    path = resolve_resume(cfg.checkpoint, cfg.run.dir, cfg.model, comm=c)   # or None: fresh
    ck = load_checkpoint(path, state.names, out=state.state_dict())          # reads in place
    python -m ratrain.checkpoint show runs/tiny/checkpoints/ckpt-000100 --verify
"""

from ratrain.checkpoint.commit import save_checkpoint
from ratrain.checkpoint.load import load_checkpoint
from ratrain.checkpoint.stage import checkpoint_config, committed_path, load_stage, newest_committed
from ratrain.checkpoint.replicas import holds_replicas, resume_replica
from ratrain.checkpoint.names import (
    BUFFER_GROUPS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CheckpointSpaceError,
    checkpoint_name,
    checkpoint_root,
    checkpoint_step,
    is_committed,
    linked_checkpoints,
    list_checkpoints,
    shard_name,
)
from ratrain.checkpoint.shard import StateStream, sha256_file, write_shard
from ratrain.checkpoint.show import show
from ratrain.checkpoint.verify import (
    model_mismatch,
    read_manifest,
    resolve_resume,
    verify_checkpoint,
)

__all__ = [
    "holds_replicas",
    "resume_replica",
    "checkpoint_config",
    "committed_path",
    "load_stage",
    "newest_committed",
    "BUFFER_GROUPS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "CheckpointSpaceError",
    "StateStream",
    "checkpoint_name",
    "checkpoint_root",
    "checkpoint_step",
    "is_committed",
    "linked_checkpoints",
    "list_checkpoints",
    "load_checkpoint",
    "model_mismatch",
    "read_manifest",
    "resolve_resume",
    "save_checkpoint",
    "sha256_file",
    "shard_name",
    "show",
    "verify_checkpoint",
    "write_shard",
]
