"""Faults of the job's processes, as MPI's fault tolerance (ULFM) reports them.

Under `elastic.enabled` (`mpirun --with-ft ulfm`) every communicator of the runtime returns its
errors instead of aborting (`returning`), and a lost peer surfaces as `RankLost` wherever this
rank next meets it: a message or collective that involves the dead rank fails with
`MPI.ERR_PROC_FAILED`; one on a communicator another survivor revoked fails with
`MPI.ERR_REVOKED`. A rank that only waits (on shared memory, or idle between steps) would never
meet it, so the waits poll `check()`: MPI progress, then whether a watched communicator is
revoked or holds a failed process. Every survivor thus learns of a loss within a few
milliseconds, revokes its communicators (`revoke_all`) so the others do too, and leaves what it
was doing for the recovery (`ratrain.elastic`).

It lives with the job's life (`ratrain.job`) so that the communication layer and the control
plane above it can both look. Off (the default) nothing here runs: communicators keep MPI's default handler, and `check()` is
a no-op, so the runtime's behaviour and speed are as before.

    faults.watch([world, dp_comm, ...])     # elastic: these return errors; check() reads them
    faults.check()                          # raises RankLost once a peer is lost (rate-limited)
    faults.lost(e)                          # whether an exception is a peer's loss
    faults.trip("why")                      # this rank knows of a loss another way (watchdog)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

CHECK_S = 0.02  # the least time between two looks at the watched communicators
PROBE_TAG = 32767  # no message uses it: an Iprobe on it only drives MPI's progress


class RankLost(RuntimeError):
    """A peer of the job failed (or another survivor says so by revoking): the step in flight
    cannot finish; the survivors recover (`ratrain.elastic`)."""


@functools.cache
def fault_classes() -> tuple[int, ...]:
    """MPI's error classes of a lost peer: a failed process (pending), a revoked communicator."""
    from mpi4py import MPI  # the job's MPI (this package does not load it on import)

    return tuple(c for c in (getattr(MPI, "ERR_PROC_FAILED", None),
                             getattr(MPI, "ERR_PROC_FAILED_PENDING", None),
                             getattr(MPI, "ERR_REVOKED", None)) if c is not None)


def lost(e: BaseException) -> bool:
    """Whether `e` reports a lost peer: `RankLost`, or an MPI error of a failed process or a
    revoked communicator (directly, or as the cause of another exception)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RankLost):
            return True
        if hasattr(e, "Get_error_class"):
            cls = e.Get_error_class()
            if cls in fault_classes():
                return True
            if cls == _in_status() and _WATCH.on and _failure_known():
                return True  # a wait on several requests: one of them met the lost peer
        e = e.__cause__ or e.__context__
    return False


def _in_status() -> int:
    from mpi4py import MPI  # the job's MPI (this package does not load it on import)

    return MPI.ERR_IN_STATUS


def _failure_known() -> bool:
    """Whether this rank knows of a lost peer: tripped, or a watched communicator revoked or
    holding a failed process."""
    if _WATCH.why is not None:
        return True
    try:
        check(force=True)
    except RankLost:
        return True
    return False


class _Watch:
    """The process's watched communicators and what is known of a loss (see the module)."""

    def __init__(self):
        self.comms: list = []
        self.why: str | None = None  # a loss known: every check raises
        self.at: float | None = None  # wall-clock time it became known
        self.lost_any = False  # a peer was lost in this job's life (MPI may not finalize)
        self.last = 0.0
        self.lock = threading.Lock()

    @property
    def on(self) -> bool:
        return bool(self.comms)


_WATCH = _Watch()


def returning(comm):
    """`comm` with MPI's errors returned as exceptions (elastic: a lost peer is an error to
    handle, not the end of the job); `comm` itself."""
    from mpi4py import MPI  # the job's MPI (this package does not load it on import)

    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


def watch(comms) -> None:
    """Watch `comms` (elastic mode): each returns its errors, and `check()` looks at them."""
    from mpi4py import MPI  # the job's MPI (this package does not load it on import)

    with _WATCH.lock:
        for c in comms:
            if c is not None and c != MPI.COMM_NULL and c not in _WATCH.comms:
                _WATCH.comms.append(returning(c))


def unwatch_all() -> None:
    """Forget every watched communicator and any loss known (a recovery's new start)."""
    with _WATCH.lock:
        _WATCH.comms, _WATCH.why, _WATCH.at = [], None, None


def watching() -> bool:
    """Whether elastic mode watches this process's communicators."""
    return _WATCH.on


def trip(why: str) -> None:
    """This rank knows a peer is lost (its watchdog found it silent, or an error said so):
    every later `check()` raises."""
    with _WATCH.lock:
        _WATCH.lost_any = True
        if _WATCH.why is None:
            _WATCH.why, _WATCH.at = why, time.time()


def note_loss() -> None:
    """A loss reached this rank (as an MPI error, without a `trip`): remembered for `finalize`."""
    _WATCH.lost_any = True


def seen_at() -> float | None:
    """The wall-clock time this rank first knew of the loss (`trip`), or None."""
    return _WATCH.at


def check(force: bool = False) -> None:
    """Raise `RankLost` when a peer is known lost: tripped, or a watched communicator revoked
    or holding a failed process (MPI's progress driven first). At most every `CHECK_S` unless
    `force`; a no-op when nothing is watched."""
    w = _WATCH
    if not w.comms:
        return
    if w.why is not None:
        raise RankLost(w.why)
    now = time.monotonic()
    if not force and now - w.last < CHECK_S:
        return
    w.last = now
    from mpi4py import MPI  # watching: MPI is loaded

    for c in list(w.comms):
        try:
            c.Iprobe(MPI.ANY_SOURCE, PROBE_TAG)
            if c.Is_revoked():
                trip("a communicator was revoked by a survivor of a lost rank")
            elif c.Get_failed().Get_size():
                trip("a process of the job failed")
        except MPI.Exception as e:
            if e.Get_error_class() not in fault_classes():
                raise
            trip(f"MPI reports a lost peer ({e.Get_error_string()})")
        if w.why is not None:
            raise RankLost(w.why)


def finalize(code: int) -> None:
    """End the process in elastic mode once a peer was lost: with `code`, its output flushed,
    without MPI_Finalize, which may wait for ever on the lost peer or on requests it left
    pending (seen with Open MPI 5.0's ULFM). The launcher is told the process ends on purpose
    (`PMIx_Finalize`, where the PMIx library is loaded: a spawned process that skips it counts as
    an abnormal end), then the process exits. A job that lost nothing ends as usual (a no-op
    here)."""
    if not (_WATCH.on and _WATCH.lost_any):
        return
    import ctypes
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError, AttributeError):  # no PMIx loaded: nothing to tell
        pmix = ctypes.CDLL("libpmix.so.2", mode=getattr(os, "RTLD_NOLOAD", 4) | ctypes.RTLD_GLOBAL)
        pmix.PMIx_Finalize(None, ctypes.c_size_t(0))
    os._exit(code)


def revoke_all() -> None:
    """Revoke every watched communicator, so that every rank still waiting in one of them
    learns of the loss (ULFM's revoke reaches them all); errors of ones already revoked are
    ignored."""
    for c in list(_WATCH.comms):
        with contextlib.suppress(Exception):  # revoked already, or its peers gone
            if not c.Is_revoked():
                c.Revoke()


__all__ = ["CHECK_S", "RankLost", "fault_classes", "check", "finalize", "lost", "returning", "revoke_all",
           "note_loss", "seen_at", "trip", "unwatch_all", "watch", "watching"]
