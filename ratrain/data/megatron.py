"""Megatron-LM's indexed dataset: ``<prefix>.bin`` (the tokens) and ``<prefix>.idx`` (the index).

The format (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``, index version 1), all
little-endian::

    .idx  magic      b"MMIDIDX\\x00\\x00"                         9 bytes
          version    uint64 = 1                                    8
          dtype      uint8, the code of the tokens' dtype          1
          S          uint64, the number of sequences               8
          D + 1      uint64, the number of document indices        8   (34 bytes so far)
          lengths    int32[S]   tokens of each sequence
          pointers   int64[S]   byte offset of each sequence in the .bin
          documents  int64[D+1] document i is sequences documents[i] .. documents[i+1] - 1
                                (documents[0] = 0, documents[-1] = S)
          modes      int8[S]    the multimodal variant only: each sequence's mode
    .bin  the sequences' tokens, back to back

The multimodal variant (Megatron's ``IndexedDatasetBuilder(multimodal=True)``) adds the modes;
nothing in the header says so, and Megatron's reader is told by its caller. Mode 0 is text,
the default of every sequence; ``tools/preprocess_mmdata.py`` stores an image's bytes as a
sequence of mode 1. An index whose size leaves exactly one byte per sequence after the
document indices has modes. When every mode is 0, its tokens are read like any other;
another mode is refused, naming the sequence, since its "tokens" are not text.

Dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16 (the
float codes are no token dtype and are refused). Megatron writes uint16 below a vocabulary of
65,500 and int32 above; ``prepare`` writes uint16 up to 65,536 and int32 above. A document
``prepare`` writes is one sequence (Megatron's GPT layout), cut into several only past 2**31 - 1
tokens (a length is an int32).

``read_index`` checks everything a reader relies on (magic, version, dtype code, the file's
size against its counts, document indices, sequences lying back to back, the modes of the
multimodal variant, the ``.bin``'s size) and names the file and the fix. ratrain reads the ``.bin`` as one token stream (the sequences
back to back), which is what ``prepare`` and Megatron's own preprocessing write.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ratrain.data.tokens import DataError, dtype_name

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
CODES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # integer codes only
FLOAT_CODES = {6: "float64", 7: "float32"}
MAX_SEQUENCE = (1 << 31) - 1  # a sequence length is an int32
_CHUNK = 1 << 22  # index entries per chunk when checking or writing


def code_of(dtype) -> int:
    """The Megatron dtype code of a token dtype."""
    key = np.dtype(dtype).str.replace("|", "")
    for code, name in CODES.items():
        if np.dtype(name).str.replace("|", "") == key:
            return code
    raise DataError(f"dtype {np.dtype(dtype)} has no Megatron dtype code")


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The dtype ``prepare`` writes Megatron tokens in: uint16 when every id fits, else int32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


@dataclass(frozen=True)
class Index:
    """A checked ``.idx``: the tokens' dtype, and memory maps of its three arrays."""

    path: Path
    dtype: np.dtype
    lengths: np.ndarray  # (S,) int32
    pointers: np.ndarray  # (S,) int64, bytes
    documents: np.ndarray  # (D+1,) int64, sequence indices
    modes: np.ndarray | None = None  # (S,) int8: the multimodal variant's, every one 0 (text)

    @property
    def num_tokens(self) -> int:
        return int(self.pointers[-1]) // self.dtype.itemsize + int(self.lengths[-1]) \
            if len(self.lengths) else 0

    @property
    def num_documents(self) -> int:
        return len(self.documents) - 1


def _fail(path, what: str) -> DataError:
    return DataError(f"{path}: {what}")


def read_index(idx: str | os.PathLike, bin_path: str | os.PathLike | None = None) -> Index:
    """Open and check a Megatron ``.idx`` (and, given `bin_path`, the ``.bin``'s size)."""
    idx = Path(idx)
    size = idx.stat().st_size
    fix = "prepare it again, or give the right file"
    if size < HEADER_BYTES:
        raise _fail(idx, f"{size} bytes, shorter than the {HEADER_BYTES}-byte header of a "
                    f"Megatron index: {fix}")
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[:9] != MAGIC:
        raise _fail(idx, f"not a Megatron index: it starts with {head[:9]!r}, not {MAGIC!r}: "
                    f"{fix}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != VERSION:
        raise _fail(idx, f"Megatron index version {version}; ratrain reads version {VERSION}: "
                    "write it with a Megatron-LM whose index is version 1")
    if code in FLOAT_CODES:
        raise _fail(idx, f"dtype code {code} ({FLOAT_CODES[code]}) is not a token dtype: the "
                    "tokens must be integers (codes 1-5, 8)")
    if code not in CODES:
        raise _fail(idx, f"unknown dtype code {code} (known: 1-8): {fix}")
    want = HEADER_BYTES + n_seq * 12 + n_doc * 8
    multimodal = n_seq > 0 and size == want + n_seq  # one mode (int8) per sequence follows
    if size != want and not multimodal:
        raise _fail(idx, f"{size} bytes, but its counts ({n_seq} sequences, {n_doc} document "
                    f"indices) make {want} ({want + n_seq} with sequence modes): the file is "
                    f"truncated or damaged; {fix}")
    dtype = np.dtype(CODES[code])
    lengths = np.memmap(idx, "<i4", "r", HEADER_BYTES, (n_seq,)) if n_seq else np.zeros(0, "<i4")
    pointers = (np.memmap(idx, "<i8", "r", HEADER_BYTES + 4 * n_seq, (n_seq,)) if n_seq
                else np.zeros(0, "<i8"))
    docs = (np.memmap(idx, "<i8", "r", HEADER_BYTES + 12 * n_seq, (n_doc,)) if n_doc
            else np.zeros(0, "<i8"))
    _check_arrays(idx, dtype, lengths, pointers, docs)
    modes = np.memmap(idx, "i1", "r", want, (n_seq,)) if multimodal else None
    if modes is not None:
        _check_modes(idx, modes)
    index = Index(idx, dtype, lengths, pointers, docs, modes)
    if bin_path is not None:
        have = Path(bin_path).stat().st_size
        need = index.num_tokens * dtype.itemsize
        if have != need:
            raise DataError(
                f"{bin_path} is {have} bytes, but {idx} describes {index.num_tokens} tokens of "
                f"{dtype_name(dtype)} ({need} bytes): the two files do not belong together or "
                "one is truncated; prepare them again")
    return index


def _check_arrays(idx: Path, dtype: np.dtype, lengths, pointers, docs) -> None:
    """Document indices run from 0 to S without going back; sequences lie back to back."""
    n_seq = len(lengths)
    if len(docs) == 0 or int(docs[0]) != 0 or int(docs[-1]) != n_seq:
        raise _fail(idx, f"document indices must run from 0 to the {n_seq} sequences (they "
                    f"are {docs[:1].tolist()}..{docs[-1:].tolist()}): the index is damaged")
    end = 0  # byte offset where the next sequence must start
    for lo in range(0, max(n_seq, len(docs)), _CHUNK):
        d = np.asarray(docs[lo: lo + _CHUNK + 1])
        if d.size > 1 and (np.diff(d) < 0).any():
            raise _fail(idx, f"document indices go backwards near entry {lo}: the index is "
                        "damaged")
        n = np.asarray(lengths[lo: lo + _CHUNK], dtype=np.int64)
        if not n.size:
            continue
        if (n < 0).any():
            raise _fail(idx, f"a negative sequence length near sequence {lo}: the index is "
                        "damaged")
        want = end + np.concatenate(([0], np.cumsum(n[:-1]))) * dtype.itemsize
        p = np.asarray(pointers[lo: lo + _CHUNK])
        if not np.array_equal(p, want):
            i = lo + int(np.argmax(p != want))
            raise _fail(idx, f"sequence {i} starts at byte {int(pointers[i])}, not {int(want[i - lo])}"
                        " right after the one before: ratrain reads the .bin as one token stream "
                        "and needs its sequences back to back (as Megatron writes them)")
        end = int(want[-1] + n[-1] * dtype.itemsize)


def _check_modes(idx: Path, modes: np.ndarray) -> None:
    """Every sequence of a multimodal index is text (mode 0); DataError naming the first that
    is not."""
    for lo in range(0, len(modes), _CHUNK):
        m = np.asarray(modes[lo: lo + _CHUNK])
        if m.any():
            i = lo + int(np.argmax(m != 0))
            raise _fail(idx, f"a multimodal index (a mode per sequence): sequence {i} has mode "
                        f"{int(modes[i])}, not 0 (text); Megatron stores other data, such as an "
                        "image's bytes (mode 1), in such sequences, and ratrain trains on text "
                        "tokens: give a corpus whose sequences are all text")


def write_index(path: str | os.PathLike, dtype, doc_lengths: np.ndarray) -> None:
    """Write the ``.idx`` at `path` (a new file, or a temporary one) of documents of
    `doc_lengths` tokens each (an int64 array or memory map), their tokens back to back in a
    ``.bin`` of `dtype`: one sequence per document (several past ``MAX_SEQUENCE`` tokens).
    Chunked: the memory it takes does not grow with the number of documents."""
    dtype = np.dtype(dtype)
    n_seq = sum(int(seq.size) for seq in _sequences(doc_lengths))
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, code_of(dtype), n_seq,
                                    len(doc_lengths) + 1))
        for seq in _sequences(doc_lengths):  # lengths
            f.write(seq.astype("<i4").tobytes())
        start = 0
        for seq in _sequences(doc_lengths):  # pointers
            offs = start + np.concatenate(([0], np.cumsum(seq[:-1])))
            f.write((offs * dtype.itemsize).astype("<i8").tobytes())
            start += int(seq.sum())
        f.write(np.zeros(1, "<i8").tobytes())  # documents: 0, then the end of each
        done = 0
        for lo in range(0, len(doc_lengths), _CHUNK):
            ends = done + np.cumsum(_pieces(np.asarray(doc_lengths[lo: lo + _CHUNK])))
            f.write(ends.astype("<i8").tobytes())
            done = int(ends[-1])


def _pieces(lengths: np.ndarray) -> np.ndarray:
    """Sequences of each document of `lengths` tokens (1 unless past ``MAX_SEQUENCE``)."""
    return np.maximum(1, -(-lengths.astype(np.int64) // MAX_SEQUENCE))


def _sequences(doc_lengths: np.ndarray):
    """The sequence lengths of documents of `doc_lengths` tokens, in chunks (int64 arrays)."""
    for lo in range(0, len(doc_lengths), _CHUNK):
        n = np.asarray(doc_lengths[lo: lo + _CHUNK], dtype=np.int64)
        k = _pieces(n)
        if (k == 1).all():
            yield n
            continue
        out = []
        for length, count in zip(n.tolist(), k.tolist()):
            out += [MAX_SEQUENCE] * (count - 1) + [length - MAX_SEQUENCE * (count - 1)]
        yield np.asarray(out, dtype=np.int64)


__all__ = ["CODES", "HEADER_BYTES", "Index", "MAGIC", "MAX_SEQUENCE", "VERSION", "code_of",
           "megatron_dtype", "read_index", "write_index"]
