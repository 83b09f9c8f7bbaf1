"""Saving a checkpoint: every stage's shard, then the manifest that commits them, then `keep`.

Commit protocol (a SIGKILL at any moment leaves the previous committed checkpoint intact):
rank 0 makes the empty directory `ckpt-NNNNNN` (removing leftovers of an earlier try at that
step); replica 0 of each stage writes its shard (`write_shard`: temporary name, fsync, rename,
fsync the directory; replicas hold identical state, so the others write nothing); the writers'
sizes and hashes are gathered to rank 0, which checks that every stage wrote its shard, every
parameter of the model is there once and the scalar state agrees across ranks, then writes
`manifest.json` the same way (`ratrain.fileio.atomic_write`). The manifest lists every file with
its size and SHA-256, which parameters (and shapes) it holds, the topology, the step, the config
and the ratrain version, and is sealed last with the SHA-256 of all of that (`audit.seal`: a
key added to the manifest is covered when it is added before the seal, in `_manifest`). Only
a directory with a manifest counts. Older checkpoints beyond
`checkpoint.keep` are removed after that, manifest first, so a kill during removal leaves an
uncommitted directory, never a damaged committed one. Leftovers of killed saves (directories
without a manifest, with their temporary files) are ignored by resume and removed by the next
save.

    path = save_checkpoint(root, step, cfg, state.state_dict(), scalars, stage=s, replica=r, comm=c)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import ratrain
from ratrain.checkpoint.audit import seal
from ratrain.checkpoint.collective import Solo, log_default, root_then_bcast
from ratrain.checkpoint.model import coverage_problems, stage_bounds
from ratrain.checkpoint.names import FORMAT, FORMAT_VERSION, MANIFEST, CheckpointError
from ratrain.checkpoint.names import CheckpointSpaceError, checkpoint_name, is_committed
from ratrain.checkpoint.names import list_checkpoints
from ratrain.checkpoint.replicas import holds_replicas, replica_problems
from ratrain.checkpoint.shard import StateStream, state_json, write_shard
from ratrain.checkpoint.space import expected_bytes, is_space_error, make_room, space_message
from ratrain.config import Config
from ratrain.fileio import atomic_write, fsync_dir


def remove_checkpoint(path: str) -> None:
    """Un-commit (manifest first, durably), then delete; never through a symbolic link."""
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link: not removed (nor followed)")
    man = os.path.join(path, MANIFEST)
    if os.path.exists(man):
        os.unlink(man)
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def _prepare_dir(root: str, path: str, step: int, need: int, log) -> None:
    os.makedirs(root, exist_ok=True)
    if os.path.lexists(path):  # leftovers of a killed save, or a checkpoint of this step replaced
        remove_checkpoint(path)
    make_room(root, step, need, remove_checkpoint, log)
    os.mkdir(path)
    fsync_dir(root)


def _abandon(root: str, path: str) -> None:
    """Rank 0, after a failed save: remove what it left (its room goes back to the disk)."""
    if os.path.isdir(path) and not is_committed(path):
        remove_checkpoint(path)
        fsync_dir(root)


def _prune(root: str, keep: int, step: int, log) -> None:
    """Keep the `keep` newest committed checkpoints up to `step`; drop leftovers of killed saves."""
    kept = 0
    for s, p in reversed(list_checkpoints(root)):
        if s == step:
            kept += 1
            continue
        if not is_committed(p):
            remove_checkpoint(p)  # uncommitted: a killed or failed save
        elif s > step:
            log(
                f"{p} (step {s}) is newer than the checkpoint just saved (step {step}): "
                "resume: auto will pick it; delete it if that run is abandoned"
            )
        elif kept < keep:
            kept += 1
        else:
            remove_checkpoint(p)


def _shard_entries(path: str, gathered: list[dict], pp: int) -> list[dict]:
    """The shards' manifest entries by stage, once every rank's report is checked."""
    errors = [g["error"] for g in gathered if g["error"]]
    if errors:
        raise CheckpointError(f"checkpoint {path} not committed: " + "; ".join(errors))
    states = {g["state"] for g in gathered}
    if len(states) > 1:
        groups: dict[str, list[int]] = {}
        for g in gathered:
            groups.setdefault(g["state"], []).append(g["rank"])
        raise CheckpointError(
            f"checkpoint {path} not committed: the scalar state passed to save_checkpoint "
            f"differs between ranks (groups of ranks: {sorted(groups.values())}); it must be "
            "the same on every rank (one copy is stored)"
        )
    entries = sorted((g["entry"] for g in gathered if g["entry"]), key=lambda e: e["stage"])
    stages = [e["stage"] for e in entries]
    if stages != list(range(pp)):
        raise CheckpointError(
            f"checkpoint {path} not committed: shards written for stages {stages}, expected one "
            f"per stage 0..{pp - 1} (replica 0 of each stage writes one)"
        )
    return entries


def _manifest(step: int, cfg: Config, gathered: list[dict], entries: list[dict]) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ratrain_version": ratrain.__version__,
        "step": int(step),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "topology": {
            "pp": cfg.parallel.pp,
            "dp": cfg.parallel.dp,
            "world_size": len(gathered),
            "stage_layers": stage_bounds(cfg),
            "ranks": [
                {"rank": g["rank"], "stage": g["stage"], "replica": g["replica"]} for g in gathered
            ],
        },
        "files": entries,
        "config": cfg.to_dict(),
        **({"replicas": sorted((g["replica_entry"] for g in gathered),
                               key=lambda e: (e["stage"], e["replica"]))}
           if holds_replicas(cfg) else {}),
    }


def _commit(root, path, step, cfg: Config, gathered, keep, log) -> str:
    """Rank 0: check the reports, write the manifest (the commit), then apply `keep`."""
    entries = _shard_entries(path, gathered, cfg.parallel.pp)
    manifest = _manifest(step, cfg, gathered, entries)
    problems = coverage_problems(manifest, path) + replica_problems(manifest, cfg)
    if problems:
        raise CheckpointError(f"checkpoint {path} not committed: " + "; ".join(problems))
    fsync_dir(path)  # every shard's rename is durable before the manifest names it
    atomic_write(os.path.join(path, MANIFEST), json.dumps(seal(manifest), indent=1))
    fsync_dir(root)
    _prune(root, keep, step, log)
    return path


def _write_mine(path, step, cfg, tensors, state, rank, stage, replica, writer, own) -> dict:
    """This rank's part of a save (its shard on replica 0; `own`: this replica's own state,
    partial sync) and its report for rank 0."""
    entry = own_entry = error = None
    space = False
    try:
        if replica == 0:
            entry = write_shard(path, step, stage, cfg, tensors, state, writer=writer)
        if isinstance(tensors, StateStream):
            tensors.drain()  # the rest of the stream (all of it on a non-writing replica)
        if own is not None:
            own_entry = write_shard(path, step, stage, cfg, own, state, writer=writer,
                                    replica=replica)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, raised on every rank
        if isinstance(tensors, StateStream) and tensors.failed is not None:
            raise  # the stream's collectives broke on this rank: no report can pair with them
        text = " ".join(str(e).split())  # h5py's messages span lines
        error = f"rank {rank} (stage {stage}): {type(e).__name__}: {text}"
        space = is_space_error(e)
        if isinstance(tensors, StateStream):
            tensors.drain()  # every replica still takes part in the stream's collectives
    try:
        digest = hashlib.sha256(state_json(state).encode()).hexdigest()
    except TypeError as e:
        digest, error = "", error or f"rank {rank}: {e}"
    return {"rank": rank, "stage": stage, "replica": replica, "entry": entry, "error": error,
            "state": digest, "space": space, "replica_entry": own_entry}


def save_checkpoint(
    root: str,
    step: int,
    cfg: Config,
    tensors: Mapping[str, Mapping[str, Any]] | StateStream | None,
    state: Mapping | None = None,
    *,
    stage: int = 0,
    replica: int = 0,
    comm=None,
    keep: int | None = None,
    writer: str = "fast",
    log: Callable[[str], None] | None = None,
    own: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """Save and commit checkpoint `<root>/ckpt-<step>`; collective over `comm` (every rank calls).

    Args:
        root: the checkpoints directory (`checkpoint_root(cfg.checkpoint, cfg.run.dir)`).
        step: the number of completed steps (resume continues with step + 1).
        cfg: the resolved config (stored; `cfg.parallel` gives pp and dp).
        tensors: a `StateStream` (block by block), or this rank's
            {"master"|"m"|"v": {global name: fp32 array}}, e.g.
            `StageState.state_dict()` (views, not copies: nothing is copied on save); ignored
            on replicas other than 0.
        state: JSON-able scalar state, the same on every rank: data position, optimizer and
            loss-scaler `state_dict()`s, RNG state. Returned as-is by `load_checkpoint`.
        stage, replica: this rank's place; replica 0 of each stage writes, others only gather.
        comm: mpi4py-like communicator over all ranks (None: one process).
        keep: committed checkpoints to keep (default `cfg.checkpoint.keep`).
        writer: "fast" (streamed, hashed while written) or "plain" (the reference).
        own: under partial sync at dp > 1 (`replicas.holds_replicas`), this replica's own
            {"master"|"m"|"v": {name: array}}, written by every rank beside the model shards
            (`tensors`: then the replicas' mean) and listed in the manifest's `replicas`.
    Returns the committed checkpoint's path, on every rank; raises CheckpointError (the same on
    every rank) if any rank failed, and then nothing is committed.
    """
    comm = comm or Solo()
    log = log or log_default
    rank = comm.Get_rank()
    keep = cfg.checkpoint.keep if keep is None else keep
    path = os.path.join(root, checkpoint_name(step))
    need = root_then_bcast(comm, lambda: expected_bytes(root, cfg))
    try:
        root_then_bcast(comm, lambda: _prepare_dir(root, path, step, need, log))
    except CheckpointSpaceError:
        if isinstance(tensors, StateStream):
            tensors.drain()  # every replica still takes part in the stream's gathers
        raise
    if (own is not None) != holds_replicas(cfg):
        raise ValueError(f"save_checkpoint: own states are for partial sync at dp > 1 (sync.mode="
                         f"{cfg.sync.mode}, parallel.dp={cfg.parallel.dp}), given: {own is not None}")
    mine = _write_mine(path, step, cfg, tensors, state, rank, stage, replica, writer, own)
    gathered = comm.gather(mine, root=0)

    def commit():
        try:
            return _commit(root, path, step, cfg, gathered, keep, log)
        except BaseException as e:
            _abandon(root, path)
            if any(g["space"] for g in gathered) or is_space_error(e):
                raise CheckpointSpaceError(space_message(
                    root, f"the checkpoint of step {step}", need, str(e))) from e
            raise

    return root_then_bcast(comm, commit)
