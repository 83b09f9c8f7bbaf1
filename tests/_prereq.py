"""Prerequisites a test cannot run without: a failure under CI, a skip elsewhere.

Under CI (`CI=true`) or `RATRAIN_TEST_TORCH=1` (the reference checks were asked for), a
prerequisite that is missing (PyTorch, transformers, tokenizers, numba, oneMKL, Slurm's
packages, namespaces as root) fails the test with one line naming it, so CI cannot go green with a group
of checks gone. Elsewhere the test is skipped with the same line as its reason (scripts/test.sh
lists every skip and its reason at the end).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess

import pytest

from ratrain.fastpath import in_ci


def strict() -> bool:
    """Whether a missing prerequisite fails (CI, or the reference checks asked for)."""
    return in_ci() or os.environ.get("RATRAIN_TEST_TORCH", "0") == "1"


def missing(what: str):
    """Fail (strict) or skip, with `what` as the one line."""
    if strict():
        pytest.fail(f"missing prerequisite: {what}", pytrace=False)
    raise pytest.skip.Exception(what, _use_item_location=True)  # the test's line in -rs


def need(module: str, why: str = ""):
    """The imported `module`, or `missing(...)` naming it (and what it is for)."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a broken install is as missing as an absent one
        missing(f"{module} does not import ({type(e).__name__}: {e})" + (f"; {why}" if why else ""))


def need_fast():
    """The fused kernels' tests (`exec.fused`, numba): `missing(...)` when numba does not
    import. (They pick the fused or the plain path by the kernel table, so no switch of the
    environment turns them off.)"""
    from ratrain.exec import fused

    if not fused.available():
        missing(fused.why_off())


def need_mkl():
    """oneMKL's tests (`exec.blas`, `run.blas: mkl`): the library, or `missing(...)` when it
    does not load (scripts/test.sh installs the `mkl` wheel)."""
    from ratrain.exec import blas

    why = blas.why_no_mkl()
    if why:
        missing(f"{why}; scripts/test.sh installs it")
    return blas.load_mkl()


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A tmpfs of `size` mounted at `path` (made) for the block: needs root; `missing(...)`
    (a failure under CI) when it cannot be had."""
    if os.geteuid() != 0:
        missing("mounting a small tmpfs needs root")
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode:
        missing("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)])
