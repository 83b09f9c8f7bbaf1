"""Trusting a checkpoint: its manifest, its files, its model, and which one to resume from.

`verify_checkpoint` is the one place that decides whether a checkpoint is usable, collectively
(the shards are checked round-robin across ranks) and before anything is built or read from
it: its manifest present, readable and sealed, its step, file list, topology and config in
agreement with each other and with the directory's name (`read_manifest`, which every reader
of a manifest goes through), no unlisted shard beside them, every parameter of the saved model
in exactly one shard, and every shard a plain file (`shard-sNNN.h5`: no path, no link) with the
manifest's size and SHA-256 whose own record (step, stage, topology, config, state) and
datasets (names, shapes, dtypes) agree with the manifest (`ratrain.checkpoint.audit`).
Resuming also needs the saved model section to equal the current one (`model_mismatch`);
`resolve_resume` applies `checkpoint.resume` (auto | never | PATH): `auto` skips each unusable
checkpoint with its reason and takes the newest usable one; with checkpoints none of which is
usable it is a one-line error naming each and why (`never` starts over explicitly).

    path = resolve_resume(cfg.checkpoint, cfg.run.dir, cfg.model, comm=c)   # or None: fresh
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ratrain.checkpoint.audit import agreement_problems, schema_problem, seal_problem
from ratrain.checkpoint.audit import shard_problems
from ratrain.checkpoint.collective import Solo, log_default, root_then_bcast
from ratrain.checkpoint.model import coverage_problems
from ratrain.checkpoint.names import BUFFER_GROUPS, FORMAT, FORMAT_VERSION, MANIFEST, SHARD_RE
from ratrain.checkpoint.names import CheckpointError
from ratrain.checkpoint.names import checkpoint_root, is_committed, linked_checkpoints
from ratrain.checkpoint.names import list_checkpoints
from ratrain.checkpoint.replicas import REPLICA_RE, replica_entries
from ratrain.checkpoint.shard import sha256_file
from ratrain.config import CheckpointConfig, Config, ModelConfig


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
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{man}: unreadable or not JSON ({e})") from None


def _checked_manifest(path: str) -> tuple[dict, Config | None]:
    """The manifest of `path`, its seal, fields and agreement checked; and its saved config."""
    manifest = _load_manifest(path)
    man = os.path.join(path, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{man}: not a ratrain checkpoint manifest")
    version = manifest.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{man}: format version {version!r} is newer than this ratrain reads "
            f"({FORMAT_VERSION}): upgrade ratrain")
    why = seal_problem(manifest, version) or schema_problem(manifest)
    if why:
        raise CheckpointError(f"{man}: {why}")
    problems, cfg = agreement_problems(path, manifest)
    if problems:
        raise CheckpointError(f"{man}: " + "; ".join(problems))
    return manifest, cfg


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`, trusted as far as it alone can be: present, JSON, its
    seal intact (`audit.seal_problem`), every field typed, its step the directory's, its file
    list, topology and config in agreement (`ratrain.checkpoint.audit`); CheckpointError (one
    line, naming the file) otherwise. Its shards are `verify_checkpoint`'s."""
    return _checked_manifest(path)[0]


def _file_problems(path: str, entry: dict, checksums: bool) -> list[str]:
    """The bytes of one listed shard: a plain file, the manifest's size and SHA-256."""
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


def _shard_verdict(path, entry, manifest, cfg, checksums, buffers) -> tuple[list[str], str]:
    """One shard: its bytes, then (only when its checksum matched) its record and datasets
    against the manifest, and the buffers the caller will load; (problems, state digest)."""
    f = os.path.join(path, entry["file"])
    held = entry.get("kinds", list(BUFFER_GROUPS))
    missing = [b for b in buffers if b not in held]
    if missing:
        return [f"{f}: holds no {missing[0]!r} state (it holds {', '.join(held)}), which "
                "this use needs"], ""
    try:
        problems = _file_problems(path, entry, checksums)
    except OSError as e:  # unreadable: a verdict, and the other ranks must hear it
        return [f"{f}: unreadable ({e})"], ""
    if problems or not checksums:
        return problems, ""
    return shard_problems(f, entry, manifest, cfg)


def _strays(path: str, manifest: dict) -> list[str]:
    """Shard files in the directory that the manifest does not list (from another checkpoint?)."""
    listed = {e["file"] for e in _shards(manifest)}
    return [f"{os.path.join(path, n)}: a shard the manifest does not list (another checkpoint's?)"
            for n in sorted(os.listdir(path))
            if (SHARD_RE.match(n) or REPLICA_RE.match(n)) and n not in listed]


def _shards(manifest: dict) -> list[dict]:
    """Every file entry: the model shards, then each replica's own (`checkpoint.replicas`)."""
    return manifest["files"] + replica_entries(manifest)


def model_mismatch(saved: Mapping[str, Any], current: ModelConfig) -> list[str]:
    """`model.<key>: saved X, current Y` for each key of the model section that differs."""
    cur = dataclasses.asdict(current)
    return [
        f"model.{k}: saved {saved.get(k)!r}, current {cur[k]!r}"
        for k in cur
        if saved.get(k) != cur[k]
    ]


def verify_checkpoint(path: str, *, comm=None, checksums: bool = True,
                      buffers: Iterable[str] = ()) -> list[str]:
    """Problems that make checkpoint `path` unusable ([] = good), the same list on every rank:
    the one place that decides, making every check a load would make later.

    Checks the manifest (`read_manifest`: present, sealed, typed, its step, file list, topology
    and config in agreement with each other and the directory's name), no shard in the
    directory that it does not list, every parameter of the saved model in exactly one shard
    with its shape, and each shard: a plain file with the manifest's size and SHA-256, then
    (`audit.shard_problems`) its own step, stage, pp, dp, config and state against the
    manifest's and every listed dataset by name, shape and dtype; every shard holding
    `buffers` (those the caller will load) and all of them one training state.
    `checksums=False` (`show` without --verify) checks sizes only, not the shards' contents.
    With a communicator the shards are checked round-robin across ranks and the verdicts
    gathered to rank 0. Never raises for a damaged checkpoint.
    """
    comm = comm or Solo()
    buffers = list(buffers)

    def manifest_or_problem():
        try:
            manifest, cfg = _checked_manifest(path)
            return manifest, cfg, _strays(path, manifest)
        except CheckpointError as e:
            return None, None, [str(e)]
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint is a verdict, not a crash
            return None, None, [f"{path}: unreadable ({type(e).__name__}: {e})"]

    manifest, cfg, problems = root_then_bcast(comm, manifest_or_problem)
    if manifest is None:
        return problems
    rank, size = comm.Get_rank(), comm.Get_size()
    mine: list[tuple[list[str], str]] = []
    for i, entry in enumerate(_shards(manifest)):
        if i % size == rank:
            try:
                mine.append(_shard_verdict(path, entry, manifest, cfg, checksums, buffers))
            except Exception as e:  # noqa: BLE001 - the other ranks must hear it
                mine.append(([f"{os.path.join(path, entry['file'])}: unreadable ({e})"], ""))

    def merge():
        verdicts = [v for vs in gathered for v in vs]
        out = problems + [p for ps, _ in verdicts for p in ps]
        states = {s for _, s in verdicts if s}
        if len(states) > 1:
            out.append(f"{path}: its shards hold {len(states)} different training states "
                       "(shards of different checkpoints?)")
        try:
            out.extend(coverage_problems(manifest, os.path.join(path, MANIFEST)))
        except Exception as e:  # noqa: BLE001 - a damaged manifest is a verdict, not a crash
            out.append(f"{os.path.join(path, MANIFEST)}: bad config or file list ({e})")
        return sorted(out)

    gathered = comm.gather(mine, root=0)
    return root_then_bcast(comm, merge)


def _incompatible(path: str, saved: Config, model: ModelConfig | None) -> str | None:
    """Why the saved model (as the config loads it: defaults filled in) is not `model`."""
    if model is None:
        return None
    diffs = model_mismatch(dataclasses.asdict(saved.model), model)
    if not diffs:
        return None
    return (
        f"{path}: saved by an incompatible model: " + "; ".join(diffs) + ". Restore the model "
        "section, or set checkpoint.resume=never (or another checkpoint.dir) to start fresh"
    )


def _check_compatible(comm, path: str, model: ModelConfig | None) -> None:
    why = root_then_bcast(comm, lambda: _incompatible(path, _checked_manifest(path)[1], model))
    if why:
        raise CheckpointError(why)


def _within(problem: str, path: str) -> str:
    """A problem of checkpoint `path` as one line, without the checkpoint's own name in front
    (a file in it keeps its full path)."""
    return " ".join(problem.removeprefix(path + ": ").split())


def _first(problems: list[str], path: str) -> str:
    """One line for a list of problems: the first, and how many more there are."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return _within(problems[0], path) + more


def _resume_named(comm, path: str, model: ModelConfig | None) -> str:
    """`checkpoint.resume: PATH`: that checkpoint, or a one-line error saying what is wrong."""
    problems = verify_checkpoint(path, comm=comm, buffers=BUFFER_GROUPS)
    if problems:
        raise CheckpointError(
            f"cannot resume from {path} (checkpoint.resume): {_first(problems, path)}; give a "
            "committed checkpoint directory (ckpt-NNNNNN), or checkpoint.resume=auto or never")
    _check_compatible(comm, path, model)
    return path


def _resume_auto(comm, root: str, model: ModelConfig | None, say) -> str | None:
    """`checkpoint.resume: auto`: the newest committed checkpoint under `root` that verifies
    (those skipped are logged, one line each, once one is found); None when there is none at
    all; a one-line error naming each and its first fault when there are some but none usable."""
    found, links = root_then_bcast(comm, lambda: (
        [(p, is_committed(p)) for _, p in reversed(list_checkpoints(root))],
        [p for _, p in linked_checkpoints(root)]))
    notes = [f"resume auto: skipping {p}: never committed (an interrupted save)"
             for p, done in found if not done]
    skipped = [(p, ["a symbolic link, not a checkpoint directory (refused)"]) for p in links]
    for path in [p for p, done in found if done]:
        problems = verify_checkpoint(path, comm=comm, buffers=BUFFER_GROUPS)
        if problems:
            notes.append(f"resume auto: skipping {path}: "
                         + "; ".join(_within(p, path) for p in problems))
            skipped.append((path, problems))
            continue
        _check_compatible(comm, path, model)
        for note in notes:
            say(note)
        say(f"resume auto: resuming from {path}"
            + (f" (skipped {len(skipped)})" if skipped else ""))
        return path
    if skipped:
        raise CheckpointError(
            f"checkpoint.resume=auto: {len(skipped)} checkpoint(s) under {root}, none usable ("
            + "; ".join(f"{os.path.basename(p)}: {_first(ps, p)}" for p, ps in skipped)
            + "): repair or remove them, give one with checkpoint.resume=PATH, or start over "
            "with checkpoint.resume=never (they are kept)")
    for note in notes:
        say(note)
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
    `checkpoint_root(ckpt, run_dir)` that verifies (`verify_checkpoint`, needing master, m
    and v; each one skipped is logged with the reason, one line each; None if there is no
    checkpoint at all, a one-line CheckpointError naming each if none is usable); a PATH ->
    that checkpoint, or a one-line CheckpointError saying what is wrong.
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
