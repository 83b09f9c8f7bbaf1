"""The one place numba, the compiler of the fast paths (`exec.fused`, `comm.board`; the `fast`
extra), is imported.

`load_numba()` tells three cases apart:

    importable  the fast paths can run (whether they do is the config's choice: `run.fused`
                in the kernel table, `exec.backends`)
    absent      numba itself is not installed (ModuleNotFoundError for `numba`): they cannot,
                and the reason says so
    broken      numba is installed but its import fails (its own ImportError "NumPy version
                too new", a missing llvmlite, anything else): under CI (`CI=true`) an
                ImportError naming the error, so a fast path that should be tested cannot pass
                as absent; elsewhere off, with a RuntimeWarning naming the error

`FastPath` is the board's switch until `comm.board` reads its config key (`comm.board`); the
exec kernels no longer use it. It reads RATRAIN_FUSED and the board's variable once, when the
board's module is imported.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings


def in_ci() -> bool:
    """Whether this process runs under CI (`CI=true`, as CI services set it)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@functools.cache
def load_numba():
    """(the numba module, "") when it imports, else (None, why the fast paths are off)."""
    try:
        import numba
        return numba, ""
    except ModuleNotFoundError as e:
        if e.name == "numba":
            return None, "numba is not installed (the fast extra)"
        err: Exception = e
    except Exception as e:  # noqa: BLE001 - any failure of an installed numba means broken
        err = e
    why = f"numba is installed but broken: {type(err).__name__}: {err}"
    if in_ci():
        raise ImportError(f"{why} (CI=true: a broken fast path fails; repair or uninstall "
                          "numba)") from err
    warnings.warn(f"{why}; the fast paths are off", RuntimeWarning, stacklevel=2)
    return None, why


class FastPath:
    """The board's switch (see the module): `on` when numba imports, `RATRAIN_FUSED` is unset
    or not 0/off, and the path's own variable `own` (if any) allows it: unset means
    `default_on`, 0/off turns it off, any other value on. `why_off` says why not; `available`
    whether numba imports; `disabled()` / `forced()` run a block on the plain / compiled path
    (tests compare the two)."""

    def __init__(self, own: str | None = None, default_on: bool = True):
        numba, self.why_off = load_numba()
        self.available = numba is not None
        own_on = own is None or os.environ.get(own, "1" if default_on else "0") not in ("0", "off")
        if os.environ.get("RATRAIN_FUSED", "1") in ("0", "off"):
            why = "turned off by RATRAIN_FUSED=0"
        elif not own_on:
            why = (f"turned off by {own}=0" if own in os.environ else
                   f"off by default ({own}=1 turns it on)")
        else:
            why = ""
        if self.available and why:
            self.why_off = why
        self.on = self.available and not why

    @contextlib.contextmanager
    def forced(self):
        """The compiled path on for a block (tests); numba must import."""
        if not self.available:
            raise RuntimeError(f"cannot force a fast path on: {self.why_off}")
        before, self.on = self.on, True
        try:
            yield
        finally:
            self.on = before

    @contextlib.contextmanager
    def disabled(self):
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before
