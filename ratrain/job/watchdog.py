"""The job's watchdog: every rank's sign of life, who stopped answering, and why the job ends.

    wd = Watchdog(MPI.COMM_WORLD, timeout_s=cfg.comm.timeout)   # collective, at start-up
    wd.doing("checkpoint save at step 100")                     # what this rank is doing now
    ...
    wd.close()                                                  # collective, at the end

One thread per rank, on its own duplicate of the world communicator, so it shares no tag with
the runtime. Every `period` (a tenth of the timeout, 0.2-5 s) each rank sends rank 0 (the
monitor) a heartbeat holding its current activity, and rank 0 sends every rank one holding its
own activity and the ranks it has not heard from for two periods (the suspects). A rank the
monitor has not heard from for `timeout_s` (stopped by SIGSTOP, frozen whole, its node gone),
or rank 0 when another rank has not heard from it that long, is named and the job ends on every
rank: the rank that noticed sends every rank a failure notice (each prints it, naming the
silent rank, its host and PID and its last activity), then calls MPI_Abort (exit code 3). A
stopped process answers nothing, whatever it was doing, so this covers the start-up agreement,
checkpoint writes and gathers, evaluation and training steps alike, with no timeout on the
operations themselves (a checkpoint write may take as long as it takes while its rank answers).

Failure notices also carry an ordinary error: `comm.abort.abort()` calls `notify_failure`
first, so an exception on one rank (a DDR cap exceeded) is printed by every rank, not only by
the one that failed before MPI_Abort took the others down.

Operations with a timeout of their own (the communication engine's watchdog) ask `hold()`
before failing: while a rank is a suspect the decision is the monitor's, which names the silent
rank; otherwise the operation fails, and `explain()` adds what the watchdog knows.

Needs MPI_THREAD_MULTIPLE (mpi4py's default; Open MPI 5 provides it): the thread makes MPI
calls while the main and engine threads make theirs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from ratrain.job import abort as _abort
from ratrain.job import faults
from ratrain.job.runctl import EXIT_ERROR, EXIT_SILENT

TAG_BEAT, TAG_FAIL, TAG_ACK = 11, 12, 13
BEAT_BYTES = 1024  # a heartbeat: JSON padded with zeros
FAIL_BYTES = 8192  # a failure notice


def _encode(obj, size: int) -> np.ndarray:
    raw = json.dumps(obj).encode()[:size]
    buf = np.zeros(size, np.uint8)
    buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    return buf


def _decode(buf: np.ndarray):
    raw = bytes(buf).rstrip(b"\0")
    try:
        return json.loads(raw.decode(errors="replace"))
    except ValueError:  # truncated: a very long activity
        return {}


class Watchdog:
    """Heartbeats, silence detection and failure notices for one rank (see the module)."""

    def __init__(self, comm, timeout_s: float, *, period_s: float | None = None, out=None):
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("the watchdog needs MPI_THREAD_MULTIPLE (mpi4py's default)")
        self.comm = comm.Dup()  # collective
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        self.who = self.comm.allgather((socket.gethostname(), os.getpid()))  # collective
        self.timeout = float(timeout_s)
        self.period = period_s or min(5.0, max(0.2, self.timeout / 10))
        self.out = out or sys.stderr
        self.activity = "start-up"
        self.frozen_until = 0.0  # when this process last woke from being frozen (monotonic)
        self.suspects: dict[int, float] = {}  # rank -> seconds silent (as the monitor sees it)
        now = time.monotonic()
        self._heard = {r: now for r in self._watched()}  # rank -> when last heard from
        self._doing = {r: "start-up" for r in self._watched()}
        self._sends: list = []  # (request, buffer) until complete
        self._stop = threading.Event()
        self._changed = threading.Event()  # the activity changed: tell the monitor soon
        self._closing = False
        self._bye: set[int] = set()
        self._failing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ratrain-watchdog", daemon=True)
        self._thread.start()
        _abort.on_abort(self.notify_failure)

    # -- what the rest of the runtime calls --------------------------------------------------------

    def doing(self, activity: str) -> None:
        """Set what this rank is doing (sent at once: the heartbeat thread wakes; printed by
        the others if it goes silent)."""
        self.activity = activity
        self._changed.set()

    def silent(self, ranks) -> bool:
        """Whether any of `ranks` (of the watched communicator) may have stopped answering: a
        suspect, or, seen from a rank other than the monitor, the monitor itself gone quiet."""
        ranks = set(ranks)
        return bool(ranks & set(self.suspects)) or (self.rank != 0 and 0 in self.suspects)

    def hold(self, what: str = "", age: float = 0.0) -> bool:
        """Whether an operation that timed out should wait on: True while some rank is a
        suspect (the monitor will end the job naming it), for at most another timeout."""
        return bool(self.suspects) and age < 2 * self.timeout

    def was_frozen(self, since: float) -> bool:
        """Whether this process itself was frozen (stopped) after monotonic time `since`."""
        return self.frozen_until > since

    def explain(self) -> str:
        """What the watchdog knows, for an operation's timeout error."""
        if self.suspects:
            return "silent ranks: " + ", ".join(self._name(r) for r in sorted(self.suspects))
        return "every rank still answers its heartbeats (a slow peer, or a deadlock)"

    def close(self, timeout_s: float | None = None) -> None:
        """Stop heartbeating (collective): each rank says goodbye to the monitor, which answers
        once it has heard every rank's, so no message is left unmatched."""
        if self._stop.is_set():
            return
        self._closing = True
        self._thread.join(timeout_s if timeout_s is not None else max(30.0, 2 * self.timeout))
        self._stop.set()
        self._thread.join(5.0)
        _abort.on_abort(None)
        if not self._thread.is_alive():
            self.comm.Free()

    def notify_failure(self, message: str, code: int = EXIT_ERROR) -> None:
        """Tell every other rank why the job is about to end; wait briefly for them to say they
        printed it (called by `comm.abort.abort` before MPI_Abort)."""
        if not self._failing.acquire(blocking=False):
            return  # already notifying (the watchdog thread and an error at once)
        targets = [r for r in range(self.size) if r != self.rank and r not in self.suspects]
        buf = _encode({"from": self.world_rank, "msg": message, "code": code}, FAIL_BYTES)
        reqs = [self.comm.Isend([buf, MPI.BYTE], r, TAG_FAIL) for r in targets]
        acks = [self.comm.Irecv([np.zeros(1, np.uint8), MPI.BYTE], r, TAG_ACK) for r in targets]
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not MPI.Request.Testall(acks):
            time.sleep(0.005)
        del reqs  # never waited for: MPI_Abort follows

    # -- the thread --------------------------------------------------------------------------------

    def _watched(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank] if self.rank == 0 else [0]

    def _name(self, r: int) -> str:
        host, pid = self.who[r]
        return f"rank {r} (pid {pid} on {host})"

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a broken watchdog must not pass silently
            if faults.watching() and faults.lost(e):  # elastic: a lost peer; the loop recovers
                faults.trip(f"the watchdog's messages failed: {e}")
                return
            self.out.write(f"[rank {self.world_rank}] warning: the watchdog stopped: {e}\n")

    def abandon(self) -> None:
        """Elastic recovery: stop the thread without the collective goodbye (its communicator
        is revoked; the recovery makes a new watchdog on the survivors')."""
        self._stop.set()
        self._changed.set()
        self._thread.join(2.0)
        _abort.on_abort(None)

    def _loop(self) -> None:
        beats = {r: np.zeros(BEAT_BYTES, np.uint8) for r in self._watched()}
        recv = {r: self.comm.Irecv([beats[r], MPI.BYTE], r, TAG_BEAT) for r in beats}
        fail_buf = np.zeros(FAIL_BYTES, np.uint8)
        fail = self.comm.Irecv([fail_buf, MPI.BYTE], MPI.ANY_SOURCE, TAG_FAIL)
        status = MPI.Status()
        next_beat = 0.0
        tick = min(0.25, self.period / 4)
        last = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last > max(1.0, self.period):  # this process was frozen (SIGSTOP), not them
                self._heard = {r: now for r in self._heard}
                self.frozen_until = now
            last = now
            if fail is not None and fail.Test(status):
                self._on_failure(_decode(fail_buf), status.Get_source())
                fail = None
            for r in list(recv):
                if recv[r].Test():
                    self._on_beat(r, _decode(beats[r]), now)
                    if r in self._bye:
                        del recv[r]
                    else:
                        recv[r] = self.comm.Irecv([beats[r], MPI.BYTE], r, TAG_BEAT)
            if now >= next_beat or self._changed.is_set() or (self._closing and self._may_say_bye()):
                self._changed.clear()
                self._beat()
                next_beat = now + self.period
            self._check_silence(now)
            self._sends = [(q, b) for q, b in self._sends if not q.Test()]
            if self._closing and self._said_bye and (self.rank != 0 or not recv) and \
                    (self.rank == 0 or 0 in self._bye):
                break
            self._changed.wait(tick)  # a changed activity goes out at once (the thread wakes)
        for q in [*recv.values(), *([fail] if fail is not None else [])]:
            q.Cancel()
            q.Wait()
        MPI.Request.Waitall([q for q, _ in self._sends])

    _said_bye = False

    def _may_say_bye(self) -> bool:
        """Rank 0 says goodbye once every rank has; the others at once."""
        return not self._said_bye and (self.rank != 0 or len(self._bye) == self.size - 1)

    def _beat(self) -> None:
        if self._said_bye:
            return  # nothing after a goodbye: the peer no longer listens
        bye = self._closing and self._may_say_bye()
        msg = {"a": self.activity, "bye": bye}
        if self.rank == 0:
            msg["s"] = {str(r): round(s, 1) for r, s in self.suspects.items()}
            targets = [r for r in range(1, self.size) if r not in self.suspects or bye]
        else:
            targets = [0]
        for r in targets:
            buf = _encode(msg, BEAT_BYTES)
            self._sends.append((self.comm.Isend([buf, MPI.BYTE], r, TAG_BEAT), buf))
        self._said_bye = self._said_bye or bye

    def _on_beat(self, r: int, msg: dict, now: float) -> None:
        self._heard[r] = now
        self._doing[r] = msg.get("a", "")
        if msg.get("bye"):
            self._bye.add(r)
        if r == 0 and self.rank != 0:
            self.suspects = {int(k): v for k, v in msg.get("s", {}).items()}

    def _check_silence(self, now: float) -> None:
        silent = {r: now - t for r, t in self._heard.items() if r not in self._bye}
        if self.rank == 0:
            self.suspects = {r: s for r, s in silent.items() if s > 2 * self.period}
        elif silent.get(0, 0.0) > 2 * self.period:
            self.suspects = {**self.suspects, 0: silent[0]}
        gone = sorted(r for r, s in silent.items() if s >= self.timeout)
        if gone:
            names = "; ".join(
                f"{self._name(r)}, last doing: {self._doing.get(r) or '?'}" for r in gone)
            self.suspects.update({r: silent[r] for r in gone})  # no notice to them
            self._end(f"{'ranks' if len(gone) > 1 else 'rank'} {', '.join(map(str, gone))} "
                      f"stopped answering: no sign of life for {max(silent[r] for r in gone):.1f} s "
                      f"(comm.timeout={self.timeout:g}): {names}")

    def _kill(self, ranks) -> None:
        """Elastic mode: end the silent `ranks` that run on this host (SIGKILL), so that MPI
        reports them failed and the survivors shrink; a stopped process answers nothing else."""
        here = socket.gethostname()
        for r in ranks:
            host, pid = self.who[r]
            if host == here:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def _end(self, message: str) -> None:
        if faults.watching():  # elastic: the silent rank goes, the others go on
            gone = sorted(r for r, s in self.suspects.items() if s >= self.timeout)
            self.out.write(f"[rank {self.world_rank}] error: {message}; ending it (elastic: the "
                           "others go on)\n")
            self.out.flush()
            self._kill(gone)
            faults.trip(message)
            self._stop.set()
            return
        self.out.write(f"[rank {self.world_rank}] error: {message}; ending the job on every rank "
                       "(MPI_Abort)\n")
        self.out.flush()
        message += f" (noticed by rank {self.world_rank})"
        self.notify_failure(message, EXIT_SILENT)
        _abort.abort(None, EXIT_SILENT, message)

    def _on_failure(self, msg: dict, source: int) -> None:
        self.out.write(f"[rank {self.world_rank}] error: the job ends: {msg.get('msg', '?')}\n")
        self.out.flush()
        code = int(msg.get("code", EXIT_ERROR))
        _abort.record_end(code, msg.get("msg", "?"))  # a surviving rank says how the job ended
        self.comm.Isend([np.zeros(1, np.uint8), MPI.BYTE], source, TAG_ACK).Wait()
        # The sender calls MPI_Abort next; should it not, end this rank ourselves.
        threading.Timer(10.0, _abort.abort, (None, code)).start()


__all__ = ["Watchdog"]
