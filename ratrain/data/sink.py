"""A token file being written by ``prepare``: documents appended, a tail split off, committed.

    with TokenSink(Path("data/x/train.bin"), dtype, "megatron", eot=0) as sink:
        sink.write(ids); sink.write(more_ids); sink.end_document()   # ... every document
        sink.finish()               # files closed, the .idx written (temporaries still)
    # here .bin then .idx are renamed into place; on an error both temporaries are removed

Tokens go to a temporary beside the ``.bin`` and each document's token count (its end-of-text
id included) to a temporary spill file, so memory does not grow with the corpus. ``finish``
writes the Megatron ``.idx`` from the spill (``layout="megatron"``; nothing for ``nanogpt``).
``move_tail(keep, other)`` moves every document after the first `keep` to another sink (the
held-out split by the last documents). Every temporary is named by ``ratrain.fileio.temp_name``
(``.NAME.tmp.PID.RANDOM``) beside its target, so a rerun finds what an interrupted run left
(``stale_temporaries``).
"""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path

import numpy as np

from ratrain.data.megatron import write_index
from ratrain.data.tokenfile import index_path
from ratrain.fileio import atomic_path, create_exclusive, temp_name

_BUFFER = 8 << 20  # bytes buffered per file
_COPY = 64 << 20  # bytes per chunk when moving a tail


class TokenSink:
    """A token file (and, for the Megatron layout, its index) being written; see the module."""

    def __init__(self, path: Path, dtype, layout: str, eot: int | None):
        self.path, self.dtype, self.layout = Path(path), np.dtype(dtype), layout
        self.end = np.array([] if eot is None else [eot], dtype=self.dtype)
        self.tokens = self.documents = self._doc = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> TokenSink:
        st = self._stack
        if self.layout == "megatron":  # entered first, renamed last: the .bin before its index
            self.tmp_idx = st.enter_context(atomic_path(index_path(self.path)))
        self.tmp = st.enter_context(atomic_path(self.path))
        self._f = st.enter_context(open(self.tmp, "r+b", buffering=_BUFFER))
        self.spill = temp_name(f"{self.path}.lengths")
        os.close(create_exclusive(self.spill))
        st.callback(_unlink, self.spill)
        self._lens = st.enter_context(open(self.spill, "r+b", buffering=1 << 20))
        return self

    def __exit__(self, *exc) -> bool:
        return self._stack.__exit__(*exc)

    # -- writing -----------------------------------------------------------------------------

    def write(self, ids: np.ndarray) -> None:
        """Tokens of the document being written."""
        if ids.size:
            self._f.write(memoryview(np.ascontiguousarray(ids, dtype=self.dtype)))
            self._doc += ids.size

    def end_document(self) -> bool:
        """End the document being written (its end-of-text id after it); a document with no
        token is left out. Whether it was kept."""
        if not self._doc:
            return False
        self._f.write(memoryview(self.end))
        n = self._doc + self.end.size
        self._lens.write(np.int64(n).tobytes())
        self.tokens += n
        self.documents += 1
        self._doc = 0
        return True

    def lengths(self) -> np.ndarray:
        """Every document's token count (a memory map of the spill; empty: a zero array)."""
        self._lens.flush()
        if not self.documents:
            return np.zeros(0, np.int64)
        return np.memmap(self.spill, dtype="<i8", mode="r", shape=(self.documents,))

    def move_tail(self, keep: int, other: TokenSink) -> None:
        """Move every document after the first `keep` to `other` (tokens and counts), in
        chunks: nothing held grows with the corpus."""
        lengths = self.lengths()
        offset = int(np.sum(lengths[:keep], dtype=np.int64)) * self.dtype.itemsize
        for lo in range(keep, self.documents, _COPY // 8):
            other._lens.write(np.asarray(lengths[lo: lo + _COPY // 8], dtype="<i8").tobytes())
        del lengths  # no view of the spill may outlive its truncation
        self._f.flush()
        with open(self.tmp, "rb") as src:
            src.seek(offset)
            while block := src.read(_COPY):
                other._f.write(block)
        other.tokens += self.tokens - offset // self.dtype.itemsize
        other.documents += self.documents - keep
        self._f.truncate(offset)
        self._lens.truncate(keep * 8)
        self._f.seek(offset)
        self._lens.seek(keep * 8)
        self.tokens, self.documents = offset // self.dtype.itemsize, keep

    def finish(self) -> None:
        """Close the token file and write the index (still under temporary names)."""
        if self._doc:
            raise RuntimeError("finish() with a document not ended")  # pragma: no cover
        self._f.flush()
        if self.layout == "megatron":
            write_index(self.tmp_idx, self.dtype, self.lengths())
        self._f.close()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def stale_temporaries(paths) -> list[str]:
    """Temporaries an interrupted write left beside `paths` (``.NAME.tmp.*`` and
    ``.NAME.lengths.tmp.*``), for a rerun to remove."""
    out = []
    for p in map(Path, paths):
        out += glob.glob(str(p.parent / f".{glob.escape(p.name)}.tmp.*"))
        out += glob.glob(str(p.parent / f".{glob.escape(p.name)}.lengths.tmp.*"))
    return sorted(set(out))


__all__ = ["TokenSink", "stale_temporaries"]
