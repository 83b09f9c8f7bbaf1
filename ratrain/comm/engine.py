"""The communication engine: one thread that owns every MPI call of the runtime.

The main thread computes; it hands communication to the engine and gets a
`concurrent.futures.Future` back:

    engine = CommEngine(topo, watchdog_s=120, link=Link.from_profile(prof), ledger=ledger,
                        config=cfg.comm)                 # comm.allreduce, comm.log_messages
    fut = engine.allreduce(grad_flat, topo.dp_comm)      # runs while the main thread computes
    ...
    fut.result()                                         # re-raises any error from the engine

Operations are the generators of `ratrain.comm.wire` / `collectives` (or any generator of the
same kind, or a plain function). A collective's `algo="auto"` is the registry's rule
(`algos.choose`) with the config's `comm.allreduce`; `comm.log_messages` turns the message log
on (`wire.log_messages`, for the process). The engine thread drives all in-flight operations together
with a `progress.Scheduler`: it tests their MPI requests and timers without blocking, so a
gradient all-reduce and the pipeline's messages progress at the same time and share the
throttled link. When nothing is ready it sleeps in short, growing steps (`poll_s` up to
`max_poll_s`) instead of spinning, leaving the cores to the compute threads.

Threading: mpi4py initialises MPI with MPI_THREAD_MULTIPLE (its default, `mpi4py.rc.thread_level`),
and Open MPI 5 provides it. The engine itself needs only MPI_THREAD_SERIALIZED, provided that
while an engine is open every MPI call of the runtime goes through it (p2p verbs and
collectives take `engine=`); the engine checks for at least SERIALIZED when it starts.

Tags: collectives run on a tag of their own (per communicator, in submission order), so several
may be in flight on one communicator; every rank must submit collectives on a communicator in
the same order (as with MPI). Messages use the tag they are given.

Watchdog: an operation that has not finished `watchdog_s` after it was submitted (the config's
`comm.timeout`) fails with `CommTimeout` naming the operation, its sequence number and the rank;
the engine is then broken (later submissions fail at once) and the caller should stop the job
(`abort_on_error`). With the job's watchdog attached (`engine.attach(watchdog)`,
`comm.watchdog`), an operation waiting on a rank that has stopped answering is left to it: it
names the silent rank on every rank and ends the job; the operation's own error says what the
watchdog knows.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
from concurrent.futures import Future

from mpi4py import MPI

from ratrain.config import CommConfig
from ratrain.shim.link import fine_sleep

from . import algos
from . import collectives as coll
from ratrain.job import faults
from .progress import SPIN_S, Deadline, Scheduler, Task, sleep_until
from .wire import log_messages, recv_op, send_op

COLL_TAG_BASE = 20000
COLL_TAG_SPAN = 8192


class CommTimeout(TimeoutError):
    """A communication operation did not finish within the watchdog's time."""


class EngineClosed(RuntimeError):
    """The engine was closed or broke (after a timeout); it accepts no more operations."""


class CommEngine:
    def __init__(self, comm_or_topology=None, watchdog_s: float | None = 300.0, *, link=None,
                 ledger=None, poll_s: float = 2e-5, max_poll_s: float = 5e-4, name: str = "comm",
                 config: CommConfig | None = None):
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                "CommEngine needs MPI initialised with at least MPI_THREAD_SERIALIZED (mpi4py's "
                "default is MULTIPLE); do not set mpi4py.rc.thread_level lower"
            )
        obj = comm_or_topology if comm_or_topology is not None else MPI.COMM_WORLD
        self.topology = obj if hasattr(obj, "pp_comm") else None
        self.comm = obj.comm if self.topology is not None else obj
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.watchdog_s = watchdog_s
        self.configured = config.allreduce if config else "auto"  # comm.allreduce
        algos.check_choice(self.configured)
        if config is not None:
            log_messages(config.log_messages)
        self.link, self.ledger = link, ledger
        self.poll_s, self.max_poll_s = poll_s, max_poll_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sched = Scheduler()
        self._seq = 0
        self._coll_count: dict[int, int] = {}
        self._lock = threading.Lock()
        self._inflight: dict[int, Task] = {}  # seq -> task, for the watchdog
        self._broken: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=f"ratrain-{name}-engine", daemon=True)
        self._thread.start()
        self._dog = None
        self._job_watchdog = None  # comm.watchdog.Watchdog, when attached
        if watchdog_s:
            self._dog = threading.Thread(target=self._watch, name=f"ratrain-{name}-watchdog", daemon=True)
            self._dog.start()

    # -- submitting -------------------------------------------------------------------------------

    def submit(self, fn, *args, name: str | None = None, **kwargs) -> Future:
        """Run `fn(*args, **kwargs)` in the engine thread. If it returns a generator (an operation),
        the engine drives it alongside the others; otherwise its return value is the result."""
        fut: Future = Future()
        with self._lock:
            if isinstance(self._broken, faults.RankLost):  # elastic: the recovery makes anew
                fut.set_exception(faults.RankLost(str(self._broken)))
                return fut
            if self._broken is not None or self._closing:
                fut.set_exception(EngineClosed(
                    f"rank {self.rank}: communication engine is closed"
                    + (f" after: {self._broken}" if self._broken is not None else "")))
                return fut
            self._seq += 1
            seq = self._seq
        self._queue.put((seq, name or getattr(fn, "__name__", "op"), fut, fn, args, kwargs))
        self._wake.set()
        return fut

    def _coll_tag(self, comm) -> int:
        """A fresh tag for the next collective on `comm` (same sequence on every rank)."""
        key = comm.py2f()
        with self._lock:
            k = self._coll_count.get(key, 0)
            self._coll_count[key] = k + 1
        return COLL_TAG_BASE + k % COLL_TAG_SPAN

    def _group(self, comm):
        """The topology's NodeGroup of `comm` (hierarchical collectives), or None."""
        return self.topology.group(comm) if self.topology is not None else None

    def allreduce(self, buf, comm=None, algo: str = "auto", op="sum") -> Future:
        comm = comm if comm is not None else self.comm
        nbytes, group = buf.nbytes, self._group(comm)
        if algo == "auto":
            algo = coll.choose_algo(nbytes, comm.Get_size(), self.link, group, self.configured)
        tag = self._coll_tag(comm)
        return self.submit(coll.allreduce_op, buf, comm, algo, op, tag, self.link, self.ledger,
                           group, name=f"allreduce({algo}, {nbytes} B, {comm.Get_size()} ranks)")

    def reduce_scatter(self, buf, comm=None, op="sum", algo: str = "auto") -> Future:
        comm = comm if comm is not None else self.comm
        return self.submit(coll.reduce_scatter_op, buf, comm, op, self._coll_tag(comm), self.link,
                           self.ledger, algo, self._group(comm),
                           name=f"reduce_scatter({algo}, {buf.nbytes} B)")

    def allgather(self, buf, comm=None, algo: str = "auto") -> Future:
        comm = comm if comm is not None else self.comm
        return self.submit(coll.allgather_op, buf, comm, self._coll_tag(comm), self.link, algo,
                           self._group(comm), name=f"allgather({algo}, {buf.nbytes} B)")

    def bcast(self, buf, comm=None, root: int = 0) -> Future:
        comm = comm if comm is not None else self.comm
        return self.submit(coll.bcast_op, buf, comm, root, self._coll_tag(comm), self.link,
                           name=f"bcast({buf.nbytes} B, root {root})")

    def send(self, arr, dest: int, tag: int = 0, comm=None, verb: str = "send") -> Future:
        comm = comm if comm is not None else self.comm
        return self.submit(send_op, arr, dest, tag, comm, self.link, verb,
                           name=f"{verb}(to {dest}, tag {tag}, {arr.nbytes} B)")

    def recv(self, out, source: int, tag: int = 0, comm=None, verb: str = "recv") -> Future:
        """Receive into `out`; the future's result is `out`."""
        comm = comm if comm is not None else self.comm
        return self.submit(recv_op, out, source, tag, comm, self.link, verb,
                           name=f"{verb}(from {source}, tag {tag}, {out.nbytes} B)")

    def attach(self, watchdog) -> None:
        """Defer operation timeouts to the job's watchdog while some rank is silent."""
        self._job_watchdog = watchdog

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Finish the operations in flight, then stop the thread."""
        with self._lock:
            self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the engine thread ------------------------------------------------------------------------

    def _start(self, item) -> None:
        seq, name, fut, fn, args, kwargs = item
        if not fut.set_running_or_notify_cancel():
            return

        def done(value, seq=seq, fut=fut):
            self._inflight.pop(seq, None)
            if not fut.done():
                fut.set_result(value)

        def fail(err, seq=seq, fut=fut, name=name):
            self._inflight.pop(seq, None)
            if not fut.done():
                err.add_note(f"in communication op {name} #{seq} on rank {self.rank}")
                fut.set_exception(err)

        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            fail(e)
            return
        if not inspect.isgenerator(out):
            done(out)
            return
        task = Task(out, done, fail, name, seq)
        self._inflight[seq] = task
        self._sched.add(task)

    def _loop(self) -> None:
        fine_sleep()
        sleep = self.poll_s
        while True:
            started = False
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._start(item)
                started = True
            try:
                faults.check()  # elastic: a lost peer fails what is in flight (a no-op off)
            except faults.RankLost as e:
                self._fail_all(e)
            progressed, timer = self._sched.poll()
            if not self._sched.tasks:
                if self._closing and self._queue.empty():
                    return
                self._wake.wait(0.05)
                self._wake.clear()
                sleep = self.poll_s
                continue
            if progressed or started:
                sleep = self.poll_s
                continue
            polling = self._sched.polling  # some task waits on requests, not only on a timer
            wait = sleep
            if timer is not None:
                dt = timer - time.perf_counter()
                if isinstance(timer, Deadline) and dt <= (sleep if polling else SPIN_S):
                    sleep_until(timer)  # a message's end: met closely (spins its last SPIN_S)
                    continue
                if not polling:  # only timers: sleep to the earliest (a submission wakes us)
                    wait = dt - SPIN_S if isinstance(timer, Deadline) else dt
                else:
                    wait = min(wait, max(0.0, dt))
            if wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
            sleep = min(sleep * 2, self.max_poll_s)

    def _fail_all(self, err: BaseException) -> None:
        """A peer is lost (elastic): every operation in flight or queued fails with `err`, and
        so does every later submission (the recovery makes a new engine)."""
        with self._lock:
            if self._broken is None:
                self._broken = err
        for task in list(self._sched.tasks):
            task.dead = True
            self._sched.tasks.remove(task)
            self._inflight.pop(task.seq, None)
            task.on_error(faults.RankLost(str(err)))
        while True:
            try:
                _seq, _name, fut, _fn, _a, _k = self._queue.get_nowait()
            except queue.Empty:
                break
            if not fut.done():
                fut.set_exception(faults.RankLost(str(err)))

    def _watch(self) -> None:
        period = min(1.0, self.watchdog_s / 4)
        last = time.perf_counter()
        while self._thread.is_alive():
            time.sleep(period)
            now = time.perf_counter()
            if now - last > period + max(1.0, period):  # this process was frozen (SIGSTOP)
                for task in list(self._inflight.values()):
                    task.t_start = max(task.t_start, now)  # not the peers' fault: time anew
            last = now
            for seq, task in list(self._inflight.items()):
                age = now - task.t_start
                if age > self.watchdog_s and not task.dead:
                    dog = self._job_watchdog
                    if dog is not None and dog.hold(task.name, age):
                        continue  # a rank is silent: the job's watchdog names it and ends the job
                    known = f"; {dog.explain()}" if dog is not None else ""
                    err = CommTimeout(
                        f"rank {self.rank}: communication op {task.name} #{seq} did not finish "
                        f"within comm.timeout={self.watchdog_s:g} s (running {age:.1f} s): a peer "
                        f"is missing, stuck, or submitted collectives in a different order{known}"
                    )
                    task.dead = True
                    with self._lock:
                        self._broken = err
                    self._inflight.pop(seq, None)
                    task.on_error(err)


__all__ = ["CommEngine", "CommTimeout", "EngineClosed"]
