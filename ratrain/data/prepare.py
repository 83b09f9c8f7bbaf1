"""``prepare``: documents (text, jsonl, parquet, Arrow; or the default corpus) -> a train token
file and its held-out split, streamed, on `workers` threads, in bounded memory.

Where the files go
    ``prepare --out PATH`` writes the training tokens to ``PATH`` and the held-out split beside
    it, named by ``val_path(PATH)`` (``data.eval_tokens: ""`` means that file, when it exists).
    ``--out`` naming a directory (no suffix) means ``DIR/train.bin``. Without ``--out`` the
    tokens go to ``data/<name>/train.bin`` under the current directory, ``<name>`` being
    ``stdlib`` for the default corpus and the first input's stem otherwise (``-<tokenizer dir>``
    appended for a Hugging Face tokenizer). The layout (``--format``) is Megatron-LM's indexed
    dataset by default (``train.bin``, ``train.idx``), or nanoGPT's flat ``train.bin``
    (``nanogpt``); a JSON sidecar ``train.bin.json`` describes each file (``tokens``).

Documents
    What a document is depends on the input (``readers``): a text file, a jsonl line, a parquet
    or Arrow row. With ``eot`` (``--eot``) every document is followed by an end-of-text id:
    ``auto`` (the default) is the tokenizer's end-of-text token (``<|endoftext|>``, ``</s>``,
    ...; ``tokenizer.EOT_TOKENS``) for a Hugging Face tokenizer, and nothing for ``byte`` (its
    256 ids are all bytes; ``--eot 0`` uses NUL); ``none`` concatenates; an integer is that id.
    A document without text is left out (counted). Documents are read one at a time and encoded
    in pieces (``encode``), so memory does not grow with the corpus or with a document.

The held-out split takes whole documents: the last ``val_fraction`` of them (``tail``, the
default), or each document whose seeded hash of its first 64 Ki characters falls below
``val_fraction`` (``hash``: the same document lands in the same split wherever it is, and
duplicates never straddle the split). Every file goes through ``ratrain.fileio`` (temporary
name, fsync, rename): the old sidecars are removed first, the held-out split's files come before
the train files, and the train sidecar is written last, so it marks a finished prepare and an
interrupted run never leaves a damaged file; a rerun removes what an interrupted one left and
says so. Deterministic: same inputs, same bytes, for any number of workers.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from ratrain.data.encode import encode
from ratrain.data.megatron import megatron_dtype
from ratrain.data.progress import Progress
from ratrain.data.readers import HEAD_CHARS, ON_BAD, Input, Reading, documents, plan_inputs
from ratrain.data.sink import TokenSink, stale_temporaries
from ratrain.data.default_corpus import DEFAULT_CORPUS_BYTES, stdlib_files
from ratrain.data.tokenfile import LAYOUTS, index_path
from ratrain.data.tokenizer import EOT_TOKENS, load_tokenizer
from ratrain.data.tokens import (
    DataError,
    dtype_for_vocab,
    dtype_name,
    file_meta,
    sidecar_path,
    val_path,
    write_meta,
)

DEFAULT_VAL_FRACTION = 0.05
SPLITS = ("tail", "hash")


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` wrote."""

    train: Path
    val: Path | None
    num_train: int
    num_val: int
    vocab_size: int
    documents: int  # train and held-out
    skipped: tuple[str, ...] = ()  # folder members that are not UTF-8
    skipped_records: int = 0  # bad records passed over (--on-bad-record skip)
    val_documents: int = 0
    empty_documents: int = 0  # documents without text, left out
    bytes_read: int = 0
    seconds: float = 0.0


def default_out(inputs: list[str], tokenizer: str = "byte", root: str | os.PathLike = "data"):
    """Where ``prepare`` writes without ``--out``: ``data/<name>/train.bin`` (see module doc)."""
    name = "stdlib" if not inputs else (Path(inputs[0]).resolve().name.split(".")[0] or "corpus")
    if tokenizer not in ("", "byte"):
        t = Path(tokenizer)
        name += "-" + (t.name if t.is_dir() else t.resolve().parent.name or "hf")
    return Path(root) / name / "train.bin"


def _resolve_out(out: str | os.PathLike | None, inputs: list[str], tokenizer: str) -> Path:
    if out is None or str(out) == "":
        return default_out(inputs, tokenizer)
    p = Path(out)
    if p.is_dir() or str(out).endswith(("/", os.sep)) or not p.suffix:
        return p / "train.bin"
    return p


def resolve_eot(eot, tok, log=None) -> int | None:
    """The id that ends each document (see the module doc), or None."""
    if eot in (None, "none"):
        return None
    if eot == "auto":
        if tok.name != "byte" and tok.eot_id is None and log is not None:
            log(f"warning: {tok.spec} has no end-of-text special token ({', '.join(EOT_TOKENS)}):"
                " documents are concatenated; give --eot ID to separate them")
        return tok.eot_id
    try:
        i = int(eot)
    except (TypeError, ValueError):
        raise DataError(f"--eot={eot!r}: give auto, none or a token id") from None
    if not 0 <= i < tok.vocab_size:
        raise DataError(f"--eot={i} is outside the vocabulary [0, {tok.vocab_size}) of tokenizer "
                        f"{tok.spec}")
    return i


def default_workers() -> int:
    """The cores this process may run on: the default number of encoding threads."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover - not Linux


def _check_args(val_fraction, max_bytes, layout, on_bad_record, val_split, workers) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(
            f"--val-fraction={val_fraction} must be in [0, 1), e.g. 0.05 (0 = no held-out split)")
    if max_bytes is not None and max_bytes < 1:
        raise DataError(f"--max-bytes={max_bytes} must be >= 1")
    for name, value, choices in (("--format", layout, LAYOUTS),
                                 ("--on-bad-record", on_bad_record, ON_BAD),
                                 ("--val-split", val_split, SPLITS)):
        if value not in choices:
            raise DataError(f"{name}={value!r} is not one of {', '.join(choices)}")
    if workers is not None and workers < 1:
        raise DataError(f"--workers={workers} must be >= 1 (default: the cores)")


def _plan(inputs: list[str], field: str, max_bytes: int | None):
    """(inputs to read, their description for the sidecars, the reading cap)."""
    if inputs:
        return plan_inputs(inputs, field), ", ".join(inputs), max_bytes
    cap = DEFAULT_CORPUS_BYTES if max_bytes is None else max_bytes
    root, files = stdlib_files(cap)
    source = (f"python {platform.python_version()} stdlib .py sources ({len(files)} files, "
              f"sorted, cap {cap} bytes)")
    return [Input(f, "text", f.stat().st_size) for f in files], source, None


def _held_out(head: str, seed: int, fraction: float) -> bool:
    """The seeded hash of a document's first characters falls below `fraction`."""
    h = hashlib.blake2b(head.encode("utf-8", "surrogatepass"), digest_size=8,
                        key=seed.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") < fraction * 2.0 ** 64


def _routed(docs, split: str, fraction: float, seed: int):
    """(0 train | 1 held out, parts) of each document: the hash split decides here; the tail
    split later, from the counts (everything goes to the train file first)."""
    for doc in docs:
        if split != "hash" or fraction == 0:
            yield 0, doc
            continue
        if isinstance(doc, str):
            yield int(_held_out(doc[:HEAD_CHARS], seed, fraction)), doc
            continue
        first = next(doc, "")
        yield int(_held_out(first[:HEAD_CHARS], seed, fraction)), itertools.chain([first], doc)


def _remove_stale(outputs: list[Path], log) -> None:
    """Remove what an interrupted prepare left beside `outputs` (saying so); refuse, removing
    nothing, when the process that writes one of them is still running."""
    found = [(tmp, Path(tmp).name.split(".tmp.")[-1].split(".")[0])
             for tmp in stale_temporaries(outputs)]
    for tmp, pid in found:
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            raise DataError(f"another prepare (pid {pid}) is writing {tmp} now: wait for it to "
                            "finish or give another --out (if no such process runs, remove "
                            "the file)")
    for tmp, pid in found:
        os.unlink(tmp)
        if log is not None:
            log(f"removed {tmp}, left by an interrupted prepare (pid {pid}, no longer running)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail_docs(n_docs: int, fraction: float, what: str) -> int:
    """How many of `n_docs` documents the tail split holds out (at least one when asked)."""
    n_val = round(n_docs * fraction)
    if fraction > 0 and n_val == 0:
        n_val = 1
    if fraction > 0 and n_val >= n_docs:
        raise DataError(
            f"{what} gave {n_docs} document(s): a held-out split of whole documents "
            f"(--val-fraction={fraction}) leaves none to train on; give --val-fraction 0 (and a "
            "held-out file of your own as data.eval_tokens), or more documents")
    return n_val


@dataclass
class _Run:
    """The numbers of one prepare, as it goes."""

    tok: object
    eot: int | None
    layout: str
    dtype: object
    reading: Reading
    empty: int = 0


def _write(train: Path, run: _Run, docs, val_fraction: float, val_split: str,
           workers: int, progress: Progress, what: str, source: str, extra: dict):
    """Write the train file and its held-out split; the sidecars of both."""
    val = val_path(train)
    with contextlib.ExitStack() as stack:
        sinks = [stack.enter_context(TokenSink(train, run.dtype, run.layout, run.eot))]
        if val_split == "hash" and val_fraction > 0:
            sinks.append(stack.enter_context(TokenSink(val, run.dtype, run.layout, run.eot)))
        for key, ids, last in encode(docs, run.tok, workers):
            sink = sinks[key]
            if ids.size and int(ids.max()) >= run.tok.vocab_size:  # pragma: no cover - defensive
                raise DataError(f"tokenizer gave id {int(ids.max())} >= {run.tok.vocab_size}")
            sink.write(ids)
            if last and not sink.end_document():
                run.empty += 1
            progress.update(sum(s.documents for s in sinks), run.reading.bytes_read,
                            sum(s.tokens for s in sinks))
        progress.close()
        n_docs = sum(s.documents for s in sinks)
        if n_docs == 0:
            raise DataError(f"{what} gave no documents with text (no readable UTF-8 text): "
                            "nothing to prepare")
        if val_split == "tail" and val_fraction > 0:
            keep = n_docs - _tail_docs(n_docs, val_fraction, what)
            sinks.append(stack.enter_context(TokenSink(val, run.dtype, run.layout, run.eot)))
            sinks[0].move_tail(keep, sinks[1])
        elif val_fraction > 0 and not (sinks[0].documents and sinks[1].documents):
            raise DataError(
                f"the hash split put {sinks[1].documents} of {n_docs} documents in the held-out "
                f"split (--val-fraction={val_fraction}): raise --val-fraction or give "
                "--val-split tail")
        metas = []
        for sink, split in zip(sinks, ("train", "val")):
            sink.finish()
            metas.append(file_meta(sink.tmp, run.tok.vocab_size, run.tok.name, source, split,
                                   {**extra, "documents": sink.documents}, run.dtype, run.layout))
        stale = [val, sidecar_path(val), index_path(val)] if len(sinks) == 1 else []
        for p in [sidecar_path(train), sidecar_path(val), *stale]:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()  # first: no sidecar may describe files half replaced
    for sink, meta in reversed(list(zip(sinks, metas))):
        write_meta(sink.path, meta)  # the train sidecar last: the mark of a finished prepare
    return [(s.tokens, s.documents) for s in sinks]


def prepare(
    inputs=(),
    out: str | os.PathLike | None = None,
    tokenizer: str = "byte",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    max_bytes: int | None = None,
    log=None,
    eot: str | int | None = "auto",
    *,
    field: str = "text",
    layout: str = "megatron",
    workers: int | None = None,
    on_bad_record: str = "stop",
    val_split: str = "tail",
    seed: int = 0,
    progress=None,
) -> Prepared:
    """Tokenize `inputs` (files and folders of text, jsonl, parquet or Arrow; none: the default
    corpus) into a train token file and its held-out split (see the module doc).

    `max_bytes` caps the input read (default: ``DEFAULT_CORPUS_BYTES`` for the default corpus,
    no cap otherwise); `eot`: what ends each document; `field`: the text field or column;
    `layout`: ``megatron`` or ``nanogpt``; `workers`: encoding threads (default: the cores);
    `on_bad_record`: ``stop`` or ``skip``; `val_split`: ``tail`` or ``hash`` (`seed`);
    `progress`: a stream for the progress display (None: none). `log` gets the summary.
    """
    inputs = [str(i) for i in inputs]
    _check_args(val_fraction, max_bytes, layout, on_bad_record, val_split, workers)
    workers = workers or default_workers()
    tok = load_tokenizer(tokenizer)  # errors about the tokenizer come before any reading
    eot_id = resolve_eot(eot, tok, log)
    train = _resolve_out(out, inputs, tokenizer)
    plan, source, cap = _plan(inputs, field, max_bytes)  # bad inputs: before any work
    what = ", ".join(inputs) if inputs else "the default corpus"
    dtype = megatron_dtype(tok.vocab_size) if layout == "megatron" else \
        dtype_for_vocab(tok.vocab_size)
    val = val_path(train)
    outputs = [p for b in (train, val) for p in (b, index_path(b), sidecar_path(b))]
    _remove_stale(outputs, log)
    reading = Reading(on_bad_record)
    run = _Run(tok, eot_id, layout, dtype, reading)
    extra = _meta_extra(tok, eot_id, inputs, plan, field, val_split, val_fraction, seed)
    docs = _routed(documents(plan, field, reading, cap), val_split, val_fraction, seed)
    bar = Progress(sum(i.size for i in plan) if cap is None else
                   min(cap, sum(i.size for i in plan)), progress)
    made = [d for d in (train.parent, *train.parent.parents) if not d.exists()]
    train.parent.mkdir(parents=True, exist_ok=True)
    try:
        counts = _write(train, run, _keyed(docs, extra, reading), val_fraction, val_split,
                        workers, bar, what, source, extra)
    except BaseException:
        for d in made:  # innermost first; only folders this call made, and only if empty
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    (n_train, d_train), (n_val, d_val) = counts[0], (counts[1] if len(counts) > 1 else (0, 0))
    result = Prepared(train, val if len(counts) > 1 else None, n_train, n_val, tok.vocab_size,
                      d_train + d_val, tuple(reading.skipped_files), reading.skipped, d_val,
                      run.empty, reading.bytes_read, bar.elapsed())
    if log is not None:
        _summary(log, result, tok, eot_id, layout, dtype, workers, reading)
    return result


def _keyed(docs, extra: dict, reading: Reading):
    """The routed documents, and, once they are all read, what reading found in the sidecars'
    extra (the counts are final only then)."""
    yield from docs
    extra.update(bytes_read=reading.bytes_read, skipped_records=reading.skipped,
                 skipped_examples=list(reading.first), skipped_files=len(reading.skipped_files))


def _meta_extra(tok, eot: int | None, inputs, plan, field, val_split, val_fraction,
                seed) -> dict:
    """What prepare adds to a sidecar (see ``tokens``)."""
    extra: dict = {"eot": eot}
    if tok.sha256:
        extra.update(tokenizer_path=tok.spec, tokenizer_sha256=tok.sha256)
    if inputs:
        extra.update(field=field, inputs=[
            {"path": i, "bytes": sum(p.size for p in plan if _under(p.path, i))} for i in inputs])
    extra["held_out"] = {"split": val_split, "fraction": val_fraction,
                         **({"seed": seed} if val_split == "hash" else {})}
    return extra


def _under(path: Path, item: str) -> bool:
    top = Path(item)
    return path == top or top in path.parents


def _summary(log, r: Prepared, tok, eot_id, layout, dtype, workers, reading: Reading) -> None:
    mb = r.bytes_read / 1e6
    log(f"prepared {r.num_train} train tokens -> {r.train}"
        + (f", {r.num_val} val tokens -> {r.val}" if r.val else "")
        + f" ({r.documents} documents, {r.val_documents} held out; {mb:.1f} MB read in "
        f"{r.seconds:.1f} s, {mb / max(r.seconds, 1e-9):.2f} MB/s, "
        f"{workers if tok.parallel else 1} encoding thread(s); tokenizer "
        f"{tok.name}, vocab {tok.vocab_size}, {layout} layout, {dtype_name(dtype)}, "
        + (f"end-of-text id {eot_id} after each document)" if eot_id is not None
           else "documents concatenated, no end-of-text id)"))
    if r.empty_documents:
        log(f"left out {r.empty_documents} documents without text")
    if reading.skipped:
        log(f"skipped {reading.skipped} bad records (--on-bad-record skip); first: "
            f"{reading.first[0]}")
    if r.skipped:
        log(f"skipped {len(r.skipped)} non-UTF-8 files (first: {r.skipped[0]})")
