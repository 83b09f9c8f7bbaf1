"""ratrain: a resource-aware training runtime for dense LLMs."""

import os

__version__ = "0.1.0"


def fast_requested() -> bool:
    """Whether the compiled fast paths may run: `RATRAIN_FUSED` unset or not 0/off (they also
    need numba, the `fast` extra; `exec.fused` and `comm.board` check that)."""
    return os.environ.get("RATRAIN_FUSED", "1") not in ("0", "off")
