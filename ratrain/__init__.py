"""ratrain: a resource-aware training runtime for dense LLMs."""

import contextlib
import os

__version__ = "0.1.0"


def fast_requested() -> bool:
    """Whether the compiled fast paths may run: `RATRAIN_FUSED` unset or not 0/off (they also
    need numba, the `fast` extra; `exec.fused` and `comm.board` check that)."""
    return os.environ.get("RATRAIN_FUSED", "1") not in ("0", "off")


class FastPath:
    """The switch of one compiled fast path: `on` when its compiler is `available` and
    `fast_requested()`; `disabled()` runs a block on the plain path (tests compare the two)."""

    def __init__(self, available: bool):
        self.on = available and fast_requested()

    @contextlib.contextmanager
    def disabled(self):
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before
