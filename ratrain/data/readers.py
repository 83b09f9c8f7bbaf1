"""Where ``prepare`` reads documents: text, jsonl (.gz, .zst), parquet and Arrow, streamed.

Kinds, by name
    ``*.jsonl``, ``*.jsonl.gz``, ``*.jsonl.zst`` (and ``.ndjson``): one document per line, a
    JSON object whose field ``field`` (``--field``, default ``text``) is a string; blank lines
    are passed over. ``*.parquet``: one document per row of the column ``field``, read in
    record batches (pyarrow). A folder holding ``state.json`` (written by Hugging Face
    ``datasets``' ``save_to_disk``): its Arrow files in the order ``state.json`` lists them, the
    column ``field`` (pyarrow; no network, no ``datasets``). Anything else: a text file, one
    document (UTF-8; a folder member that is not is skipped and reported, a named file that is
    not is an error). Folders are walked recursively in sorted order of their relative paths,
    hidden entries and ``__pycache__`` left out.

Streaming
    Documents come one at a time: a record's text as a ``str``; a text file above
    ``STREAM_BYTES`` as an iterator of decoded blocks (checked to be UTF-8 in a first pass, so
    that a bad file is refused before any of its tokens are written), whose first block holds at
    least ``HEAD_CHARS`` characters unless the file is shorter. Nothing holds the corpus.

Bad records
    A line that is not UTF-8 or not JSON, a record that is not an object, lacks the field or
    holds something other than a string, a null row: with ``on_bad="stop"`` (the default) a
    ``DataError`` naming the file and line (or row) and the fix; with ``"skip"`` they are counted
    (``Reading.skipped``, the first few kept) and reading goes on. A parquet file or Arrow
    dataset without the column, or with a column that is not text, is an error either way,
    found before any document is read (``plan_inputs``).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ratrain.data.tokens import DataError, sidecar_path

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
STREAM_BYTES = 8 << 20  # text files above this are streamed in blocks
BLOCK_BYTES = 1 << 20  # the block of a streamed text file
HEAD_CHARS = 1 << 16  # a streamed document's first block holds at least this many characters
ON_BAD = ("stop", "skip")
KEEP_SKIPS = 5  # skipped records whose place the summary and sidecar name


@dataclass(frozen=True)
class Input:
    """One file (or Arrow dataset folder) to read, and how."""

    path: Path
    kind: str  # text | jsonl | parquet | arrow
    size: int  # bytes on disk (compressed, for .gz / .zst)
    named: bool = True  # named by the user (a bad text file is an error) or found in a folder


@dataclass
class Reading:
    """What reading reports as it goes: bytes consumed, and what was skipped."""

    on_bad: str = "stop"
    done: int = 0  # bytes of the inputs finished
    position = staticmethod(lambda: 0)  # bytes consumed of the input being read
    skipped: int = 0  # bad records
    first: list[str] = field(default_factory=list)  # where the first few were, and why
    skipped_files: list[str] = field(default_factory=list)  # folder members not UTF-8

    @property
    def bytes_read(self) -> int:
        return self.done + self.position()

    def bad(self, where: str, why: str) -> None:
        if self.on_bad == "stop":
            raise DataError(f"{where}: {why}; fix or remove the record, or pass "
                            "--on-bad-record skip to count and skip such records")
        self.skipped += 1
        if len(self.first) < KEEP_SKIPS:
            self.first.append(f"{where}: {why}")


# --------------------------------------------------------------------------------------------
# Which files, of which kinds (checked before any document is read)
# --------------------------------------------------------------------------------------------


def kind_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _is_arrow_dataset(folder: Path) -> bool:
    return (folder / "state.json").is_file()


def _walk(folder: Path) -> list[Input]:
    """Inputs under `folder`, recursively, hidden entries and __pycache__ left out, sorted by
    relative path; a subfolder written by ``save_to_disk`` is one Arrow input."""
    found: list[tuple[str, Input]] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        arrow = [d for d in dirnames if _is_arrow_dataset(here / d)]
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                       and d not in arrow]
        for d in arrow:
            p = here / d
            found.append((p.relative_to(folder).as_posix(), _arrow_input(p)))
        for f in filenames:
            if not f.startswith("."):
                p = here / f
                found.append((p.relative_to(folder).as_posix(),
                              Input(p, kind_of(p), p.stat().st_size, named=False)))
    return [inp for _, inp in sorted(found, key=lambda t: t[0])]


def _arrow_files(folder: Path) -> list[Path]:
    try:
        state = json.loads((folder / "state.json").read_text())
        files = [folder / d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{folder}/state.json is not a Hugging Face datasets state "
                        f"({type(e).__name__}: {e}): give the folder save_to_disk wrote") from None
    for f in files:
        if not f.is_file():
            raise DataError(f"{folder}: state.json lists {f.name}, which is missing: the "
                            "dataset is incomplete; save it again")
    return files


def _arrow_input(folder: Path) -> Input:
    return Input(folder, "arrow", sum(f.stat().st_size for f in _arrow_files(folder)))


def plan_inputs(inputs: list[str], field: str) -> list[Input]:
    """The inputs to read, in order, each checked as far as it can be before reading: it
    exists, the packages its kind needs are there, a parquet or Arrow input has a text column
    `field`, a DatasetDict folder names its splits."""
    plan: list[Input] = []
    for item in inputs:
        p = Path(item)
        if not p.exists():
            raise DataError(f"input {item!r} does not exist: give text, jsonl, parquet or Arrow "
                            "files, or folders of them")
        if p.is_dir() and (p / "dataset_dict.json").is_file():
            splits = sorted(d.name for d in p.iterdir() if _is_arrow_dataset(d))
            raise DataError(f"input {item!r} is a DatasetDict with the splits "
                            f"{', '.join(splits) or '(none)'}: give one split's folder, e.g. "
                            f"{p / (splits[0] if splits else 'train')}")
        if p.is_dir():
            plan += [_arrow_input(p)] if _is_arrow_dataset(p) else _walk(p)
        else:
            plan.append(Input(p, kind_of(p), p.stat().st_size))
    for inp in plan:
        _check_input(inp, field)
    return plan


def _prepared(path: Path) -> Path | None:
    """What marks `path` as a prepared token file (its sidecar or index, or the token file an
    index or sidecar belongs to), else None: such a file is tokens, not text."""
    name = path.name
    if name.endswith(".bin"):
        return next((q for q in (sidecar_path(path), path.with_suffix(".idx")) if q.exists()), None)
    if name.endswith(".idx") and path.with_suffix(".bin").exists():
        return path.with_suffix(".bin")
    if name.endswith(".bin.json") and Path(str(path)[: -len(".json")]).exists():
        return Path(str(path)[: -len(".json")])
    return None


def _need(module: str, kind: str):
    """An optional package a kind of input needs, or a DataError naming the extra."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise DataError(f"reading {kind} needs the optional package {module.split('.')[0]!r}: "
                        "pip install 'ratrain[data]'") from None


def _check_column(schema, field: str, where: str) -> None:
    import pyarrow as pa  # optional: only parquet and Arrow inputs need it (checked by _need)

    if field not in schema.names:
        raise DataError(f"{where} has no column {field!r} (columns: {', '.join(schema.names)}): "
                        "give --field NAME")
    t = schema.field(field).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise DataError(f"{where}: column {field!r} is {t}, not text (string): give --field "
                        "with a text column")


def _check_input(inp: Input, field: str) -> None:
    if inp.kind == "text" and (marker := _prepared(inp.path)) is not None:
        raise DataError(f"input {str(inp.path)!r} is a prepared token file ({marker} is beside "
                        "it), not text: train on it with data.tokens, or leave it out of the "
                        "inputs")
    if inp.kind == "jsonl" and inp.path.name.lower().endswith(".zst"):
        _need("zstandard", "a .zst file")
    elif inp.kind == "parquet":
        pq = _need("pyarrow.parquet", "parquet")
        try:
            schema = pq.read_schema(inp.path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
            raise DataError(f"{inp.path}: not a readable parquet file ({e})") from None
        _check_column(schema, field, str(inp.path))
    elif inp.kind == "arrow":
        pa = _need("pyarrow", "an Arrow dataset")
        for f in _arrow_files(inp.path):
            with pa.memory_map(str(f)) as src:
                _check_column(_ipc_reader(pa, src, f).schema, field, str(f))


def _ipc_reader(pa, src, path: Path):
    """An Arrow IPC stream reader (what ``datasets`` writes), or a file reader."""
    try:
        return pa.ipc.open_stream(src)
    except Exception:  # noqa: BLE001 - not a stream: maybe the random-access file format
        src.seek(0)
    try:
        return pa.ipc.open_file(src)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: not an Arrow IPC file ({e})") from None


# --------------------------------------------------------------------------------------------
# Documents
# --------------------------------------------------------------------------------------------


def documents(plan: list[Input], field: str, reading: Reading,
              max_bytes: int | None = None) -> Iterator[str | Iterator[str]]:
    """The documents of `plan` in order (see the module doc); with `max_bytes`, none starts
    once that many bytes of input have been read (the last one may cross it)."""
    for inp in plan:
        reader = {"text": _text, "jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}[inp.kind]
        docs = reader(inp, field, reading)
        while max_bytes is None or reading.bytes_read < max_bytes:
            doc = next(docs, None)
            if doc is None:
                break
            yield doc
        else:
            docs.close()
            return
        reading.done += inp.size
        reading.position = Reading.position


def _decode_error(e: UnicodeDecodeError, offset: int = 0) -> str:
    return f"not UTF-8 text ({e.reason} at byte {offset + e.start})"


def _text(inp: Input, field: str, reading: Reading):
    del field
    if inp.size <= STREAM_BYTES:
        raw = inp.path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            _bad_text(inp, reading, _decode_error(e))
            return
        reading.position = lambda: len(raw)
        yield text
        return
    problem = _check_utf8(inp.path)
    if problem:
        _bad_text(inp, reading, problem)
        return
    yield _blocks(inp.path, reading)


def _bad_text(inp: Input, reading: Reading, why: str) -> None:
    if inp.named:
        raise DataError(f"input {str(inp.path)!r} is {why}: convert it to UTF-8 or leave it out")
    reading.skipped_files.append(str(inp.path))


def _check_utf8(path: Path) -> str:
    """Why `path` is not UTF-8 ("" when it is), read in blocks."""
    dec = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            try:
                dec.decode(block)
            except UnicodeDecodeError as e:
                return _decode_error(e, offset)
            offset += len(block)
        try:
            dec.decode(b"", final=True)
        except UnicodeDecodeError as e:
            return _decode_error(e, offset)
    return ""


def _blocks(path: Path, reading: Reading) -> Iterator[str]:
    """A checked UTF-8 file's text in blocks, the first at least HEAD_CHARS characters."""
    dec = codecs.getincrementaldecoder("utf-8")()
    head: list[str] | None = []
    with open(path, "rb") as f:
        reading.position = f.tell
        while block := f.read(BLOCK_BYTES):
            text = dec.decode(block)
            if head is not None:
                head.append(text)
                if sum(map(len, head)) < HEAD_CHARS:
                    continue
                text, head = "".join(head), None
            if text:
                yield text
        tail = dec.decode(b"", final=True)
        if head is not None:
            tail = "".join(head) + tail
        end = f.tell()
    reading.position = lambda: end  # the file is closed; its pieces may still be encoding
    if tail:
        yield tail


@contextlib.contextmanager
def _binary(path: Path):
    """(lines of bytes, the raw file) of a jsonl file, decompressing .gz and .zst."""
    name = path.name.lower()
    with open(path, "rb") as raw:
        if name.endswith(".gz"):
            import gzip  # only for .gz inputs

            with gzip.GzipFile(fileobj=raw) as f:
                yield f, raw
        elif name.endswith(".zst"):
            zstd = _need("zstandard", "a .zst file")
            with zstd.ZstdDecompressor().stream_reader(raw) as z:
                yield io.BufferedReader(z, 1 << 20), raw
        else:
            yield raw, raw


def _jsonl(inp: Input, field: str, reading: Reading):
    with _binary(inp.path) as (lines, raw):
        reading.position = raw.tell
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{inp.path}:{lineno}"
            try:
                rec = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                reading.bad(where, _decode_error(e))
                continue
            except ValueError as e:
                reading.bad(where, f"not JSON ({getattr(e, 'msg', e)}, column "
                            f"{getattr(e, 'colno', '?')})")
                continue
            text = _field(rec, field, where, reading)
            if text is not None:
                yield text


def _field(rec, field: str, where: str, reading: Reading) -> str | None:
    if not isinstance(rec, dict):
        reading.bad(where, f"a JSON {type(rec).__name__}, not an object with a {field!r} field")
        return None
    if field not in rec:
        reading.bad(where, f"no field {field!r} (fields: {', '.join(map(str, rec)) or 'none'}); "
                    "give --field NAME for another field")
        return None
    text = rec[field]
    if not isinstance(text, str):
        reading.bad(where, f"field {field!r} is {type(text).__name__}, not a string")
        return None
    return text


def _column_rows(batches, field: str, where: str, reading: Reading, row: int = 0):
    for batch in batches:
        col = batch.column(batch.schema.get_field_index(field))
        for text in col.to_pylist():
            row += 1
            if text is None:
                reading.bad(f"{where} row {row}", f"column {field!r} is null")
                continue
            yield text


def _parquet(inp: Input, field: str, reading: Reading):
    import pyarrow.parquet as pq  # optional: checked by plan_inputs

    pf = pq.ParquetFile(inp.path)
    total = max(1, pf.metadata.num_rows)
    done = [0]
    reading.position = lambda: inp.size * done[0] // total

    def counted(batches):
        for b in batches:
            yield b
            done[0] += b.num_rows

    yield from _column_rows(counted(pf.iter_batches(batch_size=1024, columns=[field])), field,
                            str(inp.path), reading)


def _arrow(inp: Input, field: str, reading: Reading):
    import pyarrow as pa  # optional: checked by plan_inputs

    before = 0
    for f in _arrow_files(inp.path):
        with pa.memory_map(str(f)) as src:
            reading.position = lambda src=src, before=before: before + src.tell()
            yield from _column_rows(_ipc_reader(pa, src, f), field, str(f), reading)
        before += f.stat().st_size
