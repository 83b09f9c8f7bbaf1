"""ratrain: a resource-aware training runtime for dense LLMs."""

import contextlib
import os

__version__ = "0.1.0"


class FastPath:
    """The switch of one compiled fast path (`exec.fused`, `comm.board`): `on` when its compiler
    is `available` (numba, the `fast` extra) and `RATRAIN_FUSED` is unset or not 0/off;
    `disabled()` runs a block on the plain path (tests compare the two)."""

    def __init__(self, available: bool):
        self.on = available and os.environ.get("RATRAIN_FUSED", "1") not in ("0", "off")

    @contextlib.contextmanager
    def disabled(self):
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before
