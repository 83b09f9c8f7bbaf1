"""Every command block of README.md runs as written, in a temporary copy of the repository.

The copy gets short step counts (the one substitution, see `shorten`): jobs/tiny.yaml trains 6
steps with an eval and a checkpoint every 3, `--set run.steps=N` becomes 4, and `ratrain bench`
times one round. Each line of a ```bash block (backslash continuations joined) runs with
`bash -c` in the copy's root, in order, with the test's Python first on PATH (so `python`,
`mpirun` and `ratrain` are this environment's; a `ratrain` wrapper around `python -m ratrain`
stands in when the console script is not installed) and PYTHONPATH at the copy; ```python
blocks run with that Python, and ```yaml blocks must load as config sections. Lines that cannot run here are skipped for the reason listed in
`SKIP` (installs, a cluster, files of the reader's own); everything else must exit 0.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ratrain.config import config_from_dict
from tests._prereq import strict

ROOT = Path(__file__).resolve().parents[1]

SKIP = [  # (pattern of a command, why it does not run here)
    (r"^scripts/(demo|test)\.sh", "builds .venv with pip; the demo's own command runs below, and "
     "the suite is what runs this test"),
    (r"^python3 -m venv|^\. \.venv|^pip install|pip install", "installs packages (CI installs "
     "them through scripts/setup.sh)"),
    (r"^module load|^MPICC=|^srun |^sbatch |^j=\$\(sbatch |^RATRAIN_SRUN_MPI=|^RATRAIN_LAUNCHER=",
     "needs a cluster (a site MPI, Slurm)"),
    (r"run\.device=gpu|--device gpu", "needs a GPU (scripts/gpu-check.sh runs the GPU checks; the "
     "same commands on the stand-in are tests/test_device.py's)"),
    (r"my_texts/|path/to/", "names the reader's own files (a tokenizer.json run is "
     "tests/test_users.py's, a Megatron corpus tests/test_data_formats.py's)"),
    *([(r"^scripts/cluster\.sh", "emulated nodes need root, ip and tc (tests/test_cluster.py)")]
      if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")) else []),
]
NEEDS = [  # (pattern, module): skipped when the module is not installed
    (r"import torch|transformers", "transformers"),
]


def shorten(cmd: str) -> str:
    """The documented substitution: short runs."""
    cmd = re.sub(r"run\.steps=\d+", "run.steps=4", cmd)
    return re.sub(r"^(python -m ratrain\.bench|ratrain bench)\b(?!\S)", r"\1 --rounds 1 --warmup 0",
                  cmd)


def blocks(text: str):
    """(language, [command, ...]) of every fenced block, in order."""
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, re.S):
        if lang in ("python", "yaml"):  # a program; a job file's sections
            yield lang, [body]
            continue
        if lang != "bash":
            continue
        cmds, cur = [], ""
        for line in body.splitlines():
            cur += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                if cur.strip() and not cur.strip().startswith("#"):
                    cmds.append(cur.strip())
                cur = ""
        yield lang, cmds


def skip_reason(cmd: str) -> str | None:
    for pattern, why in SKIP:
        if re.search(pattern, cmd):
            return why
    for pattern, module in NEEDS:
        if re.search(pattern, cmd):
            try:
                __import__(module)
            except ImportError:
                if strict():  # CI or RATRAIN_TEST_TORCH=1: the reference checks must run
                    pytest.fail(f"missing prerequisite: {module} (README: {cmd[:60]})",
                                pytrace=False)
                return f"needs {module}"
    return None


def _copy(dst: Path) -> Path:
    top = {".git", ".venv", "runs", "data", "hf", "build", ".pytest_cache", ".ruff_cache"}

    def ignore(folder, names):  # the run outputs at the top; caches anywhere but numba's
        here = set(names) & top if Path(folder) == ROOT else set()
        if Path(folder).name == "__pycache__":  # numba's compiled kernels (the source stamps
            return {n for n in names if not n.endswith((".nbi", ".nbc"))}  # are copied too)
        return here | {n for n in names if n.endswith(".egg-info")}

    shutil.copytree(ROOT, dst, symlinks=True, ignore=ignore)
    job = dst / "jobs" / "tiny.yaml"
    text = job.read_text()
    for key, value in (("steps", 6), ("log_interval", 2), ("eval_interval", 3), ("interval", 3)):
        text, n = re.subn(rf"(\n  {key}: )\d+", rf"\g<1>{value}", text)
        assert n == 1, f"jobs/tiny.yaml: no {key}"
    job.write_text(text)
    return dst


def _env(repo: Path, tmp: Path) -> dict:
    bindir = Path(sys.executable).parent
    path = [str(bindir)]
    if not (bindir / "ratrain").exists():
        shim = tmp / "bin"
        shim.mkdir()
        (shim / "ratrain").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ratrain "$@"\n')
        (shim / "ratrain").chmod(0o755)
        path.insert(0, str(shim))
    env = dict(os.environ, PYTHONPATH=str(repo), PATH=os.pathsep.join(
        [*path, os.environ.get("PATH", "")]), MPLBACKEND="Agg",
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_mpi_yield_when_idle="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    return env


def test_readme_blocks_parse():
    found = [c for lang, cmds in blocks((ROOT / "README.md").read_text()) for c in cmds
             if lang == "bash"]
    assert any(c.startswith("python -m ratrain.eval") for c in found)
    assert all(not c.endswith("\\") for c in found)
    assert shorten("ratrain train --config tiny --set run.steps=20") == \
        "ratrain train --config tiny --set run.steps=4"
    assert shorten("python -m ratrain.bench") == "python -m ratrain.bench --rounds 1 --warmup 0"


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    repo = _copy(tmp_path / "repo")
    env = _env(repo, tmp_path)
    ran, skipped = [], []
    for lang, cmds in blocks((repo / "README.md").read_text()):
        for cmd in cmds:
            why = skip_reason(cmd) if lang == "bash" else None
            if why:
                skipped.append((cmd, why))
                continue
            if lang == "yaml":  # sections of a job: valid config (keys, types, values)
                config_from_dict(yaml.safe_load(cmd), "README.md")
                ran.append(cmd)
                continue
            argv = ["bash", "-c", shorten(cmd)] if lang == "bash" else [sys.executable, "-c", cmd]
            p = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True,
                               timeout=600)
            assert p.returncode == 0, (
                f"README command failed (exit {p.returncode}): {cmd}\n"
                f"--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}")
            ran.append(cmd)
    print(f"ran {len(ran)} README commands; skipped {len(skipped)}:")
    for cmd, why in skipped:
        print(f"  {cmd[:70]}  ({why})")
    assert len(ran) >= 20, ran
