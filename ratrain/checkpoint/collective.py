"""How the checkpoint functions run across ranks.

`comm` is anything mpi4py-like with `Get_rank`, `Get_size`, `gather`, `bcast` (pickled,
lower-case), or None for one process (`Solo`). These are control-plane calls made between
steps, never in the training hot path; if a communication engine thread owns MPI, call the
checkpoint functions while it is idle or pass a wrapper whose methods run through the engine.
Work that one rank does for all (listing, reading the manifest, committing) runs on rank 0 and
its result or error is broadcast (`root_then_bcast`), so every rank returns or raises the same.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ratrain.checkpoint.names import CheckpointError, CheckpointSpaceError
from ratrain.checkpoint.space import is_space_error


class Solo:
    """The communicator of a single process."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def gather(self, obj, root=0):
        return [obj]

    def bcast(self, obj, root=0):
        return obj


def root_then_bcast(comm, fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0, broadcast its result; a failure raises the same error on every rank
    (a CheckpointSpaceError, or an OSError that says the disk is full, as CheckpointSpaceError)."""
    res = None
    if comm.Get_rank() == 0:
        try:
            res = ("ok", fn())
        except CheckpointError as e:
            res = ("space" if is_space_error(e) else "err", str(e))
        except Exception as e:  # noqa: BLE001 - any failure on rank 0 must reach the others
            res = ("space" if is_space_error(e) else "err", f"{type(e).__name__}: {e}")
    res = comm.bcast(res, root=0)
    if res[0] != "ok":
        raise (CheckpointSpaceError if res[0] == "space" else CheckpointError)(res[1])
    return res[1]


def log_default(msg: str) -> None:
    """Where rank 0's checkpoint messages go unless the caller passes `log`."""
    print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)
