"""The one place numba, the compiler of the CPU's fast paths (`exec.fused`; the `fast` extra), is
imported.

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
