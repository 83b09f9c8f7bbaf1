"""The Python floor setup.cfg declares (`python_requires`): every module parses under that
version's grammar and uses none of the standard library names that came later.

`ast.parse(feature_version=)` refuses syntax newer than the floor (`except*`, `type X = ...`);
names are checked by their dotted use (`datetime.UTC` is 3.11+: `datetime.timezone.utc` works
on every version). When the floor's interpreter is installed (pyenv), the checkpoint save's
date code is also run by it.
"""

from __future__ import annotations

import ast
import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LATER = {  # dotted name -> the version that added it
    "datetime.UTC": (3, 11), "tomllib": (3, 11), "typing.Self": (3, 11),
    "typing.LiteralString": (3, 11), "typing.Never": (3, 11), "typing.assert_never": (3, 11),
    "typing.reveal_type": (3, 11), "enum.StrEnum": (3, 11), "asyncio.TaskGroup": (3, 11),
    "asyncio.timeout": (3, 11), "ExceptionGroup": (3, 11), "BaseExceptionGroup": (3, 11),
    "contextlib.chdir": (3, 11), "hashlib.file_digest": (3, 11), "typing.override": (3, 12),
    "itertools.batched": (3, 12), "warnings.deprecated": (3, 13), "copy.replace": (3, 13),
}


def floor() -> tuple[int, int]:
    cp = configparser.ConfigParser()
    cp.read(REPO / "setup.cfg")
    major, minor = re.search(r">=\s*(\d+)\.(\d+)", cp["options"]["python_requires"]).groups()
    return int(major), int(minor)


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def too_new(src: str, name: str, version: tuple[int, int]) -> list[str]:
    """Every use in `src` of syntax or a standard-library name newer than `version`."""
    try:
        tree = ast.parse(src, name, feature_version=version)
    except SyntaxError as e:
        return [f"{name}:{e.lineno}: syntax newer than Python {version[0]}.{version[1]}: {e.msg}"]
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, (ast.Attribute, ast.Name)):
            names = [_dotted(node)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            if n in LATER and LATER[n] > version:
                out.append(f"{name}:{node.lineno}: {n} needs Python {LATER[n][0]}.{LATER[n][1]}")
    return out


def test_every_module_runs_on_the_declared_floor():
    version = floor()
    problems = []
    for path in sorted((REPO / "ratrain").rglob("*.py")):
        problems += too_new(path.read_text(), str(path.relative_to(REPO)), version)
    assert problems == []


def test_the_checker_catches_a_newer_name_and_newer_syntax():
    assert too_new("import datetime\nt = datetime.datetime.now(datetime.UTC)\n", "m", (3, 10))
    assert too_new("from datetime import UTC\n", "m", (3, 10))
    assert too_new("try:\n    pass\nexcept* OSError:\n    pass\n", "m", (3, 10))
    assert not too_new("import datetime\nt = datetime.datetime.now(datetime.timezone.utc)\n",
                       "m", (3, 10))


def _floor_python() -> str | None:
    major, minor = floor()
    found = shutil.which(f"python{major}.{minor}")
    pyenv = sorted(Path.home().glob(f".pyenv/versions/{major}.{minor}.*/bin/python"))
    for exe in ([found] if found else []) + [str(p) for p in pyenv]:
        if subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
            return exe
    return None


def test_the_save_paths_date_code_runs_on_the_floor_interpreter():
    """The manifest's `created` stamp, by the floor's interpreter (the standard library only)."""
    exe = _floor_python()
    if exe is None:
        pytest.skip("no interpreter of the declared floor version is installed (pyenv install it)")
    tree = ast.parse((REPO / "ratrain/checkpoint/commit.py").read_text())
    stamp = next(n.values[i] for n in ast.walk(tree) if isinstance(n, ast.Dict)
                 for i, k in enumerate(n.keys)
                 if isinstance(k, ast.Constant) and k.value == "created")
    code = f"import datetime\nprint({ast.unparse(stamp)})"
    r = subprocess.run([exe, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("+00:00"), r.stdout
