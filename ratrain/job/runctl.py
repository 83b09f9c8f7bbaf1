"""Run control: how a run ends (exit codes), who owns a run directory (the lock), and when to
stop early (signals, a wall-clock budget).

    lock = RunLock.acquire(run_dir)      # RunLocked if another live run holds it
    stop = StopRequests(cfg.run, hard_exit=lambda code: abort(None, code))
    ... at each step boundary: reason = stop.local_reason(step_s, save_s)
    stop.close(); lock.release()

Exit codes of `python -m ratrain.train` (README.md, "When things go wrong"):

    0   finished (or there was nothing left to do)
    1   an unexpected error on some rank (the job was aborted)
    2   bad input, refused before any work
    3   a rank stopped answering (comm.timeout): the job was ended on every rank
    4   training diverged: optim.max_nonfinite_steps consecutive non-finite steps
    5   a checkpoint could not be written (checkpoint.on_error: stop); the last one is intact
    75  stopped early on a signal or run.time_limit with a checkpoint at the step reached: run
        the same command again to continue (EX_TEMPFAIL: the batch scripts requeue on it)
    76  interrupted at once (a second signal, or run.stop_grace ran out): resume continues
        from the last committed checkpoint

The lock is an advisory `flock` on `<dir>/.ratrain.lock`, held by rank 0 for the whole run and
released by the kernel when the process ends, however it ends; the file holds the holder's
host, PID and start time so that a second run can say who owns the directory. A file naming a
process that no longer holds the lock (it was killed) is taken over with a message. Where the
file system has no `flock`, the lock falls back to that file alone: a live PID on this host
refuses, a dead one is taken over, another host's is refused (remove the file if that run has
ended).

Signals (`run.stop_signals`, default TERM and USR1): the first asks for a graceful stop at the
next step boundary (the trainer agrees on it across ranks, writes a checkpoint, exits 75); a
second one, or `run.stop_grace` seconds without having stopped, calls `hard_exit(76)`. A repeat
within `REPEAT_S` of the first is the same request arriving twice (Slurm signals the ranks and the
batch script, which forwards it) and is ignored.
`run.time_limit` asks for the same stop when the time left would not cover another step and a
checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import signal
import socket
import tempfile
import threading
import time

from ratrain.fileio import atomic_write, open_no_follow
from ratrain.job.codes import (
    EXIT_CHECKPOINT,
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SILENT,
    EXIT_STOPPED,
    EXIT_USAGE,
)
from ratrain.job.early import signum
STATES = {None: "running", EXIT_OK: "finished", EXIT_ERROR: "failed", EXIT_USAGE: "refused",
          EXIT_SILENT: "a rank stopped answering", EXIT_DIVERGED: "diverged",
          EXIT_CHECKPOINT: "checkpoint failed", EXIT_STOPPED: "stopped",
          EXIT_INTERRUPTED: "interrupted"}
STATUS_BYTES = 1024  # status.json's fixed size: updated in place, so a full disk cannot stop it

LOCK_NAME = ".ratrain.lock"
REPEAT_S = 2.0  # a second signal sooner than this after the first is a duplicate

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


class RunLocked(RuntimeError):
    """The directory belongs to another run that is still alive."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _holder(info: dict) -> str:
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since "
            f"{info.get('started', '?')}")


class RunLock:
    """An exclusive lock on a directory (see the module); `release()` or process exit frees it."""

    def __init__(self, path: str, fd: int, note: str | None):
        self.path, self._fd, self.note = path, fd, note

    @classmethod
    def acquire(cls, directory: str, what: str = "run.dir") -> RunLock:
        """Lock `directory` (created if absent); RunLocked naming the holder if it is taken.
        `note` says when a dead holder's lock was taken over."""
        path = os.path.join(directory, LOCK_NAME)
        try:
            os.makedirs(directory, exist_ok=True)
            fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)  # never through a link
        except OSError as e:
            raise OSError(unwritable(what, directory, e)) from None
        try:
            old = cls._read(fd)
            if not cls._flock(fd):
                raise RunLocked(
                    f"{what} {directory} is in use by another run ({_holder(old)}; lock file "
                    f"{path}): wait for it to end, stop it, or give this run another {what}")
            if not cls._flock_works(fd) and old and cls._alive_elsewhere(old):
                raise RunLocked(
                    f"{what} {directory} may be in use by another run ({_holder(old)}; lock file "
                    f"{path}, this file system has no flock): remove the file if that run ended")
            note = None
            if old.get("pid"):
                note = (f"{what} {directory}: taking over the lock of {_holder(old)}, which no "
                        "longer runs (it was killed or its node failed)")
            cls._write(fd, {"host": socket.gethostname(), "pid": os.getpid(),
                            "started": datetime.datetime.now().isoformat(timespec="seconds")})
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, note)

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            raw = os.pread(fd, 4096, 0)
            info = json.loads(raw) if raw.strip() else {}
            return info if isinstance(info, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _write(fd: int, info: dict) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)

    _no_flock: set = set()  # descriptors on file systems without flock

    @classmethod
    def _flock(cls, fd: int) -> bool:
        if fcntl is None:
            cls._no_flock.add(fd)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            cls._no_flock.add(fd)
        return True

    @classmethod
    def _flock_works(cls, fd: int) -> bool:
        return fd not in cls._no_flock

    @staticmethod
    def _alive_elsewhere(info: dict) -> bool:
        """Whether the holder named in a lock file may still run (no flock to tell)."""
        if info.get("host") != socket.gethostname():
            return True
        return int(info.get("pid", 0)) != os.getpid() and _pid_alive(int(info.get("pid", 0)))

    def release(self) -> None:
        """Empty the file (a clean end: the next run has nothing to take over) and unlock."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        self._no_flock.discard(self._fd)
        os.close(self._fd)  # the flock goes with the last descriptor
        self._fd = None


def unwritable(key: str, path: str, e: OSError) -> str:
    """One line: what could not be written, where, why, and the key that moves it."""
    why = e.strerror or str(e)
    return (f"cannot write {key}={path} ({why}{': ' + e.filename if e.filename and e.filename != path else ''}): "
            f"free space or fix the permissions there, or set {key} to a writable directory")


def check_writable(directory: str, key: str) -> None:
    """Whether `directory` (config key `key`) can be made and written, leaving nothing behind:
    it or its nearest existing parent is a directory where an entry can be made (OSError
    naming `key` otherwise)."""
    path = os.path.abspath(directory)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OSError(unwritable(key, directory, OSError(errno.ENOTDIR, "not a directory", probe)))
    try:  # the one sure test: make (and remove) an entry there
        os.rmdir(tempfile.mkdtemp(prefix=".ratrain-probe-", dir=probe))
    except OSError as e:
        raise OSError(unwritable(key, directory, OSError(e.errno, e.strerror, probe))) from None


def lock_dirs(run_dir: str, ckpt_dir: str, log) -> list[RunLock]:
    """Lock `run_dir`, and `ckpt_dir` when it lies outside it; `log` the takeover notes."""
    locks = [RunLock.acquire(run_dir)]
    inside = os.path.commonpath([os.path.abspath(ckpt_dir), os.path.abspath(run_dir)])
    try:
        if inside != os.path.abspath(run_dir):
            locks.append(RunLock.acquire(ckpt_dir, "checkpoint.dir"))
    except BaseException:
        locks[0].release()
        raise
    for lock in locks:
        if lock.note:
            log(lock.note)
    return locks


def write_status(run_dir: str, step: int, code: int | None = None, why: str = "",
                 state: str | None = None) -> None:
    """`<run_dir>/status.json`, one line: {"state", "exit", "step", "time"} and, when the run
    did not end its own way, "why" (rank 0 writes it when the run starts and when it ends, the
    rank that fails or notices a failure when it is alive to), so that a batch script whose
    launcher reports the ranks' exit badly (srun kills the ranks still exiting once one has
    exited non-zero) still knows how the run ended.

    The file has a fixed size (`STATUS_BYTES`, padded with spaces): written whole at the start
    (`atomic_write`), then overwritten in place, which takes no new room, so that it still says
    why when the disk is full."""
    info = {"state": state or STATES.get(code, "failed"), "exit": code, "step": step,
            "time": round(time.time(), 3)}
    if why:
        info["why"] = why[: STATUS_BYTES // 2]
    raw = json.dumps(info).encode()
    raw = raw + b" " * max(0, STATUS_BYTES - 1 - len(raw)) + b"\n"
    path = os.path.join(run_dir, "status.json")
    try:
        fd = open_no_follow(path, os.O_WRONLY)
    except FileNotFoundError:
        atomic_write(path, raw)
        return
    try:
        if os.fstat(fd).st_size != len(raw):
            raise OSError(errno.EINVAL, "not this run's status file", path)
        os.pwrite(fd, raw, 0)
        os.fsync(fd)
    except OSError:
        atomic_write(path, raw)  # an older layout, or in-place writes refused: the usual way
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Stop requests
# --------------------------------------------------------------------------------------------


class StopRequests:
    """Signal handlers and the wall-clock budget of one run (see the module)."""

    def __init__(self, run_cfg, hard_exit, *, install: bool = True, clock=time.monotonic):
        self.cfg, self.hard_exit, self.clock = run_cfg, hard_exit, clock
        self.t0 = clock()
        self.reason: str | None = None  # why a stop was asked for (first request)
        self.t_request = 0.0
        self._previous: dict = {}
        self._grace: threading.Timer | None = None
        if install:
            for name in run_cfg.stop_signals:
                sig = signum(name)
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None:
            if self.clock() - self.t_request < REPEAT_S:
                return  # the same request, delivered twice
            self.hard_exit(EXIT_INTERRUPTED, f"a second signal ({name}) while stopping: exiting "
                                             "now; the last committed checkpoint is kept")
            return
        self.request(name)

    def request(self, reason: str) -> None:
        """Ask for a stop at the next step boundary; start the grace timer."""
        if self.reason is not None:
            return
        self.reason, self.t_request = reason, self.clock()
        if self.cfg.stop_grace:
            self._grace = threading.Timer(self.cfg.stop_grace, self.hard_exit, (
                EXIT_INTERRUPTED, f"the graceful stop ({reason}) did not finish within "
                f"run.stop_grace={self.cfg.stop_grace:g} s: exiting now; the last committed "
                "checkpoint is kept"))
            self._grace.daemon = True
            self._grace.start()

    def time_left(self) -> float | None:
        if not self.cfg.time_limit:
            return None
        return self.cfg.time_limit - (self.clock() - self.t0)

    def local_reason(self, step_s: float, save_s: float) -> str | None:
        """This rank's reason to stop now: a signal, or `run.time_limit` when what is left
        would not cover another step and a checkpoint (with a margin of one more step)."""
        left = self.time_left()
        if self.reason is None and left is not None and left < 2 * step_s + save_s:
            self.request(f"run.time_limit={self.cfg.time_limit:g} s ({max(left, 0):.0f} s left)")
        return self.reason

    def close(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
        for sig, old in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)
        self._previous = {}


__all__ = [
    "EXIT_CHECKPOINT", "EXIT_DIVERGED", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_SILENT",
    "EXIT_STOPPED", "EXIT_USAGE", "LOCK_NAME", "RunLock", "RunLocked", "StopRequests",
    "check_writable", "lock_dirs", "unwritable", "write_status",
]
