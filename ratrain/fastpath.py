"""The one place numba, the compiler of the CPU's fast paths (`exec.fused`; the `fast` extra), is
imported: on first use, never by importing a module.

numba costs a rank about 65 MiB of resident memory to import and about 50 more once it loads
or compiles a kernel (docs/BENCHMARKS.md, "A rank's memory"), so it is imported only when a fast
path is first asked for (the kernel table, `exec.backends`), and a compiled kernel is compiled
(or loaded from numba's cache, shared by every rank of a host) on its first call (`jit`): a rank
whose fast paths are off, or that never calls one, never imports it.

`load_numba()` tells three cases apart:

    importable  the fast paths can run (whether they do is the config's choice: `run.fused`
                in the kernel table, `exec.backends`)
    absent      numba itself is not installed (ModuleNotFoundError for `numba`): they cannot,
                and the reason says so
    broken      numba is installed but its import fails (its own ImportError "NumPy version
                too new", a missing llvmlite, anything else): under CI (`CI=true`) an
                ImportError naming the error, so a fast path that should be tested cannot pass
                as absent; elsewhere off, with a RuntimeWarning naming the error
"""

from __future__ import annotations

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


class _Compiled:
    """A function compiled by numba on its first call (see `jit`)."""

    def __init__(self, fn, options: dict, prepare=None):
        self.py_func, self.options, self.prepare, self._fn = fn, options, prepare, None
        functools.update_wrapper(self, fn)

    def compiled(self):
        """The numba dispatcher (compiled, or loaded from the cache, on the first call), or
        the plain function where numba does not import."""
        if self._fn is None:
            numba = load_numba()[0]
            if numba is not None and self.prepare is not None:
                self.prepare(numba)
            self._fn = numba.njit(**self.options)(self.py_func) if numba else self.py_func
        return self._fn

    def __call__(self, *args):
        return (self._fn or self.compiled())(*args)


def jit(prepare=None, **options):
    """`numba.njit(**options)`, applied on the decorated function's first call instead of at
    import (with `cache=True` the compiled code is read from numba's cache, written by the first
    process to compile it, so the ranks of a host compile each kernel once). `prepare(numba)`
    runs first: what the function calls must be compiled before it is."""
    return lambda fn: _Compiled(fn, options, prepare)
