"""Every benchmark script still imports and builds its command line: `--help` runs each one as a
program, in this process (a renamed or removed name in ratrain breaks a script that no test
runs otherwise: `benchmarks/tier.py` and `bench_exec.py` did, unnoticed until a re-measurement).
"""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_PROGRAMS = {"_trials.py"}  # a module the trial scripts import
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in NOT_PROGRAMS)


def problem(path: Path) -> str:
    """What is wrong with `path --help` run as a program here: "" when it prints its usage and
    exits 0 (record.py: 2, by design, since it needs a NAME first)."""
    argv, sys.argv = sys.argv, [str(path), "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(str(path), run_name="__main__")
        return "it ran without exiting"
    except SystemExit as e:
        said = out.getvalue()
        if e.code not in (0, None) and not (path.name == "record.py" and e.code == 2):
            return f"exit {e.code}: {said[-2000:]}"
        return "" if "usage" in said.lower() else f"no usage printed: {said[-2000:]}"
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        return f"{type(e).__name__}: {e}"
    finally:
        sys.argv = argv


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_answers_help(name, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    assert problem(ROOT / "benchmarks" / name) == ""


def test_the_check_finds_a_broken_import_and_a_script_without_a_command_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ratrain.exec.spec import NO_SUCH_NAME\n")
    assert problem(bad).startswith("ImportError")
    quiet = tmp_path / "quiet.py"
    quiet.write_text("x = 1\n")
    assert problem(quiet) == "it ran without exiting"
