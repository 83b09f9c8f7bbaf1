"""The switch of the compiled fast paths (`exec.fused`, `comm.board`) and the one place numba,
their compiler (the `fast` extra), is imported.

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
    """The switch of one compiled fast path: `on` when numba imports and `RATRAIN_FUSED` (and
    the path's own variable `own`, if any) is unset or not 0/off; `why_off` says why not;
    `disabled()` runs a block on the plain path (tests compare the two)."""

    def __init__(self, own: str | None = None):
        numba, self.why_off = load_numba()
        off = [v for v in ("RATRAIN_FUSED", own) if v and os.environ.get(v, "1") in ("0", "off")]
        if numba is not None and off:
            self.why_off = f"turned off by {off[0]}=0"
        self.on = numba is not None and not off

    @contextlib.contextmanager
    def disabled(self):
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before
