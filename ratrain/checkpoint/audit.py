"""What a checkpoint's files must agree on before anything is drawn from them.

The manifest is checked like a shard: it carries the SHA-256 of its own content (`SEAL`, over
the canonical JSON of every other key: `seal` at the commit, `seal_problem` on reading), so an
edited digit or key anywhere in it is found, extra keys included; then its fields must have
their types (`schema_problem`) and agree with each other and with the directory: the step with
the directory's name, the file list with the topology (one shard per stage, named by it), the
topology with the saved config (pp, dp, every rank's place, each stage's layers)
(`agreement_problems`). Each shard whose size and SHA-256 match the manifest is then opened and
its own record compared with the manifest: format, step, stage, pp, dp, config, and every
parameter of every buffer it is said to hold, by name, shape and dtype (`shard_problems`).
A shard is never opened by HDF5 before its checksum matched (a damaged file is judged by
its bytes, not parsed).

`ratrain.checkpoint.verify` runs these checks (collectively) and decides; this module only
says what is wrong, one line per fault, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from ratrain.checkpoint.model import stage_bounds
from ratrain.checkpoint.names import BUFFER_GROUPS, FORMAT, SEAL, SHARD_RE, checkpoint_step
from ratrain.checkpoint.names import shard_name
from ratrain.checkpoint.replicas import REPLICA_RE, replica_problems
from ratrain.config import Config, config_from_dict

if TYPE_CHECKING:  # annotations only: functions import h5py where they read or write
    import h5py

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of a manifest's content without its seal: canonical JSON (sorted keys, no
    spaces), so the file's layout does not matter and every key, added ones included, does."""
    body = {k: v for k, v in manifest.items() if k != SEAL}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """The manifest with its seal (the last step before it is written: a key added after this
    breaks the seal)."""
    return {**manifest, SEAL: manifest_digest(manifest)}


def seal_problem(manifest: dict, version: int) -> str | None:
    """Why the manifest's seal does not hold (None: it holds, or a version-1 manifest, written
    before seals, carries none)."""
    if SEAL not in manifest:
        return None if version < 2 else f"no {SEAL!r} (format version {version} seals it)"
    got = manifest_digest(manifest)
    if manifest[SEAL] != got:
        return (f"checksum mismatch: the content hashes to sha256 {got[:16]}..., the manifest's "
                f"{SEAL} says {str(manifest[SEAL])[:16]}...: the manifest is corrupted or edited")
    return None


# -- the manifest's fields --------------------------------------------------------------------


def _int(v, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _entry_problem(i: int, e, key: str = "files") -> str | None:
    """A file entry's fields: `files` (model shards), or `replicas` (each replica's own state,
    partial sync: `ratrain.checkpoint.replicas`)."""
    name_re, form = (SHARD_RE, "shard-sNNN.h5") if key == "files" else (REPLICA_RE,
                                                                       "shard-sNNN-rRRR.h5")
    if not isinstance(e, dict):
        return f"the file list is malformed: {key}[{i}] is not an object"
    for k in ("file", "stage", "bytes", "sha256", "params") + (("replica",) * (key != "files")):
        if k not in e:
            return f"the file list is malformed: {key}[{i}] has no {k!r}"
    if not isinstance(e["file"], str) or not name_re.match(e["file"]):
        return (f"lists the file {e['file']!r}, which is not a shard name inside the checkpoint "
                f"({form}): refused")
    if not _int(e["stage"]) or not _int(e["bytes"]) or not _int(e.get("replica", 0)):
        return f"{e['file']}: its stage, replica or byte count is not a whole number >= 0"
    if not isinstance(e["sha256"], str) or not _SHA_RE.match(e["sha256"]):
        return f"{e['file']}: its sha256 is not 64 hex digits"
    params = e["params"]
    if not isinstance(params, dict) or not all(
            isinstance(s, list) and all(_int(d) for d in s) for s in params.values()):
        return f"{e['file']}: its parameter list is not {{name: [dimensions]}}"
    kinds = e.get("kinds", list(BUFFER_GROUPS))
    if not isinstance(kinds, list) or not kinds or any(k not in BUFFER_GROUPS for k in kinds):
        return f"{e['file']}: its kinds {kinds!r} are not buffers of {list(BUFFER_GROUPS)}"
    return None


def schema_problem(m: dict) -> str | None:
    """The first field of a manifest without its type (None: every field has it)."""
    for key in ("step", "files", "topology", "config"):
        if key not in m:
            return f"the manifest has no {key!r}"
    if not _int(m["step"]):
        return f"its step {m['step']!r} is not a whole number >= 0"
    if not isinstance(m["files"], list) or not m["files"]:
        return "the file list is empty or malformed"
    for i, e in enumerate(m["files"]):
        if why := _entry_problem(i, e):
            return why
    if not isinstance(m.get("replicas", []), list):
        return "its replica list is malformed"
    for i, e in enumerate(m.get("replicas", [])):
        if why := _entry_problem(i, e, "replicas"):
            return why
    topo = m["topology"]
    if not isinstance(topo, dict) or not all(_int(topo.get(k), 1) for k in ("pp", "dp")):
        return "its topology has no pp and dp (whole numbers >= 1)"
    if not isinstance(m["config"], dict):
        return "its config is not an object"
    return None


def _places(topo: dict) -> list[tuple[int, int]] | None:
    ranks = topo.get("ranks")
    if not isinstance(ranks, list) or not all(
            isinstance(r, dict) and _int(r.get("stage")) and _int(r.get("replica")) for r in ranks):
        return None
    return sorted((r["stage"], r["replica"]) for r in ranks)


def agreement_problems(path: str, m: dict) -> tuple[list[str], Config | None]:
    """What in a (well-typed) manifest disagrees with the directory's name or with itself;
    and the saved config (None when it does not load)."""
    out = []
    named = checkpoint_step(path)
    if named is not None and named != m["step"]:
        out.append(f"its step {m['step']} disagrees with the directory's name "
                   f"{os.path.basename(os.path.normpath(path))} (step {named})")
    topo, files = m["topology"], m["files"]
    pp, dp = topo["pp"], topo["dp"]
    stages = sorted(e["stage"] for e in files)
    if stages != list(range(pp)):
        out.append(f"its file list holds stages {stages}, its topology pp={pp} needs one shard "
                   f"per stage 0..{pp - 1}")
    out += [f"{e['file']} is listed for stage {e['stage']}, whose shard is "
            f"{shard_name(e['stage'])}" for e in files if e["file"] != shard_name(e["stage"])]
    grid = sorted((s, r) for s in range(pp) for r in range(dp))
    if topo.get("world_size") != pp * dp or _places(topo) != grid:
        out.append(f"its topology's ranks (world size {topo.get('world_size')!r}) are not "
                   f"the {pp} x {dp} grid of stages and replicas")
    try:
        cfg = config_from_dict(m["config"])
    except Exception as e:  # noqa: BLE001 - a damaged config is a verdict, not a crash
        return [*out, f"its config does not load ({' '.join(str(e).split())})"], None
    out += replica_problems(m, cfg)
    if (cfg.parallel.pp, cfg.parallel.dp) != (pp, dp):
        out.append(f"its topology pp={pp} x dp={dp} disagrees with its config's parallel "
                   f"pp={cfg.parallel.pp} x dp={cfg.parallel.dp}")
    else:
        try:
            bounds = stage_bounds(cfg)
        except Exception as e:  # noqa: BLE001
            bounds = f"unplannable ({e})"
        if topo.get("stage_layers") != bounds:
            out.append(f"its stages' layers {topo.get('stage_layers')!r} disagree with its "
                       f"config's split {bounds}")
    return out, cfg


# -- one shard against the manifest ----------------------------------------------------------


def _attr(f: h5py.File, key: str) -> Any:
    v = f.attrs.get(key)
    if isinstance(v, bytes):
        v = v.decode()
    return v.item() if isinstance(v, np.generic) else v


def _record_problem(f: h5py.File, entry: dict, m: dict, cfg: Config | None) -> str | None:
    want = {"format": FORMAT, "step": m["step"], "stage": entry["stage"],
            "pp": m["topology"]["pp"], "dp": m["topology"]["dp"]}
    for key, value in want.items():
        got = _attr(f, key)
        if got != value:
            return f"its {key} is {got!r}, the manifest says {value!r}"
    if cfg is not None and config_from_dict(yaml.safe_load(_attr(f, "config"))) != cfg:
        return "its config differs from the manifest's"
    if not isinstance(json.loads(_attr(f, "state")), dict):
        return "its training state is not a JSON object"
    return None


def _dataset_problem(f: h5py.File, entry: dict) -> str | None:
    import h5py  # only a rank that reads or writes a shard loads HDF5 (~12 MiB)
    for name, shape in entry["params"].items():
        for kind in entry.get("kinds", list(BUFFER_GROUPS)):
            ds = f.get(f"{BUFFER_GROUPS[kind]}/{name}")
            if not isinstance(ds, h5py.Dataset):
                return f"holds no {BUFFER_GROUPS[kind]}/{name}, which the manifest lists"
            if tuple(ds.shape) != tuple(shape) or ds.dtype != np.float32:
                return (f"{BUFFER_GROUPS[kind]}/{name} is {ds.dtype} {tuple(ds.shape)}, the "
                        f"manifest says float32 {tuple(shape)}")
    return None


def shard_problems(file: str, entry: dict, m: dict, cfg: Config | None) -> tuple[list[str], str]:
    """A shard (its bytes already verified) against the manifest: its record (format, step,
    stage, pp, dp, config, a state that is a JSON object) and its datasets (every listed
    parameter of every buffer, by shape and dtype). Returns (problems, the SHA-256 of its
    training state, which every shard must share)."""
    import h5py  # only a rank that reads or writes a shard loads HDF5 (~12 MiB)
    try:
        with h5py.File(file, "r") as f:
            why = _record_problem(f, entry, m, cfg) or _dataset_problem(f, entry)
            state = hashlib.sha256(str(_attr(f, "state")).encode()).hexdigest()
    except Exception as e:  # noqa: BLE001 - unreadable: a verdict, never a crash
        return [f"{file}: unreadable as a shard ({type(e).__name__}: {' '.join(str(e).split())})"], ""
    return ([f"{file}: {why}"] if why else []), state


__all__ = ["agreement_problems", "manifest_digest", "schema_problem", "seal", "seal_problem",
           "shard_problems"]
