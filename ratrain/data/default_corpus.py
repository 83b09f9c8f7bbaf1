"""The default corpus: the Python standard library's ``.py`` sources, as files to prepare.

Installed packages and test suites left out, sorted by relative path, about
``DEFAULT_CORPUS_BYTES`` of them, each a UTF-8 text document: deterministic for a given
installation. ``corpus`` prepares them on first use. (What ``prepare`` reads from a user's
files is ``readers``'. A mixture of prepared corpora, the config's ``data.sources``, is
``blend``'s.)
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from ratrain.data.tokens import DataError

DEFAULT_CORPUS_BYTES = 8_000_000  # about 8 MB of Python source: the default corpus
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


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
