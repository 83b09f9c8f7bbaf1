"""CI fails instead of skipping: with PyTorch's install made to fail, `.ci/run` (scripts/test.sh
under CI=true and RATRAIN_TEST_TORCH=1) stops before any test with one line naming torch; with
torch unimportable, a reference test fails under CI and is skipped with the reason elsewhere.
(numba's cases: tests/test_fastpath.py.)"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_PY = """#!/usr/bin/env bash
# a venv's python whose PyTorch is not there and whose pip cannot install it
case "$*" in
  *"import torch"*) exit 1 ;;
  *"-m pip install"*) echo "ERROR: No matching distribution found for $*" >&2; exit 1 ;;
  *"-m pytest"*) echo "REACHED PYTEST"; exit 3 ;;
esac
exec {real} "$@"
"""


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "RATRAIN_TEST_TORCH")}
    return dict(env, **extra)


def test_ci_fails_naming_torch_when_its_install_fails(tmp_path):
    repo = tmp_path / "repo"  # scripts, .ci and setup.cfg: what the scripts read before pytest
    for d in ("scripts", ".ci"):
        shutil.copytree(ROOT / d, repo / d)
    shutil.copy(ROOT / "setup.cfg", repo)
    venv = repo / ".venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(FAKE_PY.format(real=sys.executable))
    py.chmod(0o755)
    (venv / ".ratrain-installed").touch()  # scripts/setup.sh: installed already
    p = subprocess.run(["bash", str(repo / ".ci" / "run")], capture_output=True, text=True,
                       env=_clean_env(), timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        "error: could not install torch (torch==2.13.0); the reference checks need it")
    assert "REACHED PYTEST" not in p.stdout


def test_a_reference_test_fails_under_ci_and_skips_elsewhere_without_torch(tmp_path):
    (tmp_path / "torch").mkdir()  # shadows any installed torch: import torch fails as if absent
    (tmp_path / "torch" / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'torch\'", name="torch")\n')
    env = _clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    args = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
            "tests/test_hf_parity.py"]
    out = {k: subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300,
                             env=dict(env, **v))
           for k, v in {"elsewhere": {}, "ci": {"CI": "true"},
                        "torch": {"RATRAIN_TEST_TORCH": "1"}}.items()}
    assert out["elsewhere"].returncode == 0, out["elsewhere"].stdout
    assert "SKIPPED [1] tests/test_hf_parity.py" in out["elsewhere"].stdout
    assert "torch does not import (ModuleNotFoundError" in out["elsewhere"].stdout
    for k in ("ci", "torch"):
        assert out[k].returncode == 1, out[k].stdout
        assert "missing prerequisite: torch does not import" in out[k].stdout
