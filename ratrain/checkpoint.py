"""HDF5 checkpoints that survive crashes, resume bit for bit, and reshard on load.

Layout of one checkpoint (`<checkpoint.dir>/ckpt-000100/`, default dir `<run.dir>/checkpoints`):

    shard-s000.h5     stage 0's state, written by replica 0 of stage 0
    shard-s001.h5     ...one file per pipeline stage
    manifest.json     written last, by rank 0, after every shard is on disk: the commit mark

A shard holds, as fp32 datasets named by *global* parameter name, `master/<name>`,
`optim/m/<name>` and `optim/v/<name>` (e.g. `master/layers.7.attn.wq`), and as root attributes
the step, the scalar training state (JSON: data position, optimizer and loss-scaler state, RNG
state, whatever the trainer passes; it must be the same on every rank), the resolved config
(YAML), the stage and the topology. Replicas hold identical state, so replicas other than 0 write
nothing. The manifest lists every file with its size and SHA-256, which parameters (and shapes)
it holds, the topology, the step, the config and the ratrain version. Because names are global a
checkpoint loads into any pp x dp layout: each rank reads each name it needs from whichever shard
holds it (saved at pp=4, resumed at pp=2).

Commit protocol (a SIGKILL at any moment leaves the previous committed checkpoint intact):
each shard is written under a temporary name (`.shard-s000.h5.tmp`), fsynced and renamed, the
directory fsynced; the writers' sizes and hashes are gathered to rank 0, which checks that every
stage wrote its shard and every parameter of the model is there once, then writes
`manifest.json` the same way (temp, fsync, rename, fsync). Only a directory with a manifest
counts. Older checkpoints beyond `checkpoint.keep` are removed after that, manifest first, so a
kill during removal leaves an uncommitted directory, never a damaged committed one. Leftovers of
killed saves are ignored by resume and removed by the next save.

Streaming: a shard is created with h5py with every dataset's space allocated up front (early
allocation, no fill), then the parameter bytes are written with `os.pwrite` straight from the
caller's arrays (views into the flat buffers: no copy) in file order, while a second thread
computes the SHA-256 of the same bytes (hashlib and pwrite both release the GIL) and the
metadata between them is read back; the file's hash is thus known when the last byte is written,
without reading the file again; every 32 MiB written, `posix_fadvise(DONTNEED)` starts the
writeback early, so the final fsync waits for little. `_write_shard_plain` (h5py `create_dataset(data=...)`, then hash
by reading the file) is the plain reference the fast path is tested against.

Collectives: `comm` is anything mpi4py-like with `Get_rank`, `Get_size`, `gather`, `bcast`
(pickled, lower-case), or None for one process. They are control-plane calls made between steps,
never in the training hot path; if a communication engine thread owns MPI, call these functions
while it is idle or pass a wrapper whose methods run through the engine.

    path = save_checkpoint(root, step, cfg, state.state_dict(), scalars, stage=s, replica=r, comm=c)
    path = resolve_resume(cfg.checkpoint, cfg.run.dir, cfg.model, comm=c)   # or None: fresh
    ck = load_checkpoint(path, state.names, out=state.state_dict())          # reads in place
    python -m ratrain.checkpoint show runs/tiny/checkpoints/ckpt-000100 --verify
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import queue
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import h5py
import numpy as np
import yaml

import ratrain
from ratrain.config import CheckpointConfig, Config, ModelConfig, config_from_dict

FORMAT = "ratrain-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KINDS = {"master": "master", "m": "optim/m", "v": "optim/v"}  # kind -> HDF5 group
_CKPT_RE = re.compile(r"^ckpt-(\d{6,})$")
_CHUNK = 8 << 20  # bytes per pwrite / hash update / read
_WRITEBACK = 32 << 20  # start the writeback of every this many bytes written
_fadvise = hasattr(os, "posix_fadvise")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, trusted or used; the message names file and fault."""


# --------------------------------------------------------------------------------------------
# Names and listing
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Collectives (mpi4py-like comm, or one process)
# --------------------------------------------------------------------------------------------


class _Solo:
    """The communicator of a single process."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def gather(self, obj, root=0):
        return [obj]

    def bcast(self, obj, root=0):
        return obj


def _root_then_bcast(comm, fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0, broadcast its result; a failure raises the same error on every rank."""
    res = None
    if comm.Get_rank() == 0:
        try:
            res = ("ok", fn())
        except CheckpointError as e:
            res = ("err", str(e))
        except Exception as e:  # noqa: BLE001 - any failure on rank 0 must reach the others
            res = ("err", f"{type(e).__name__}: {e}")
    res = comm.bcast(res, root=0)
    if res[0] == "err":
        raise CheckpointError(res[1])
    return res[1]


# --------------------------------------------------------------------------------------------
# Durable files
# --------------------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically: temp name, fsync, rename, fsync the directory."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def sha256_file(path: str) -> str:
    """SHA-256 of a file, read in chunks (bounded memory)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        mv = memoryview(buf)
        while n := f.readinto(buf):
            h.update(mv[:n])
    return h.hexdigest()


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)  # exact: float32/float64 -> Python float
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"checkpoint state value {o!r} ({type(o).__name__}) is not JSON-serialisable")


def _state_json(state: Mapping | None) -> str:
    return json.dumps(dict(state or {}), sort_keys=True, default=_json_default)


# --------------------------------------------------------------------------------------------
# Writing one shard
# --------------------------------------------------------------------------------------------


def _host(a) -> np.ndarray:
    """A C-contiguous float32 numpy array of `a` (a copy only for cupy / strided input)."""
    if hasattr(a, "get") and not isinstance(a, np.ndarray):  # cupy
        a = a.get()
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise CheckpointError(f"checkpoints store fp32 state; got an array of dtype {a.dtype}")
    return np.ascontiguousarray(a)


class StateStream:
    """A shard's state delivered block by block instead of as one mapping.

    For sharded optimizer state (`ratrain` at dp > 1) the whole parameters exist only while a
    block is gathered: `blocks` yields `(block, {kind: {global name: fp32 array}})` in model
    order (e.g. `Executor.iter_full_state()`), each block's arrays valid until the next is
    asked for. `shapes` gives every parameter's shape up front, in the order the blocks deliver
    them, so the file layout is fixed before any byte is written; at most one block is held.
    """

    def __init__(self, shapes: Mapping[str, Any], kinds: Iterable[str], blocks):
        self.shapes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
        self.kinds = tuple(k for k in KINDS if k in set(kinds))
        self._blocks = blocks

    def drain(self) -> None:
        """Run the stream without writing (a replica that does not write still takes part in
        the collectives that produce each block)."""
        for _ in self._blocks:
            pass

    def items(self):
        """(kind, name, array) in file order: by parameter, master / m / v within one."""
        seen = []
        for block, arrays in self._blocks:
            names = list(arrays[self.kinds[0]])
            for name in names:
                for k in self.kinds:
                    a = arrays[k][name]
                    if tuple(a.shape) != self.shapes.get(name):
                        raise CheckpointError(
                            f"save_checkpoint: block {block!r} gave {k}[{name!r}] of shape "
                            f"{tuple(a.shape)}, expected {self.shapes.get(name)}")
                    yield k, name, a
            seen.extend(names)
        if seen != list(self.shapes):
            raise CheckpointError("save_checkpoint: the block stream did not deliver every "
                                  "parameter of the shard in order")


class _MappingStream(StateStream):
    """A mapping {kind: {name: array}} seen as a stream (one block holding everything)."""

    def __init__(self, tensors: Mapping[str, Mapping[str, Any]], names: list[str]):
        shapes = {n: tensors["master"][n].shape for n in names}
        super().__init__(shapes, tensors, [("*", tensors)])


def _stream(tensors) -> StateStream:
    if isinstance(tensors, StateStream):
        return tensors
    return _MappingStream(tensors, _shard_plan(tensors))


def _shard_plan(tensors: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The parameter names of a shard (order of `tensors['master']`), checked across kinds."""
    if "master" not in tensors:
        raise CheckpointError("save_checkpoint: tensors must hold 'master' (and 'm', 'v')")
    unknown = [k for k in tensors if k not in KINDS]
    if unknown:
        raise CheckpointError(f"save_checkpoint: unknown state kind {unknown[0]!r}; kinds: master, m, v")
    names = list(tensors["master"])
    for kind, arrays in tensors.items():
        if set(arrays) != set(names):
            diff = sorted(set(arrays) ^ set(names))
            raise CheckpointError(
                f"save_checkpoint: {kind!r} and 'master' hold different parameters ({diff[0]!r})"
            )
        for name in names:
            if tuple(arrays[name].shape) != tuple(tensors["master"][name].shape):
                raise CheckpointError(
                    f"save_checkpoint: {kind}[{name!r}] has shape {tuple(arrays[name].shape)}, "
                    f"master has {tuple(tensors['master'][name].shape)}"
                )
    return names


def _write_attrs(f: h5py.File, step: int, stage: int, cfg: Config, state_json: str) -> None:
    f.attrs["format"] = FORMAT
    f.attrs["format_version"] = FORMAT_VERSION
    f.attrs["ratrain_version"] = ratrain.__version__
    f.attrs["step"] = int(step)
    f.attrs["stage"] = int(stage)
    f.attrs["pp"] = int(cfg.parallel.pp)
    f.attrs["dp"] = int(cfg.parallel.dp)
    f.attrs["config"] = cfg.to_yaml()
    f.attrs["state"] = state_json


def _raw_dcpl():
    """Contiguous layout, space allocated at creation, never filled: we write the bytes."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def _write_shard_fast(tmp: str, step, stage, cfg, stream: StateStream, state_json) -> tuple[int, str]:
    """Write a shard to `tmp`: layout with h5py, bytes with pwrite, SHA-256 alongside; fsync."""
    offsets = {}  # (kind, name) -> file offset
    with h5py.File(tmp, "w") as f:
        _write_attrs(f, step, stage, cfg, state_json)
        for name, shape in stream.shapes.items():  # by parameter: master, m, v lie together
            for kind in stream.kinds:
                ds = f.create_dataset(f"{KINDS[kind]}/{name}", shape=shape, dtype=np.float32,
                                      dcpl=_raw_dcpl())
                off = ds.id.get_offset()
                if off is not None:  # None: an empty dataset (no storage)
                    offsets[kind, name] = off

    h = hashlib.sha256()
    chunks: queue.Queue = queue.Queue()  # views of caller memory: unbounded costs no memory

    def hasher():
        while (c := chunks.get()) is not None:
            h.update(c)
            chunks.task_done()
        chunks.task_done()

    thread = threading.Thread(target=hasher, name="ckpt-sha256", daemon=True)
    thread.start()
    fd = os.open(tmp, os.O_RDWR)
    rehash = False
    try:
        size = os.fstat(fd).st_size
        pos = flushed = 0
        for kind, name, src in stream.items():
            off = offsets.get((kind, name))
            if off is None:
                continue
            if off < pos:
                # HDF5 packs datasets under 2 KiB into a small-data block laid out early, so
                # a streamed shard of a tiny model can deliver one behind the write position:
                # write it where it belongs and hash the finished file instead.
                a = _host(src)
                if os.pwrite(fd, memoryview(a.reshape(-1)).cast("B"), off) != a.nbytes:
                    raise CheckpointError(f"{tmp}: short write: disk full?")
                rehash = True
                continue
            a = _host(src)
            copied = not (isinstance(src, np.ndarray) and np.may_share_memory(a, src))
            if off > pos:  # HDF5 metadata between datasets
                chunks.put(os.pread(fd, off - pos, pos))
            mv = memoryview(a.reshape(-1)).cast("B")
            for i in range(0, len(mv), _CHUNK):
                c = mv[i : i + _CHUNK]
                n = os.pwrite(fd, c, off + i)
                if n != len(c):
                    raise CheckpointError(f"{tmp}: short write ({n} of {len(c)} bytes): disk full?")
                chunks.put(c)
                if _fadvise and off + i + len(c) - flushed >= _WRITEBACK:
                    # Start writing back what is written (async), so the final fsync has
                    # little left to wait for; clean pages then leave the page cache.
                    os.posix_fadvise(fd, flushed, off + i + len(c) - flushed, os.POSIX_FADV_DONTNEED)
                    flushed = off + i + len(c)
            pos = off + len(mv)
            if copied or not isinstance(stream, _MappingStream):
                chunks.join()  # keep at most one copied / streamed parameter alive
        if size > pos:
            chunks.put(os.pread(fd, size - pos, pos))
        chunks.put(None)
        os.fsync(fd)  # overlaps the hasher's tail
        thread.join()
        size = max(size, pos)
        if rehash:
            h = hashlib.sha256()
            for i in range(0, size, _CHUNK):
                h.update(os.pread(fd, min(_CHUNK, size - i), i))
    finally:
        os.close(fd)
        if thread.is_alive():  # an error above: stop the hasher
            chunks.put(None)
            thread.join()
    return size, h.hexdigest()


def _write_shard_plain(tmp: str, step, stage, cfg, stream: StateStream, state_json) -> tuple[int, str]:
    """Reference writer: h5py writes the datasets, then the file is hashed by reading it."""
    with h5py.File(tmp, "w") as f:
        _write_attrs(f, step, stage, cfg, state_json)
        for kind, name, src in stream.items():
            f.create_dataset(f"{KINDS[kind]}/{name}", data=_host(src))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return os.path.getsize(tmp), sha256_file(tmp)


def write_shard(path, step, stage, cfg, tensors, state=None, *, writer: str = "fast") -> dict:
    """Write stage `stage`'s shard into checkpoint directory `path` (temp, fsync, rename).

    Returns its manifest entry: {"file", "stage", "bytes", "sha256", "kinds", "params"}.
    """
    stream = _stream(tensors)
    fname = shard_name(stage)
    final = os.path.join(path, fname)
    tmp = os.path.join(path, f".{fname}.tmp")
    fn = {"fast": _write_shard_fast, "plain": _write_shard_plain}[writer]
    try:
        size, sha = fn(tmp, step, stage, cfg, stream, _state_json(state))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    os.replace(tmp, final)
    _fsync_dir(path)
    return {
        "file": fname,
        "stage": int(stage),
        "bytes": int(size),
        "sha256": sha,
        "kinds": list(stream.kinds),
        "params": {n: list(shape) for n, shape in stream.shapes.items()},
    }


# --------------------------------------------------------------------------------------------
# Saving a checkpoint (collective)
# --------------------------------------------------------------------------------------------


def _log_default(msg: str) -> None:
    print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)


def _remove_checkpoint(path: str) -> None:
    """Un-commit (manifest first, durably), then delete."""
    man = os.path.join(path, MANIFEST)
    if os.path.exists(man):
        os.unlink(man)
        _fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def _prepare_dir(root: str, path: str) -> None:
    os.makedirs(root, exist_ok=True)
    if os.path.exists(path):  # leftovers of a killed save, or a checkpoint of this step replaced
        _remove_checkpoint(path)
    os.mkdir(path)
    _fsync_dir(root)


def _expected_params(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    from ratrain.exec.spec import model_blocks

    return {p.name: tuple(p.shape) for b in model_blocks(model) for p in b.params}


def _coverage_problems(manifest: dict, where: str) -> list[str]:
    """Every parameter of the saved model in exactly one file, with its shape."""
    model = config_from_dict(manifest["config"]).model
    want = _expected_params(model)
    seen: dict[str, str] = {}
    problems = []
    for e in manifest["files"]:
        for name, shape in e["params"].items():
            if name in seen:
                problems.append(f"{where}: parameter {name!r} is in both {seen[name]} and {e['file']}")
            elif name not in want:
                problems.append(f"{where}: {e['file']} holds {name!r}, which the model does not have")
            elif tuple(shape) != want[name]:
                problems.append(
                    f"{where}: {e['file']} holds {name!r} with shape {tuple(shape)}, the model's "
                    f"is {want[name]}"
                )
            seen[name] = e["file"]
    missing = [n for n in want if n not in seen]
    if missing:
        problems.append(
            f"{where}: {len(missing)} parameter(s) of the model are in no shard, first {missing[0]!r}"
        )
    return problems


def _prune(root: str, keep: int, step: int, log) -> None:
    """Keep the `keep` newest committed checkpoints up to `step`; drop leftovers of killed saves."""
    kept = 0
    for s, p in reversed(list_checkpoints(root)):
        if s == step:
            kept += 1
            continue
        if not is_committed(p):
            _remove_checkpoint(p)  # uncommitted: a killed or failed save
        elif s > step:
            log(
                f"{p} (step {s}) is newer than the checkpoint just saved (step {step}): "
                "resume: auto will pick it; delete it if that run is abandoned"
            )
        elif kept < keep:
            kept += 1
        else:
            _remove_checkpoint(p)


def _commit(root, path, step, cfg: Config, gathered, keep, log) -> str:
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
    pp, dp = cfg.parallel.pp, cfg.parallel.dp
    stages = [e["stage"] for e in entries]
    if stages != list(range(pp)):
        raise CheckpointError(
            f"checkpoint {path} not committed: shards written for stages {stages}, expected one "
            f"per stage 0..{pp - 1} (replica 0 of each stage writes one)"
        )
    from ratrain.exec.spec import stage_layers

    ranges = stage_layers(cfg.model, pp, cfg.parallel.layers_per_stage)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ratrain_version": ratrain.__version__,
        "step": int(step),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "topology": {
            "pp": pp,
            "dp": dp,
            "world_size": len(gathered),
            "stage_layers": [[r.start, r.stop] for r in ranges],
            "ranks": [
                {"rank": g["rank"], "stage": g["stage"], "replica": g["replica"]} for g in gathered
            ],
        },
        "files": entries,
        "config": cfg.to_dict(),
    }
    problems = _coverage_problems(manifest, path)
    if problems:
        raise CheckpointError(f"checkpoint {path} not committed: " + "; ".join(problems))
    _fsync_dir(path)
    _write_durable(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())
    _fsync_dir(root)
    _prune(root, keep, step, log)
    return path


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
    Returns the committed checkpoint's path, on every rank; raises CheckpointError (the same on
    every rank) if any rank failed, and then nothing is committed.
    """
    comm = comm or _Solo()
    log = log or _log_default
    rank = comm.Get_rank()
    keep = cfg.checkpoint.keep if keep is None else keep
    path = os.path.join(root, checkpoint_name(step))
    _root_then_bcast(comm, lambda: _prepare_dir(root, path))
    entry, error = None, None
    if replica == 0:
        try:
            entry = write_shard(path, step, stage, cfg, tensors, state, writer=writer)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, raised on every rank
            error = f"rank {rank} (stage {stage}): {type(e).__name__}: {e}"
    if isinstance(tensors, StateStream):
        tensors.drain()  # the rest of the stream (all of it on a non-writing replica)
    try:
        digest = hashlib.sha256(_state_json(state).encode()).hexdigest()
    except TypeError as e:
        digest, error = "", error or f"rank {rank}: {e}"
    mine = {"rank": rank, "stage": stage, "replica": replica, "entry": entry, "error": error, "state": digest}
    gathered = comm.gather(mine, root=0)
    return _root_then_bcast(comm, lambda: _commit(root, path, step, cfg, gathered, keep, log))


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`; CheckpointError naming the file when absent or bad."""
    man = os.path.join(path, MANIFEST)
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
            manifest = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{man}: unreadable or not JSON ({e})") from None
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
    return manifest


def _file_problems(path: str, entry: dict, checksums: bool) -> list[str]:
    f = os.path.join(path, entry["file"])
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
    comm = comm or _Solo()

    def manifest_or_problem():
        try:
            return read_manifest(path), []
        except CheckpointError as e:
            return None, [str(e)]

    manifest, problems = _root_then_bcast(comm, manifest_or_problem)
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
            out.extend(_coverage_problems(manifest, os.path.join(path, MANIFEST)))
        except Exception as e:  # noqa: BLE001 - a damaged manifest is a verdict, not a crash
            out.append(f"{os.path.join(path, MANIFEST)}: bad config or file list ({e})")
        return sorted(out)

    gathered = comm.gather(mine, root=0)
    return _root_then_bcast(comm, merge)


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
    None if there is none); a PATH -> that checkpoint, or CheckpointError saying what is wrong.
    With `model`, a checkpoint of a different model section is an error (not skipped), naming
    each key with its saved and current value. Collective over `comm`; only rank 0 logs.
    """
    comm = comm or _Solo()
    rank = comm.Get_rank()

    def say(msg):
        if rank == 0:
            (log or _log_default)(msg)

    if ckpt.resume == "never":
        return None
    if ckpt.resume != "auto":
        path = ckpt.resume
        problems = verify_checkpoint(path, comm=comm)
        if problems:
            raise CheckpointError(
                f"cannot resume from {path} (checkpoint.resume):\n  " + "\n  ".join(problems)
            )
        why = _root_then_bcast(comm, lambda: _incompatible(path, read_manifest(path), model))
        if why:
            raise CheckpointError(why)
        return path
    root = checkpoint_root(ckpt, run_dir)
    candidates = _root_then_bcast(comm, lambda: [p for _, p in reversed(list_checkpoints(root))])
    skipped = 0
    for path in candidates:
        problems = verify_checkpoint(path, comm=comm)
        if problems:
            say(f"resume auto: skipping {path}: " + "; ".join(problems))
            skipped += 1
            continue
        why = _root_then_bcast(comm, lambda p=path: _incompatible(p, read_manifest(p), model))
        if why:
            raise CheckpointError(why)
        say(f"resume auto: resuming from {path}" + (f" (skipped {skipped} newer)" if skipped else ""))
        return path
    if skipped:
        say(f"resume auto: no usable checkpoint under {root} ({skipped} skipped): starting fresh")
    return None


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


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
    else:  # cupy: through host memory, one parameter at a time
        dst.set(np.ascontiguousarray(ds[()], dtype=dst.dtype))


def load_checkpoint(
    path: str,
    names: Iterable[str] | None = None,
    *,
    out: Mapping[str, Mapping[str, Any]] | None = None,
    kinds: Iterable[str] = ("master", "m", "v"),
) -> dict:
    """Read a committed checkpoint's state for exactly the parameters `names` (None: all).

    Reads each name from whichever shard holds it, so any pp x dp layout can load any
    checkpoint. With `out` ({"master"|"m"|"v": {name: array}}, e.g. `StageState.state_dict()`)
    the values are read straight into those arrays (no extra memory; materialise fp16 views
    afterwards); otherwise new arrays are returned. fp32 in, fp32 out: bitwise exact.

    Returns {"path", "step", "state" (the dict given to save), "config" (a Config),
    "topology", "master", "m", "v" ({name: array})}. Verification is `resolve_resume`'s job
    (collective); this function trusts the manifest's file list.
    """
    manifest = read_manifest(path)
    kinds = list(kinds)
    where = {}
    for e in manifest["files"]:
        for n in e["params"]:
            where[n] = e
    names = list(where) if names is None else list(names)
    missing = [n for n in names if n not in where]
    if missing:
        raise CheckpointError(
            f"{path}: has no parameter {missing[0]!r} ({len(missing)} missing): a checkpoint of "
            "another model?"
        )
    result: dict[str, Any] = {k: {} for k in kinds}
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(where[n]["file"], []).append(n)
    for fname, fnames in by_file.items():
        entry = where[fnames[0]]
        for k in kinds:
            if k not in entry.get("kinds", list(KINDS)):
                raise CheckpointError(f"{os.path.join(path, fname)}: holds no {k!r} state")
        with h5py.File(os.path.join(path, fname), "r") as f:
            for n in fnames:
                for k in kinds:
                    ds = f[f"{KINDS[k]}/{n}"]
                    if out is not None:
                        dst = out[k][n]
                        _read_into(ds, dst)
                    else:
                        dst = ds[()]
                    result[k][n] = dst
    first = os.path.join(path, manifest["files"][0]["file"])
    with h5py.File(first, "r") as f:
        state = json.loads(f.attrs["state"])
        step = int(f.attrs["step"])
        config = config_from_dict(yaml.safe_load(f.attrs["config"]), first)
    if step != manifest["step"]:
        raise CheckpointError(f"{first}: step {step} but the manifest says {manifest['step']}")
    result.update(path=path, step=step, state=state, config=config, topology=manifest["topology"])
    return result


def saved_config(path: str) -> Config:
    """The resolved config a checkpoint was saved with."""
    return config_from_dict(read_manifest(path)["config"], os.path.join(path, MANIFEST))


# --------------------------------------------------------------------------------------------
# CLI: python -m ratrain.checkpoint show PATH [--verify]
# --------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _show_root(root: str, out) -> int:
    ckpts = list_checkpoints(root)
    if not ckpts:
        print(f"{root}: no checkpoint here (no manifest.json, no ckpt-NNNNNN directories)", file=out)
        return 1
    print(f"checkpoints under {root}:", file=out)
    for step, p in ckpts:
        size = sum(
            os.path.getsize(os.path.join(p, f)) for f in os.listdir(p) if os.path.isfile(os.path.join(p, f))
        )
        status = "committed" if is_committed(p) else "NOT committed (interrupted save; ignored)"
        print(f"  {os.path.basename(p)}  step {step:>8}  {_fmt_bytes(size):>10}  {status}", file=out)
    return 0


def show(path: str, verify: bool = False, out=None) -> int:
    """Print a checkpoint's step, topology, config summary, files and checks; 0 if usable."""
    out = out or sys.stdout
    if not os.path.isfile(os.path.join(path, MANIFEST)) and list_checkpoints(path):
        return _show_root(path, out)
    try:
        man = read_manifest(path)
    except CheckpointError as e:
        print(f"error: {e}", file=out)
        return 1
    topo, cfg = man["topology"], man["config"]
    m = cfg.get("model", {})
    print(f"checkpoint  {path}  (committed)", file=out)
    print(f"step        {man['step']}", file=out)
    print(
        f"written by  ratrain {man.get('ratrain_version')}, format {man.get('format_version')}, "
        f"{man.get('created', '?')}",
        file=out,
    )
    stages = " ".join(f"s{i}:layers[{a},{b})" for i, (a, b) in enumerate(topo.get("stage_layers", [])))
    print(f"topology    pp={topo['pp']} x dp={topo['dp']} ({topo.get('world_size')} ranks); {stages}", file=out)
    try:
        c = config_from_dict(cfg)
        nparams = c.model.num_params()
        print(
            f"model       {m['layers']} layers, hidden {m['hidden']}, heads {m['heads']} "
            f"(kv {m['kv_heads']}), ffn {m['ffn_hidden']}, vocab {m['vocab_size']}, seq "
            f"{m['seq_len']}: {nparams / 1e6:.2f}M parameters",
            file=out,
        )
        o = c.optim
        print(
            f"training    precision {c.precision}, policy {c.schedule.policy}, lr {o.lr:g} "
            f"({o.lr_schedule}, warmup {o.warmup_steps}), micro_batch {c.parallel.micro_batch} x "
            f"{c.parallel.num_micro_batches} x dp, run.steps {c.run.steps}",
            file=out,
        )
    except Exception as e:  # noqa: BLE001 - show what can be shown
        print(f"config      unreadable: {e}", file=out)
    first = os.path.join(path, man["files"][0]["file"]) if man["files"] else None
    if first and os.path.isfile(first):
        try:
            with h5py.File(first, "r") as f:
                state = json.loads(f.attrs["state"])
            summary = ", ".join(
                f"{k}={v}" for k, v in state.items() if not isinstance(v, (dict, list))
            )
            nested = [k for k, v in state.items() if isinstance(v, (dict, list))]
            print(f"state       {summary or '-'}" + (f"; + {', '.join(nested)}" if nested else ""), file=out)
        except Exception as e:  # noqa: BLE001 - show what can be shown
            print(f"state       unreadable from {first}: {e}", file=out)
    problems = verify_checkpoint(path, checksums=verify)
    print("files", file=out)
    total = 0
    for e in man["files"]:
        total += e["bytes"]
        f = os.path.join(path, e["file"])
        bad = [p for p in problems if p.startswith(f + ":")]
        status = "FAILED" if bad else ("ok" if verify else "size ok")
        print(
            f"  {e['file']:<16} stage {e['stage']:<3} {len(e['params']):>4} params "
            f"{_fmt_bytes(e['bytes']):>10}  sha256 {e['sha256'][:16]}  {status}",
            file=out,
        )
    print(f"total       {_fmt_bytes(total)} in {len(man['files'])} file(s)", file=out)
    if problems:
        print("checks      FAILED:", file=out)
        for p in problems:
            print(f"  {p}", file=out)
        return 1
    print(
        "checks      "
        + ("all files present, sizes and SHA-256 verify" if verify else
           "all files present with their sizes; checksums not checked (add --verify)"),
        file=out,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ratrain.checkpoint", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("show", help="print a checkpoint's step, topology, config, files, checks")
    sp.add_argument("path", help="a checkpoint directory (ckpt-NNNNNN) or a checkpoints directory")
    sp.add_argument("--verify", action="store_true", help="also check every file's SHA-256")
    args = ap.parse_args(argv)
    return show(args.path, verify=args.verify)


__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "checkpoint_name",
    "checkpoint_root",
    "is_committed",
    "list_checkpoints",
    "load_checkpoint",
    "model_mismatch",
    "read_manifest",
    "resolve_resume",
    "save_checkpoint",
    "saved_config",
    "sha256_file",
    "shard_name",
    "show",
    "verify_checkpoint",
    "write_shard",
]

if __name__ == "__main__":
    sys.exit(main())
