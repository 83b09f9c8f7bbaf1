"""Documents to tokens, in order, in bounded memory, on `workers` threads.

Pieces
    A document longer than ``2 * PIECE_CHARS`` characters is encoded in pieces of about
    ``PIECE_CHARS``, each cut at a place where the tokenizer's tokens of the two sides equal its
    tokens of the whole (``tok.cuts``, see ``ratrain.data.tokenizer``): the last such place
    before ``PIECE_CHARS``, else the first after it. So a document's tokens are those of
    encoding it whole, and how it was read (one string, blocks of a file) does not matter. A
    document with no such place (a tokenizer without cuts, or one enormous word) is encoded
    whole.

Batches and workers
    Pieces are gathered into batches of about ``BATCH_CHARS`` characters (at most
    ``BATCH_PIECES`` pieces); each batch is one task for a pool of `workers` threads, which call
    the tokenizer's ``encode_batch`` (a Hugging Face tokenizer releases the GIL and runs on one
    thread per call: ``TOKENIZERS_PARALLELISM`` is off while ``encode`` runs, so `workers` is
    the number of threads that encode). At most ``workers + 2`` batches are in flight, and
    results are handed on in submission order: the output is the same bytes for every number of
    workers, and what is held at once does not grow with the corpus.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PIECE_CHARS = 1 << 15  # a long document is cut into pieces of about this many characters
BATCH_CHARS = 1 << 19  # characters of one batch (one worker's task)
BATCH_PIECES = 512  # pieces of one batch at most


def _find_cut(buf: str, lo: int, target: int, hi: int, cuts: tuple[str, ...]) -> int | None:
    """A cut position in ``buf[lo:hi]`` (exclusive of both ends): the last at or before
    `target`, else the first after it; None when there is none."""
    if "any" in cuts:
        return target if lo < target < hi else None
    best_before, best_after = None, None
    for kind in cuts:
        mark, shift = (" ", 0) if kind == "space" else ("\n", 1)
        i = buf.rfind(mark, lo + 1, target + 1 - shift)
        while i > lo and not _ok(buf, i, hi):
            i = buf.rfind(mark, lo + 1, i)
        if i > lo and (best_before is None or i + shift > best_before):
            best_before = i + shift
        j = buf.find(mark, target + 1 - shift, hi - 1)
        while j != -1 and not _ok(buf, j, hi):
            j = buf.find(mark, j + 1, hi - 1)
        if j != -1 and (best_after is None or j + shift < best_after):
            best_after = j + shift
    return best_before if best_before is not None else best_after


def _ok(buf: str, i: int, hi: int) -> bool:
    """The mark at `i` stands alone between two non-space characters inside ``buf[:hi]``."""
    return 0 < i < hi - 1 and not buf[i - 1].isspace() and not buf[i + 1].isspace()


def pieces(parts: Iterable[str], cuts: tuple[str, ...], piece: int | None = None) -> Iterator[str]:
    """A document given as `parts` (strings) as pieces whose tokens add up to the whole's."""
    piece = piece or PIECE_CHARS
    buf, start = "", 0
    for part in parts:
        buf = buf[start:] + part if start else buf + part
        start = 0
        while len(buf) - start >= 2 * piece and cuts:
            cut = _find_cut(buf, start, start + piece, len(buf), cuts)
            if cut is None:
                break  # no place to cut yet: read on
            yield buf[start:cut]
            start = cut
    if len(buf) > start:
        yield buf[start:]


@contextlib.contextmanager
def _one_thread_per_call(tok):
    """``TOKENIZERS_PARALLELISM=false`` while the pool runs (restored after), so that each of
    the pool's threads encodes on itself alone."""
    if not tok.parallel:
        yield
        return
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def encode(docs: Iterable, tok, workers: int = 1, piece: int | None = None,
           batch_chars: int | None = None) -> Iterator[tuple[object, np.ndarray, bool]]:
    """(key, ids, last) for every piece of every document of `docs`, in order: `docs` yields
    (key, parts) with `parts` a string or strings; `last` marks a document's last piece. A
    document with no text gives one empty piece. `ids`: uint8 / uint32. `piece` and
    `batch_chars` default to ``PIECE_CHARS`` and ``BATCH_CHARS``."""
    batch_chars = batch_chars or BATCH_CHARS
    pending: deque = deque()  # (future or result, [(key, last)])
    limit = workers + 2

    def batches():
        texts: list[str] = []
        marks: list[tuple[object, bool]] = []
        size = 0
        for key, parts in docs:
            prev = None
            for text in pieces([parts] if isinstance(parts, str) else parts, tok.cuts, piece):
                if prev is not None:
                    texts.append(prev)
                    marks.append((key, False))
                    size += len(prev)
                prev = text
                if size >= batch_chars or len(texts) >= BATCH_PIECES:
                    yield texts, marks
                    texts, marks, size = [], [], 0
            texts.append(prev if prev is not None else "")
            marks.append((key, True))
            size += len(texts[-1])
            if size >= batch_chars or len(texts) >= BATCH_PIECES:
                yield texts, marks
                texts, marks, size = [], [], 0
        if texts:
            yield texts, marks

    def emit(result, marks):
        flat, lengths = result
        offs = np.concatenate(([0], np.cumsum(lengths)))
        for i, (key, last) in enumerate(marks):
            yield key, flat[offs[i]: offs[i + 1]], last

    if not tok.parallel:
        for texts, marks in batches():
            yield from emit(tok.encode_batch(texts), marks)
        return
    with _one_thread_per_call(tok), ThreadPoolExecutor(workers, "ratrain-encode") as pool:
        try:
            for texts, marks in batches():
                pending.append((pool.submit(tok.encode_batch, texts), marks))
                while len(pending) >= limit:
                    fut, m = pending.popleft()
                    yield from emit(fut.result(), m)
            while pending:
                fut, m = pending.popleft()
                yield from emit(fut.result(), m)
        finally:
            for fut, _ in pending:
                fut.cancel()


__all__ = ["BATCH_CHARS", "BATCH_PIECES", "PIECE_CHARS", "encode", "pieces"]
