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
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from contextlib import contextmanager

from ratrain.job import faults
from ratrain.job.runctl import EXIT_ERROR

_notify: Callable[[str, int], None] | None = None  # the watchdog's failure notice, when one runs
_record: Callable[[int, str], None] | None = None  # writes how the job ended (status.json)


def on_abort(hook: Callable[[str, int], None] | None) -> None:
    """Call `hook(reason, code)` before MPI_Abort (the watchdog tells the other ranks); None:
    none."""
    global _notify
    _notify = hook


def on_end(hook: Callable[[int, str], None] | None) -> None:
    """Call `hook(code, why)` when this rank ends the job, or learns that another rank does,
    before MPI_Abort (the trainer writes status.json); None: none."""
    global _record
    _record = hook


def record_end(code: int, why: str) -> None:
    """Run the `on_end` hook once, if any; never raises (the end goes on whatever it does)."""
    global _record
    hook, _record = _record, None
    if hook is not None:
        with contextlib.suppress(Exception):
            hook(code, why)


def _world_rank() -> int:
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    except Exception:  # pragma: no cover - MPI not usable
        return -1


def abort(exc: BaseException | None = None, code: int = EXIT_ERROR, why: str = "") -> None:
    """Print `exc` (if any) tagged with the rank, record the end (`on_end`), then stop every
    rank of the job. In elastic mode (`job.faults` watching) an error of this rank ends this
    rank alone, by SIGKILL, which MPI's fault tolerance reports to the survivors as a lost
    process (an exit with a status would leave them waiting), and they go on without it."""
    rank = _world_rank()
    if exc is not None and faults.watching():
        _leave(exc, rank)
    if exc is not None:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        sys.stderr.write(f"[rank {rank}] {type(exc).__name__}: {exc}\n"
                         + "".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
        sys.stderr.write(f"[rank {rank}] aborting the job (MPI_Abort)\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if exc is not None:
        first = (str(exc).splitlines() or [""])[0]
        why = why or f"rank {rank} failed: {type(exc).__name__}: {first}"
        if _notify is not None:
            with contextlib.suppress(Exception):  # the abort happens whatever the notice does
                _notify(why, code)
    record_end(code, why)
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _leave(exc: BaseException, rank: int) -> None:
    """Elastic mode: print why this rank fails, then end it by SIGKILL (see `abort`)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stderr.write(f"[rank {rank}] {type(exc).__name__}: {exc}\n"
                     + "".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines())
                     + f"[rank {rank}] this rank leaves the job (elastic: the others go on)\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


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


__all__ = ["abort", "abort_on_error", "install_excepthook", "on_abort", "on_end", "record_end"]
