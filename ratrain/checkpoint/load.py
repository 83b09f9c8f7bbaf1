"""Loading a committed checkpoint into any pp x dp layout (resharding on load).

Names are global, so each rank reads each parameter it needs from whichever shard holds it
(saved at pp=4, resumed at pp=2), straight into its own buffers when it passes them:

    ck = load_checkpoint(path, state.names, out=state.state_dict())          # reads in place
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from ratrain.checkpoint.names import BUFFER_GROUPS, CheckpointError
from ratrain.checkpoint.replicas import replica_entries
from ratrain.checkpoint.verify import read_manifest
from ratrain.config import config_from_dict

if TYPE_CHECKING:  # annotations only: functions import h5py where they read or write
    import h5py


def _read_into(ds: h5py.Dataset, dst) -> None:
    if tuple(dst.shape) != tuple(ds.shape):
        raise CheckpointError(
            f"{ds.file.filename}:{ds.name} has shape {tuple(ds.shape)}, the destination "
            f"{tuple(dst.shape)}"
        )
    if isinstance(dst, np.ndarray) and dst.dtype == ds.dtype and dst.flags.c_contiguous:
        ds.read_direct(dst)  # straight into the caller's buffer
    elif isinstance(dst, np.ndarray):
        dst[...] = ds[()]
    else:  # a device array: through host memory, one parameter at a time
        dst.set(np.ascontiguousarray(ds[()], dtype=dst.dtype))


def _by_file(path: str, entries: list[dict], names: Iterable[str] | None) -> dict[str, list[str]]:
    """{shard file of `entries`: the asked-for names it holds} (None: every parameter)."""
    where = {n: e["file"] for e in entries for n in e["params"]}
    names = list(where) if names is None else list(names)
    missing = [n for n in names if n not in where]
    if missing:
        raise CheckpointError(
            f"{path}: has no parameter {missing[0]!r} ({len(missing)} missing): a checkpoint of "
            "another model?"
        )
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(where[n], []).append(n)
    return out


def _read_shard(f: h5py.File, names: list[str], buffers: list[str], out, result: dict) -> None:
    for n in names:
        for b in buffers:
            ds = f[f"{BUFFER_GROUPS[b]}/{n}"]
            if out is not None:
                dst = out[b][n]
                _read_into(ds, dst)
            else:
                dst = ds[()]
            result[b][n] = dst


def load_checkpoint(
    path: str,
    names: Iterable[str] | None = None,
    *,
    out: Mapping[str, Mapping[str, Any]] | None = None,
    buffers: Iterable[str] = ("master", "m", "v"),
    replica: int | None = None,
) -> dict:
    """Read a committed checkpoint's state for exactly the parameters `names` (None: all).

    Reads each name from whichever shard holds it, so any pp x dp layout can load any
    checkpoint. With `out` ({"master"|"m"|"v": {name: array}}, e.g. `StageState.state_dict()`)
    the values are read straight into those arrays (no extra memory; materialise fp16 views
    afterwards); otherwise new arrays are returned. fp32 in, fp32 out: bitwise exact.
    `buffers` picks which of master, m, v to read; `replica`: that replica's own state
    (a partial-sync checkpoint's `replicas`, `checkpoint.replicas.resume_replica`), not the
    model shards.

    Returns {"path", "step", "state" (the dict given to save), "config" (a Config),
    "topology", "master", "m", "v" ({name: array})}. Verification is `resolve_resume`'s job
    (collective); this function trusts the manifest's file list.
    """
    import h5py  # only a rank that reads or writes a shard loads HDF5 (~12 MiB)

    manifest = read_manifest(path)
    buffers = list(buffers)
    listed = manifest["files"] if replica is None else replica_entries(manifest, replica)
    if not listed:
        raise CheckpointError(f"{path}: holds no state of replica {replica}")
    entries = {e["file"]: e for e in listed}
    result: dict[str, Any] = {b: {} for b in buffers}
    for fname, fnames in _by_file(path, listed, names).items():
        held = entries[fname].get("kinds", list(BUFFER_GROUPS))  # the manifest's word for buffers
        for b in buffers:
            if b not in held:
                raise CheckpointError(f"{os.path.join(path, fname)}: holds no {b!r} state")
        with h5py.File(os.path.join(path, fname), "r") as f:
            _read_shard(f, fnames, buffers, out, result)
    first = os.path.join(path, manifest["files"][0]["file"])
    with h5py.File(first, "r") as f:
        state = json.loads(f.attrs["state"])
        step = int(f.attrs["step"])
        config = config_from_dict(yaml.safe_load(f.attrs["config"]), first)
    if step != manifest["step"]:
        raise CheckpointError(f"{first}: step {step} but the manifest says {manifest['step']}")
    result.update(path=path, step=step, state=state, config=config, topology=manifest["topology"])
    return result
