"""Where ``prepare`` reads text: named files and folders, or the default corpus's files.

Folders are read recursively in sorted order of their relative paths, hidden entries and
``__pycache__`` left out; every file is read as UTF-8 (folder members that are not UTF-8 are
skipped and reported; a named file that is not is an error). The default corpus is the Python
standard library's ``.py`` sources (installed packages and test suites left out), sorted by
relative path, about ``DEFAULT_CORPUS_BYTES`` of them: deterministic for a given installation.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from ratrain.data.tokens import DataError

DEFAULT_CORPUS_BYTES = 8_000_000  # about 8 MB of Python source: the default corpus
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _walk(folder: Path) -> list[Path]:
    """Regular files under `folder`, recursively, hidden ones and __pycache__ left out, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        out += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(out, key=lambda p: p.relative_to(folder).as_posix())


def text_documents(inputs: list[str], max_bytes: int | None, skipped: list[str]):
    """(name, text) of each file of `inputs` in order, until `max_bytes` have been read;
    folder members that are not UTF-8 are appended to `skipped`."""
    taken = 0
    for item in inputs:
        p = Path(item)
        explicit = p.is_file()
        for f in [p] if explicit else _walk(p):
            if max_bytes is not None and taken >= max_bytes:
                return
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if explicit:
                    raise DataError(
                        f"input {item!r} is not UTF-8 text ({e.reason} at byte {e.start}): "
                        "convert it to UTF-8 or leave it out"
                    ) from None
                skipped.append(str(f))
                continue
            taken += len(raw)
            yield str(f), text


def stdlib_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> tuple[Path, list[Path]]:
    """The default corpus's files: the standard library's ``.py`` sources (installed packages
    and test suites left out), sorted by relative path, taken while the total is under
    `max_bytes` (the last one may cross it). Deterministic for a given Python installation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(
            f"the Python standard library was not found at {root}: the default corpus needs its "
            "sources; prepare your own text with python -m ratrain.data prepare FILES --out PATH"
        )
    rel = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith(".")]
        rel += [Path(dirpath, f).relative_to(root) for f in filenames if f.endswith(".py")]
    rel.sort(key=lambda p: p.as_posix())
    out, total = [], 0
    for r in rel:
        if total >= max_bytes:
            break
        f = root / r
        raw = f.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(f)
        total += len(raw)
    return root, out


def stdlib_documents(files: list[Path], root: Path):
    """(relative name, text) of each of the default corpus's `files`."""
    for f in files:
        yield f.relative_to(root).as_posix(), f.read_bytes().decode("utf-8")
