"""Trusting a checkpoint: its manifest, its files, its model, and which one to resume from.

A checkpoint is usable when its manifest is present and readable, every shard it lists is a
plain file name inside the checkpoint (`shard-sNNN.h5`: no path, no link) present with the
manifest's size and SHA-256, and every parameter of the saved model is in exactly one shard
(`verify_checkpoint`, collective: the shards are hashed round-robin across ranks). Resuming
also needs the saved model section to equal the current one (`model_mismatch`);
`resolve_resume` applies `checkpoint.resume` (auto | never | PATH): `auto` with checkpoints
none of which is usable is an error naming each and why (`never` starts over explicitly).

    path = resolve_resume(cfg.checkpoint, cfg.run.dir, cfg.model, comm=c)   # or None: fresh
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from ratrain.checkpoint.collective import Solo, log_default, root_then_bcast
from ratrain.checkpoint.model import coverage_problems
from ratrain.checkpoint.names import FORMAT, FORMAT_VERSION, MANIFEST, SHARD_RE, CheckpointError
from ratrain.checkpoint.names import checkpoint_root, is_committed, linked_checkpoints
from ratrain.checkpoint.names import list_checkpoints
from ratrain.checkpoint.shard import sha256_file
from ratrain.config import CheckpointConfig, ModelConfig


def _load_manifest(path: str) -> dict:
    """The parsed manifest.json of `path` (CheckpointError when absent or not JSON)."""
    man = os.path.join(path, MANIFEST)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: a file, not a checkpoint directory (ckpt-NNNNNN)")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(man):
        if list_checkpoints(path):
            raise CheckpointError(
                f"{path}: a directory of checkpoints, not a checkpoint: give one of its "
                "ckpt-NNNNNN directories, or use checkpoint.resume=auto with checkpoint.dir set to it"
            )
        raise CheckpointError(
            f"{man}: missing: the checkpoint was never committed (an interrupted save?)"
        )
    try:
        with open(man, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{man}: unreadable or not JSON ({e})") from None


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`; CheckpointError naming the file when absent or bad."""
    manifest = _load_manifest(path)
    man = os.path.join(path, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{man}: not a ratrain checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{man}: format version {manifest['format_version']} is newer than this ratrain "
            f"reads ({FORMAT_VERSION}): upgrade ratrain"
        )
    for key in ("step", "files", "topology", "config"):
        if key not in manifest:
            raise CheckpointError(f"{man}: the manifest has no {key!r}")
    entry_keys = ("file", "stage", "bytes", "sha256", "params")
    if not isinstance(manifest["files"], list) or not manifest["files"] or not all(
        isinstance(e, dict) and all(k in e for k in entry_keys) for e in manifest["files"]
    ):
        raise CheckpointError(f"{man}: the file list is empty or malformed")
    for e in manifest["files"]:
        if not isinstance(e["file"], str) or not SHARD_RE.match(e["file"]):
            raise CheckpointError(
                f"{man}: lists the file {e['file']!r}, which is not a shard name inside the "
                "checkpoint (shard-sNNN.h5): refused")
    return manifest


def _file_problems(path: str, entry: dict, checksums: bool) -> list[str]:
    f = os.path.join(path, entry["file"])
    if os.path.islink(f):
        return [f"{f}: a symbolic link, not a shard: refused"]
    if not os.path.isfile(f):
        return [f"{f}: missing shard (stage {entry['stage']})"]
    size = os.path.getsize(f)
    if size != entry["bytes"]:
        return [f"{f}: truncated or resized: {size} bytes on disk, the manifest says {entry['bytes']}"]
    if checksums:
        sha = sha256_file(f)
        if sha != entry["sha256"]:
            return [
                (
                    f"{f}: checksum mismatch: sha256 {sha[:16]}..., the manifest says "
                    f"{entry['sha256'][:16]}...: the file is corrupted"
                )
            ]
    return []


def model_mismatch(saved: Mapping[str, Any], current: ModelConfig) -> list[str]:
    """`model.<key>: saved X, current Y` for each key of the model section that differs."""
    cur = dataclasses.asdict(current)
    return [
        f"model.{k}: saved {saved.get(k)!r}, current {cur[k]!r}"
        for k in cur
        if saved.get(k) != cur[k]
    ]


def verify_checkpoint(path: str, *, comm=None, checksums: bool = True) -> list[str]:
    """Problems that make checkpoint `path` unusable ([] = good), the same list on every rank.

    Checks: the manifest (present, readable), every shard present with the manifest's size and
    SHA-256, every parameter of the saved model in exactly one shard. With a communicator the
    shards are hashed round-robin across ranks and the verdicts gathered to rank 0.
    """
    comm = comm or Solo()

    def manifest_or_problem():
        try:
            return read_manifest(path), []
        except CheckpointError as e:
            return None, [str(e)]

    manifest, problems = root_then_bcast(comm, manifest_or_problem)
    if manifest is None:
        return problems
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = []
    for i, entry in enumerate(manifest["files"]):
        if i % size == rank:
            try:
                mine.extend(_file_problems(path, entry, checksums))
            except OSError as e:  # unreadable: a verdict, and the other ranks must hear it
                mine.append(f"{os.path.join(path, entry['file'])}: unreadable ({e})")

    def merge():
        out = [p for ps in gathered for p in ps]
        try:
            out.extend(coverage_problems(manifest, os.path.join(path, MANIFEST)))
        except Exception as e:  # noqa: BLE001 - a damaged manifest is a verdict, not a crash
            out.append(f"{os.path.join(path, MANIFEST)}: bad config or file list ({e})")
        return sorted(out)

    gathered = comm.gather(mine, root=0)
    return root_then_bcast(comm, merge)


def _incompatible(path: str, manifest: dict, model: ModelConfig | None) -> str | None:
    if model is None:
        return None
    diffs = model_mismatch(manifest["config"].get("model", {}), model)
    if not diffs:
        return None
    return (
        f"{path}: saved by an incompatible model: " + "; ".join(diffs) + ". Restore the model "
        "section, or set checkpoint.resume=never (or another checkpoint.dir) to start fresh"
    )


def _check_compatible(comm, path: str, model: ModelConfig | None) -> None:
    why = root_then_bcast(comm, lambda: _incompatible(path, read_manifest(path), model))
    if why:
        raise CheckpointError(why)


def _resume_named(comm, path: str, model: ModelConfig | None) -> str:
    """`checkpoint.resume: PATH`: that checkpoint, or an error saying what is wrong."""
    problems = verify_checkpoint(path, comm=comm)
    if problems:
        if len(problems) == 1:  # one line, with the fix
            raise CheckpointError(
                f"cannot resume from {path} (checkpoint.resume): "
                f"{problems[0].removeprefix(path + ': ')}; give a committed checkpoint directory "
                "(ckpt-NNNNNN), or checkpoint.resume=auto or never")
        raise CheckpointError(
            f"cannot resume from {path} (checkpoint.resume):\n  " + "\n  ".join(problems)
        )
    _check_compatible(comm, path, model)
    return path


def _resume_auto(comm, root: str, model: ModelConfig | None, say) -> str | None:
    """`checkpoint.resume: auto`: the newest committed checkpoint under `root` that verifies;
    None when there is none at all; an error naming each when there are some but none usable."""
    found, links = root_then_bcast(comm, lambda: (
        [(p, is_committed(p)) for _, p in reversed(list_checkpoints(root))],
        [p for _, p in linked_checkpoints(root)]))
    for path, _ in [f for f in found if not f[1]]:
        say(f"resume auto: skipping {path}: never committed (an interrupted save)")
    candidates = [p for p, done in found if done]
    skipped = [f"{p}: a symbolic link, not a checkpoint directory (refused)" for p in links]
    for path in candidates:
        problems = verify_checkpoint(path, comm=comm)
        if problems:
            say(f"resume auto: skipping {path}: " + "; ".join(problems))
            skipped.append(f"{path}: " + "; ".join(problems))
            continue
        _check_compatible(comm, path, model)
        say(f"resume auto: resuming from {path}"
            + (f" (skipped {len(skipped)})" if skipped else ""))
        return path
    if skipped:
        raise CheckpointError(
            f"checkpoint.resume=auto: {len(skipped)} checkpoint(s) under {root}, none usable:\n  "
            + "\n  ".join(skipped) + "\nrepair or remove them, give one with "
            "checkpoint.resume=PATH, or start over with checkpoint.resume=never (they are kept)")
    return None


def resolve_resume(
    ckpt: CheckpointConfig,
    run_dir: str,
    model: ModelConfig | None = None,
    *,
    comm=None,
    log: Callable[[str], None] | None = None,
) -> str | None:
    """The checkpoint to resume from, verified, or None to start fresh; the same on every rank.

    `checkpoint.resume`: `never` -> None; `auto` -> the newest committed checkpoint under
    `checkpoint_root(ckpt, run_dir)` that verifies (each one skipped is logged with the reason;
    None if there is no checkpoint at all, CheckpointError naming each if none is usable); a
    PATH -> that checkpoint, or CheckpointError saying what is wrong.
    With `model`, a checkpoint of a different model section is an error (not skipped), naming
    each key with its saved and current value. Collective over `comm`; only rank 0 logs.
    """
    comm = comm or Solo()
    rank = comm.Get_rank()

    def say(msg):
        if rank == 0:
            (log or log_default)(msg)

    if ckpt.resume == "never":
        return None
    if ckpt.resume != "auto":
        return _resume_named(comm, ckpt.resume, model)
    return _resume_auto(comm, checkpoint_root(ckpt, run_dir), model, say)
