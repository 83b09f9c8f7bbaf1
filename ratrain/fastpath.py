"""The switch of the compiled fast paths (`exec.fused`, `comm.board`) and the one place numba,
their compiler (the `fast` extra), is imported: on first use, never by importing a module.

numba costs a rank about 65 MiB of resident memory to import and about 50 more once it loads
or compiles a kernel (docs/BENCHMARKS.md, "A rank's memory"), so it is imported only when a fast
path is on and first asked for (`FastPath.on`), and a compiled kernel is compiled (or loaded
from numba's cache, shared by every rank of a host) on its first call (`jit`): a rank whose
fast paths are off, or that never calls one, never imports it.

`load_numba()` tells three cases apart:

    importable  the fast paths are on, unless RATRAIN_FUSED is 0 or off
    absent      numba itself is not installed (ModuleNotFoundError for `numba`): off, and
                `why_off` says so
    broken      numba is installed but its import fails (its own ImportError "NumPy version
                too new", a missing llvmlite, anything else): under CI (`CI=true`) an
                ImportError naming the error, so a fast path that should be tested cannot pass
                as absent; elsewhere off, with a RuntimeWarning naming the error
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
    """The switch of one compiled fast path: `on` when `RATRAIN_FUSED` is unset or not 0/off,
    the path's own variable `own` (if any) allows it (unset means `default_on`, 0/off turns it
    off, any other value on) and numba imports, which is asked (numba imported) on the first
    read of `on` only when the variables allow the path. `why_off` says why not; `available`
    whether numba imports; `disabled()` / `forced()` run a block on the plain / compiled path
    (tests compare the two)."""

    def __init__(self, own: str | None = None, default_on: bool = True):
        own_on = own is None or os.environ.get(own, "1" if default_on else "0") not in ("0", "off")
        if os.environ.get("RATRAIN_FUSED", "1") in ("0", "off"):
            self._why = "turned off by RATRAIN_FUSED=0"
        elif not own_on:
            self._why = (f"turned off by {own}=0" if own in os.environ else
                         f"off by default ({own}=1 turns it on)")
        else:
            self._why = ""
        self._on: bool | None = None  # decided on the first read (numba imported then)

    @property
    def available(self) -> bool:
        return load_numba()[0] is not None

    @property
    def why_off(self) -> str:
        return self._why or load_numba()[1]

    @property
    def on(self) -> bool:
        if self._on is None:
            self._on = not self._why and self.available
        return self._on

    @contextlib.contextmanager
    def forced(self):
        """The compiled path on for a block (tests); numba must import."""
        if not self.available:
            raise RuntimeError(f"cannot force a fast path on: {self.why_off}")
        before, self._on = self._on, True
        try:
            yield
        finally:
            self._on = before

    @contextlib.contextmanager
    def disabled(self):
        before, self._on = self._on, False
        try:
            yield
        finally:
            self._on = before


class _Compiled:
    """A function compiled by numba on its first call (see `jit`)."""

    def __init__(self, fn, options: dict):
        self.py_func, self.options, self._fn = fn, options, None
        functools.update_wrapper(self, fn)

    def compiled(self):
        """The numba dispatcher (compiled, or loaded from the cache, on the first call), or
        the plain function where numba does not import."""
        if self._fn is None:
            numba = load_numba()[0]
            self._fn = numba.njit(**self.options)(self.py_func) if numba else self.py_func
        return self._fn

    def __call__(self, *args):
        return (self._fn or self.compiled())(*args)


def jit(**options):
    """`numba.njit(**options)`, applied on the decorated function's first call instead of at
    import (with `cache=True` the compiled code is read from numba's cache, written by the first
    process to compile it, so the ranks of a host compile each kernel once)."""
    return lambda fn: _Compiled(fn, options)
