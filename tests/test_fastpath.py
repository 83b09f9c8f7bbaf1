"""The compiled fast paths and numba (`ratrain.fastpath`): numba absent, broken or turned off,
each told apart; what the kernel table makes of them (`run.fused`); and what the tests of a fast
path do in each case (CI fails, elsewhere they skip).

numba is shadowed by a package on PYTHONPATH whose import raises what an absent numba raises
(ModuleNotFoundError for `numba`) or what a broken one does (numba's own ImportError when NumPy
is too new)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._prereq import need

ROOT = Path(__file__).resolve().parents[1]
RAISES = {
    "absent": 'raise ModuleNotFoundError("No module named \'numba\'", name="numba")',
    "broken": 'raise ImportError("Numba needs NumPy 2.3 or less. Got NumPy 2.9.")',
}
PROBE = ("from ratrain.exec import fused; from ratrain.exec.backends import kernel_table; "
         "print(fused.available(), '|', fused.why_off(), '|', kernel_table().names['swiglu'])")


def _env(tmp_path, numba, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "RATRAIN_TEST_TORCH",
                                                            "RATRAIN_FUSED")}
    if numba:
        (tmp_path / "numba").mkdir()
        (tmp_path / "numba" / "__init__.py").write_text(RAISES[numba] + "\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    return dict(env, **extra)


def _py(env, code=PROBE):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("ci", ["", "true"])
def test_absent_numba_turns_the_fast_paths_off_with_the_reason(tmp_path, ci):
    p = _py(_env(tmp_path, "absent", CI=ci))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False | numba is not installed (the fast extra) | numpy"
    assert "Warning" not in p.stderr


def test_broken_numba_outside_ci_is_off_with_a_loud_warning(tmp_path):
    p = _py(_env(tmp_path, "broken"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("False | numba is installed but broken: ImportError: Numba")
    assert "RuntimeWarning" in p.stderr and "NumPy 2.9" in p.stderr


def test_broken_numba_under_ci_is_an_error(tmp_path):
    p = _py(_env(tmp_path, "broken", CI="true"))
    assert p.returncode != 0
    assert "numba is installed but broken" in p.stderr and "NumPy 2.9" in p.stderr


def test_ratrain_fused_0_turns_an_importable_numba_off(monkeypatch):
    need("numba")  # this case needs the real one
    from ratrain.config import load_config
    from ratrain.exec.backends import kernels_for

    assert kernels_for(load_config(None)).names["swiglu"] == "fused"
    monkeypatch.setenv("RATRAIN_FUSED", "0")  # read once, by load_config: run.fused=off
    cfg = load_config(None)
    assert cfg.run.fused == "off" and kernels_for(cfg).names["swiglu"] == "numpy"


def test_run_fused_on_without_numba_is_refused_at_start_up(tmp_path):
    env = _env(tmp_path, "absent")
    p = subprocess.run([sys.executable, "-m", "ratrain.train", "--config", "jobs/tiny.yaml",
                        "--set", "run.fused=on", "--set", f"run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        "error: run.fused=on but numba is not installed (the fast extra): install it (pip "
        "install 'ratrain[fast]') or set run.fused=auto")
    assert not (tmp_path / "run").exists()



@pytest.mark.parametrize("numba", ["absent", "broken"])
def test_a_fast_path_test_fails_under_ci_and_skips_elsewhere(tmp_path, numba):
    """The target: numba unimportable fails CI naming numba; outside CI, a skip with the reason
    (`fused` is the fast path's test module; its first test stands for them all)."""
    test = "tests/test_fused.py::test_the_host_table_takes_the_fused_kernels_where_they_apply"
    args = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test]
    env = _env(tmp_path, numba)
    out = {ci: subprocess.run(args, capture_output=True, text=True, env=dict(env, CI=ci),
                              cwd=ROOT, timeout=300) for ci in ("", "true")}
    elsewhere, ci = out[""], out["true"]
    assert elsewhere.returncode == 0 and "1 skipped" in elsewhere.stdout, elsewhere.stdout
    assert "SKIPPED" in elsewhere.stdout and "numba is" in elsewhere.stdout
    assert ci.returncode != 0, ci.stdout
    if numba == "absent":
        assert "missing prerequisite: numba is not installed" in ci.stdout, ci.stdout
    else:  # the module's import itself fails, naming numba's error
        assert "numba is installed but broken" in ci.stdout, ci.stdout
