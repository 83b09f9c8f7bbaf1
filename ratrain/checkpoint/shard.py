"""One shard: a stage's state as one HDF5 file, written durably with its size and SHA-256.

A shard holds, as fp32 datasets named by *global* parameter name, `master/<name>`,
`optim/m/<name>` and `optim/v/<name>` (e.g. `master/layers.7.attn.wq`; `BUFFER_GROUPS` maps each
buffer to its group), and as root attributes the step, the scalar training state (JSON: data
position, optimizer and loss-scaler state, RNG state, whatever the trainer passes; it must be
the same on every rank), the resolved config (YAML), the stage and the topology. Because names
are global a checkpoint loads into any pp x dp layout.

`write_shard` writes it under a temporary name beside the final one
(`ratrain.fileio.atomic_path`: `.shard-s000.h5.tmp.PID.RANDOM`), fsyncs it, renames it into
place and fsyncs the directory, and returns the shard's manifest entry.

Streaming (the `fast` writer): the file is created with h5py with every dataset's space
allocated up front (early allocation, no fill), then the parameter bytes are written with
`os.pwrite` straight from the caller's arrays (views into the flat buffers: no copy) in file
order, while a second thread computes the SHA-256 of the same bytes (hashlib and pwrite both
release the GIL) and the metadata between them is read back; the file's hash is thus known when
the last byte is written, without reading the file again; every 32 MiB written,
`posix_fadvise(DONTNEED)` starts the writeback early, so the final fsync waits for little.
`_write_shard_plain` (h5py `create_dataset(data=...)`, then hash by reading the file) is the
plain reference the fast path is tested against.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

import ratrain
from ratrain.checkpoint.names import BUFFER_GROUPS, FORMAT, FORMAT_VERSION, CheckpointError, shard_name
from ratrain.checkpoint.replicas import replica_shard_name
from ratrain.config import Config
from ratrain.device import to_host
from ratrain.fileio import atomic_path

if TYPE_CHECKING:  # annotations only: functions import h5py where they read or write
    import h5py

_CHUNK = 8 << 20  # bytes per pwrite / hash update / read
_WRITEBACK = 32 << 20  # start the writeback of every this many bytes written
_fadvise = hasattr(os, "posix_fadvise")


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


def state_json(state: Mapping | None) -> str:
    """The scalar training state as the JSON a shard stores (numpy scalars made exact)."""
    return json.dumps(dict(state or {}), sort_keys=True, default=_json_default)


# --------------------------------------------------------------------------------------------
# The state to write: a mapping, or a stream of blocks
# --------------------------------------------------------------------------------------------


class StateStream:
    """A shard's state delivered block by block instead of as one mapping.

    For sharded optimizer state (`ratrain` at dp > 1) the whole parameters exist only while a
    block is gathered: `blocks` yields `(block, {buffer: {global name: fp32 array}})` in model
    order (e.g. `Executor.iter_full_state()`), each block's arrays valid until the next is
    asked for. `shapes` gives every parameter's shape up front, in the order the blocks deliver
    them, so the file layout is fixed before any byte is written; at most one block is held.
    `failed`: the error `blocks` itself raised, if any. The blocks come from collectives, so a
    stream that failed on one rank cannot be drained in step with the others: its error is not
    a write error to report but one to raise (`commit._write_mine`).
    """

    def __init__(self, shapes: Mapping[str, Any], buffers: Iterable[str], blocks):
        self.shapes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
        self.buffers = tuple(b for b in BUFFER_GROUPS if b in set(buffers))
        self.failed: BaseException | None = None
        self._blocks = self._watched(blocks)

    def _watched(self, blocks):
        it = iter(blocks)
        while True:
            try:
                item = next(it)
            except StopIteration:
                return
            except BaseException as e:
                self.failed = e
                raise
            yield item

    def drain(self) -> None:
        """Run the stream without writing (a replica that does not write still takes part in
        the collectives that produce each block)."""
        for _ in self._blocks:
            pass

    def items(self):
        """(buffer, name, array) in file order: by parameter, master / m / v within one."""
        seen = []
        for block, arrays in self._blocks:
            names = list(arrays[self.buffers[0]])
            for name in names:
                for buf in self.buffers:
                    a = arrays[buf][name]
                    if tuple(a.shape) != self.shapes.get(name):
                        raise CheckpointError(
                            f"save_checkpoint: block {block!r} gave {buf}[{name!r}] of shape "
                            f"{tuple(a.shape)}, expected {self.shapes.get(name)}")
                    yield buf, name, a
            seen.extend(names)
        if seen != list(self.shapes):
            raise CheckpointError("save_checkpoint: the block stream did not deliver every "
                                  "parameter of the shard in order")


class _MappingStream(StateStream):
    """A mapping {buffer: {name: array}} seen as a stream (one block holding everything)."""

    def __init__(self, tensors: Mapping[str, Mapping[str, Any]], names: list[str]):
        shapes = {n: tensors["master"][n].shape for n in names}
        super().__init__(shapes, tensors, [("*", tensors)])


def as_stream(tensors) -> StateStream:
    """`tensors` ({buffer: {name: array}} or a StateStream) as a StateStream, checked."""
    if isinstance(tensors, StateStream):
        return tensors
    return _MappingStream(tensors, _shard_plan(tensors))


def _shard_plan(tensors: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The parameter names of a shard (order of `tensors['master']`), checked across buffers."""
    if "master" not in tensors:
        raise CheckpointError("save_checkpoint: tensors must hold 'master' (and 'm', 'v')")
    unknown = [b for b in tensors if b not in BUFFER_GROUPS]
    if unknown:
        raise CheckpointError(
            f"save_checkpoint: unknown state buffer {unknown[0]!r}; buffers: master, m, v")
    names = list(tensors["master"])
    for buf, arrays in tensors.items():
        if set(arrays) != set(names):
            diff = sorted(set(arrays) ^ set(names))
            raise CheckpointError(
                f"save_checkpoint: {buf!r} and 'master' hold different parameters ({diff[0]!r})"
            )
        for name in names:
            if tuple(arrays[name].shape) != tuple(tensors["master"][name].shape):
                raise CheckpointError(
                    f"save_checkpoint: {buf}[{name!r}] has shape {tuple(arrays[name].shape)}, "
                    f"master has {tuple(tensors['master'][name].shape)}"
                )
    return names


def _host(a) -> np.ndarray:
    """A C-contiguous float32 numpy array of `a` (a copy only for a device array or strided
    input)."""
    a = to_host(a)
    if a.dtype != np.float32:
        raise CheckpointError(f"checkpoints store fp32 state; got an array of dtype {a.dtype}")
    return np.ascontiguousarray(a)


def _write_attrs(f: h5py.File, step: int, stage: int, cfg: Config, state: str) -> None:
    f.attrs["format"] = FORMAT
    f.attrs["format_version"] = FORMAT_VERSION
    f.attrs["ratrain_version"] = ratrain.__version__
    f.attrs["step"] = int(step)
    f.attrs["stage"] = int(stage)
    f.attrs["pp"] = int(cfg.parallel.pp)
    f.attrs["dp"] = int(cfg.parallel.dp)
    f.attrs["config"] = cfg.to_yaml()
    f.attrs["state"] = state


# --------------------------------------------------------------------------------------------
# The fast writer: layout by h5py, bytes by pwrite, SHA-256 on a second thread
# --------------------------------------------------------------------------------------------


def _raw_dcpl():
    """Contiguous layout, space allocated at creation, never filled: we write the bytes."""
    import h5py  # only a rank that reads or writes a shard loads HDF5 (~12 MiB)
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def _lay_out(tmp: str, step, stage, cfg, stream: StateStream, state: str) -> dict:
    """Create the shard's attributes and datasets (space allocated, nothing written); return
    {(buffer, name): file offset} of every dataset that has storage."""
    import h5py  # only a rank that reads or writes a shard loads HDF5 (~12 MiB)
    offsets = {}
    with h5py.File(tmp, "w") as f:
        _write_attrs(f, step, stage, cfg, state)
        for name, shape in stream.shapes.items():  # by parameter: master, m, v lie together
            for buf in stream.buffers:
                ds = f.create_dataset(f"{BUFFER_GROUPS[buf]}/{name}", shape=shape, dtype=np.float32,
                                      dcpl=_raw_dcpl())
                off = ds.id.get_offset()
                if off is not None:  # None: an empty dataset (no storage)
                    offsets[buf, name] = off
    return offsets


class _Hasher:
    """SHA-256 of the chunks handed to `put`, in order, computed on a second thread."""

    def __init__(self):
        self.sha = hashlib.sha256()
        self._chunks: queue.Queue = queue.Queue()  # views of caller memory: no memory cost
        self._thread = threading.Thread(target=self._run, name="ckpt-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (c := self._chunks.get()) is not None:
            self.sha.update(c)
            self._chunks.task_done()
        self._chunks.task_done()

    def put(self, chunk) -> None:
        self._chunks.put(chunk)

    def wait(self) -> None:
        """Until every chunk put so far is hashed (its memory may then be reused)."""
        self._chunks.join()

    def end(self) -> None:
        """No more chunks: let the thread finish the queue (`join` waits for it)."""
        self._chunks.put(None)

    def join(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        """After an error: end the thread whatever it was doing."""
        if self._thread.is_alive():
            self.end()
            self.join()


class _Pwriter:
    """Writes arrays at their file offsets through one descriptor and hands every byte of the
    file up to the last one written (metadata between arrays read back) to the hasher."""

    def __init__(self, fd: int, tmp: str, hasher: _Hasher):
        self.fd, self.tmp, self.hasher = fd, tmp, hasher
        self.pos = 0  # every byte before this one has gone to the hasher
        self.flushed = 0  # writeback started for every byte before this one
        self.rehash = False  # a write landed behind `pos`: the hasher's digest is stale

    def write(self, a: np.ndarray, off: int) -> None:
        mv = memoryview(a.reshape(-1)).cast("B")
        if off < self.pos:
            # HDF5 packs datasets under 2 KiB into a small-data block laid out early, so
            # a streamed shard of a tiny model can deliver one behind the write position:
            # write it where it belongs and hash the finished file instead.
            if os.pwrite(self.fd, mv, off) != a.nbytes:
                raise CheckpointError(f"{self.tmp}: short write: disk full?")
            self.rehash = True
            return
        self.read_back(off)
        for i in range(0, len(mv), _CHUNK):
            c = mv[i : i + _CHUNK]
            n = os.pwrite(self.fd, c, off + i)
            if n != len(c):
                raise CheckpointError(f"{self.tmp}: short write ({n} of {len(c)} bytes): disk full?")
            self.hasher.put(c)
            self._writeback(off + i + len(c))
        self.pos = off + len(mv)

    def read_back(self, end: int) -> None:
        """Hash the file's bytes [pos, end) that h5py wrote (metadata between datasets)."""
        if end > self.pos:
            self.hasher.put(os.pread(self.fd, end - self.pos, self.pos))
            self.pos = end

    def _writeback(self, end: int) -> None:
        if _fadvise and end - self.flushed >= _WRITEBACK:
            # Start writing back what is written (async), so the final fsync has little left
            # to wait for; clean pages then leave the page cache.
            os.posix_fadvise(self.fd, self.flushed, end - self.flushed, os.POSIX_FADV_DONTNEED)
            self.flushed = end


def _write_shard_fast(tmp: str, step, stage, cfg, stream: StateStream, state) -> tuple[int, str]:
    """Write a shard to `tmp`: layout with h5py, bytes with pwrite, SHA-256 alongside; fsync."""
    offsets = _lay_out(tmp, step, stage, cfg, stream, state)
    hasher = _Hasher()
    fd = os.open(tmp, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        w = _Pwriter(fd, tmp, hasher)
        for buf, name, src in stream.items():
            off = offsets.get((buf, name))
            if off is None:
                continue
            a = _host(src)
            copied = not (isinstance(src, np.ndarray) and np.may_share_memory(a, src))
            w.write(a, off)
            if copied or not isinstance(stream, _MappingStream):
                hasher.wait()  # keep at most one copied / streamed parameter alive
        w.read_back(size)
        hasher.end()
        os.fsync(fd)  # overlaps the hasher's tail
        hasher.join()
        size = max(size, w.pos)
        if not w.rehash:
            return size, hasher.sha.hexdigest()
        h = hashlib.sha256()
        for i in range(0, size, _CHUNK):
            h.update(os.pread(fd, min(_CHUNK, size - i), i))
        return size, h.hexdigest()
    finally:
        os.close(fd)
        hasher.stop()


def _write_shard_plain(tmp: str, step, stage, cfg, stream: StateStream, state) -> tuple[int, str]:
    """Reference writer: h5py writes the datasets, then the file is hashed by reading it."""
    import h5py  # only a rank that reads or writes a shard loads HDF5 (~12 MiB)
    with h5py.File(tmp, "w") as f:
        _write_attrs(f, step, stage, cfg, state)
        for buf, name, src in stream.items():
            f.create_dataset(f"{BUFFER_GROUPS[buf]}/{name}", data=_host(src))
    return os.path.getsize(tmp), sha256_file(tmp)


WRITERS = {"fast": _write_shard_fast, "plain": _write_shard_plain}


def write_shard(path, step, stage, cfg, tensors, state=None, *, writer: str = "fast",
                replica: int | None = None) -> dict:
    """Write stage `stage`'s shard into checkpoint directory `path` (temp, fsync, rename,
    fsync the directory); `replica`: that replica's own state (`checkpoint.replicas`).

    Returns its manifest entry: {"file", "stage", "bytes", "sha256", "kinds", "params"}
    ("kinds": the buffers it holds; the manifest's key since format version 1), and
    "replica" for a replica's own state.
    """
    stream = as_stream(tensors)
    fname = shard_name(stage) if replica is None else replica_shard_name(stage, replica)
    write = WRITERS[writer]
    with atomic_path(os.path.join(path, fname)) as tmp:
        size, sha = write(tmp, step, stage, cfg, stream, state_json(state))
    entry = {
        "file": fname,
        "stage": int(stage),
        "bytes": int(size),
        "sha256": sha,
        "kinds": list(stream.buffers),
        "params": {n: list(shape) for n, shape in stream.shapes.items()},
    }
    return entry if replica is None else {**entry, "replica": int(replica)}
