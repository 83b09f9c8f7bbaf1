"""Operations as generators, and the two ways of driving them.

Every communication operation of ratrain (a message, a ring all-reduce, ...) is written once as a
generator that posts non-blocking MPI calls and yields what it waits for:

    a list of MPI requests    resume when all have completed
    a float                   resume when `time.perf_counter()` reaches it (the link throttle);
                              a `Deadline` (a float) is met closely: the driver sleeps until
                              `SPIN_S` before it and spins the rest (a message's last chunk)
    a callable                resume when it returns True

`run(gen)` drives one operation to completion in the calling thread (blocking collectives, tests,
the benchmark). `Scheduler` drives many at once, interleaved, without blocking in MPI: the
communication engine runs one in its thread, so collectives and pipeline messages progress
together and share the link.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Generator
from typing import Any

from mpi4py import MPI

from ratrain.shim.link import fine_sleep

from ratrain.job import faults

Op = Generator[Any, None, Any]

# A sleep overshoots by 30-70 us on a KVM guest even with 1 us timer slack (measured here:
# median 28 us for sleep(0), 63-70 us for 100-250 us sleeps), which would add to every emulated
# message. Deadlines are slept to SPIN_S before and spun from there.
SPIN_S = 1.5e-4


class Deadline(float):
    """A timer to meet closely (the release of a message's last chunk, which ends the message)."""


def sleep_until(t: float) -> None:
    """Return at clock time `t` (`time.perf_counter()`): a plain sleep, or for a `Deadline`
    a sleep to `SPIN_S` before it and a spin (yielding the core) for the rest."""
    dt = t - time.perf_counter()
    if isinstance(t, Deadline):
        if dt > SPIN_S:
            time.sleep(dt - SPIN_S)
        while time.perf_counter() < t:
            os.sched_yield()
    elif dt > 0:
        time.sleep(dt)


def local_ranks() -> int | None:
    """Ranks on this node, from the launcher's environment (Open MPI, MPICH / Hydra, Slurm);
    None when no launcher says."""
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"):
        v = os.environ.get(var, "")
        if v.isdigit():
            return int(v)
    return None


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@functools.cache
def spare_core() -> bool:
    """Whether every rank of this node has a core of its own (then waiting ranks may spin).
    Decided once per process."""
    n = local_ranks()
    return n is not None and n <= cores()


YIELD_S = 1e-4  # a condition is polled yielding the core this long before sleeps begin
MAX_SLEEP_S = 5e-4  # ... then in sleeps that double up to this


def wait_for(cond: Callable[[], bool], timeout_s: float | None = None, what: str = "") -> None:
    """Return once `cond()` is true, or raise `TimeoutError` naming `what` after `timeout_s`
    (None: no bound; the engine's operations are watched by the engine instead): polled yielding the core for `YIELD_S` (conditions are
    mostly another rank of the node writing shared memory, which a yield lets run), then in
    sleeps that double from 10 us to `MAX_SLEEP_S` (a condition that waits for the network,
    a round of a collective every few ms, is then not polled thousands of times a second:
    measured here, 8 ranks on 2 cores, a 64 MiB hierarchical all-reduce over 1 Gbit/s spent
    ~1.1 s of CPU polling at a fixed 10 us sleep). Yielding for 1 ms instead starved the
    ranks that had work (1.3 MB/s through the interface)."""
    t0 = time.perf_counter()
    t_end = t0 + YIELD_S
    nap = 1e-5
    while not cond():
        faults.check()  # elastic: a lost peer ends the wait (a no-op off)
        now = time.perf_counter()
        if now < t_end:
            os.sched_yield()
            continue
        if timeout_s is not None and now - t0 > timeout_s:
            raise TimeoutError(f"{what or 'a wait'} did not finish within comm.timeout="
                               f"{timeout_s:g} s: a peer is missing, stuck, or called "
                               "collectives in a different order")
        time.sleep(nap)
        nap = min(2 * nap, MAX_SLEEP_S)


def run(gen: Op, poll_s: float | None = None):
    """Drive one operation to completion in this thread; returns its value.

    Requests are waited for in MPI (which spins: lowest latency) unless `poll_s` is given (used
    with the link throttle, where ranks mostly wait for their wire slots); then they are tested
    in a loop that yields the core between tests when every rank of the node has a core of its
    own (`spare_core`), and otherwise every `poll_s` seconds with sleeps in between, leaving the
    cores to the other ranks.
    """
    spin = False
    if poll_s is not None:
        fine_sleep()
        spin = spare_core()
    try:
        wait = next(gen)
        while True:
            if isinstance(wait, list):
                if poll_s is not None:
                    while wait and not MPI.Request.Testall(wait):
                        faults.check()
                        if spin:
                            os.sched_yield()
                        else:
                            time.sleep(poll_s)
                elif wait:
                    MPI.Request.Waitall(wait)
            elif isinstance(wait, float):
                sleep_until(wait)
            elif wait is not None:
                wait_for(wait)
            wait = gen.send(None)
    except StopIteration as stop:
        return stop.value


def ready(wait) -> bool:
    """Whether what an operation waits for has happened (never blocks)."""
    if wait is None:
        return True
    if isinstance(wait, list):
        return not wait or MPI.Request.Testall(wait)
    if isinstance(wait, float):
        return time.perf_counter() >= wait
    return bool(wait())


class Task:
    """One operation in a Scheduler: its generator, what it waits for, and callbacks."""

    __slots__ = ("gen", "wait", "on_done", "on_error", "name", "seq", "t_start", "dead")

    def __init__(self, gen: Op, on_done: Callable, on_error: Callable, name: str = "", seq: int = 0):
        self.gen, self.wait = gen, None
        self.on_done, self.on_error = on_done, on_error
        self.name, self.seq = name, seq
        self.t_start = time.perf_counter()
        self.dead = False  # set by a watchdog: drop without touching the generator again


class Scheduler:
    """Cooperatively drives many operations; `poll()` advances every one that can advance."""

    def __init__(self):
        self.tasks: list[Task] = []
        self.polling = False

    def add(self, task: Task) -> None:
        self._advance(task)

    def poll(self) -> tuple[bool, float | None]:
        """Advance ready tasks. Returns (progressed, earliest timer among the waiting tasks)."""
        progressed, timer = False, None
        for task in list(self.tasks):
            if task.dead:
                self.tasks.remove(task)
                continue
            try:
                is_ready = ready(task.wait)
            except BaseException as e:  # an MPI error surfaces in the op's future
                self._finish(task, error=e)
                continue
            if is_ready:
                self._advance(task)
                progressed = True
            elif isinstance(task.wait, float):
                timer = task.wait if timer is None else min(timer, task.wait)
        # whether some task waits on requests or a condition (to be polled), not only on timers
        self.polling = any(not isinstance(t.wait, float) for t in self.tasks)
        return progressed, timer

    def _advance(self, task: Task) -> None:
        while True:
            try:
                task.wait = task.gen.send(None)
            except StopIteration as stop:
                self._finish(task, value=stop.value)
                return
            except BaseException as e:
                self._finish(task, error=e)
                return
            if not ready(task.wait):
                if task not in self.tasks:
                    self.tasks.append(task)
                return

    def _finish(self, task: Task, value=None, error=None) -> None:
        if task in self.tasks:
            self.tasks.remove(task)
        if task.dead:
            return
        if error is not None:
            task.on_error(error)
        else:
            task.on_done(value)



def run_all(ops, poll_s: float | None = 2e-5) -> list:
    """Drive several operations concurrently in this thread (as the engine would); their values."""
    results: list = [None] * len(ops)
    errors: list = []
    sched = Scheduler()
    fine_sleep()
    for i, op in enumerate(ops):
        sched.add(Task(op, lambda v, i=i: results.__setitem__(i, v), errors.append))
    while sched.tasks:
        progressed, timer = sched.poll()
        if not progressed and poll_s:
            if isinstance(timer, Deadline) and timer - time.perf_counter() <= poll_s:
                sleep_until(timer)
                continue
            dt = poll_s if timer is None else min(poll_s, max(0.0, timer - time.perf_counter()))
            time.sleep(dt)
    if errors:
        raise errors[0]
    return results


__all__ = ["MAX_SLEEP_S", "SPIN_S", "YIELD_S", "Deadline", "Op", "Scheduler", "Task", "local_ranks", "ready",
           "run", "run_all", "sleep_until", "spare_core", "wait_for"]
