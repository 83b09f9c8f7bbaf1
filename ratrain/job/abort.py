"""One failing rank stops the job: print the error with the rank, then MPI_Abort.

An exception on one rank would otherwise leave the others waiting forever in a receive or a
collective. Wrap the rank's work, or install the hooks once at start-up:

    with abort_on_error():
        train(cfg)

    install_excepthook()     # sys.excepthook and threading.excepthook do the same

`python -m mpi4py script.py` does the same for a whole script. With a watchdog running
(`comm.watchdog`), the reason is first sent to every other rank, which prints it too, so the job
says why it ended on every rank and not only on the one that failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Callable
from contextlib import contextmanager

from ratrain.job.runctl import EXIT_ERROR

_notify: Callable[[str], None] | None = None  # the watchdog's failure notice, when one runs


def on_abort(hook: Callable[[str], None] | None) -> None:
    """Call `hook(reason)` before MPI_Abort (the watchdog tells the other ranks); None: none."""
    global _notify
    _notify = hook


def _world_rank() -> int:
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    except Exception:  # pragma: no cover - MPI not usable
        return -1


def abort(exc: BaseException | None = None, code: int = EXIT_ERROR) -> None:
    """Print `exc` (if any) tagged with the rank, then stop every rank of the job."""
    rank = _world_rank()
    if exc is not None:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        sys.stderr.write(f"[rank {rank}] {type(exc).__name__}: {exc}\n"
                         + "".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
        sys.stderr.write(f"[rank {rank}] aborting the job (MPI_Abort)\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if exc is not None and _notify is not None:
        first = (str(exc).splitlines() or [""])[0]
        with contextlib.suppress(Exception):  # the abort happens whatever the notice does
            _notify(f"rank {rank} failed: {type(exc).__name__}: {first}")
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


@contextmanager
def abort_on_error(code: int = EXIT_ERROR):
    """Run the body; on any exception (not a clean SystemExit) abort the whole job."""
    try:
        yield
    except SystemExit as e:
        if e.code not in (None, 0):
            abort(e, code)
        raise
    except BaseException as e:
        abort(e, code)


def install_excepthook(code: int = EXIT_ERROR) -> None:
    """Abort the job on an uncaught exception in any thread."""
    sys.excepthook = lambda t, e, tb: abort(e.with_traceback(tb), code)
    threading.excepthook = lambda args: abort(args.exc_value, code)


__all__ = ["abort", "abort_on_error", "install_excepthook", "on_abort"]
