"""Operations as generators, and the two ways of driving them.

Every communication operation of ratrain (a message, a ring all-reduce, ...) is written once as a
generator that posts non-blocking MPI calls and yields what it waits for:

    a list of MPI requests    resume when all have completed
    a float                   resume when `time.perf_counter()` reaches it (the link throttle)
    a callable                resume when it returns True

`run(gen)` drives one operation to completion in the calling thread (blocking collectives, tests,
the benchmark). `Scheduler` drives many at once, interleaved, without blocking in MPI: the
communication engine runs one in its thread, so collectives and pipeline messages progress
together and share the link.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

from mpi4py import MPI

from ratrain.shim.link import fine_sleep

Op = Generator[Any, None, Any]


def _sleep_until(t: float) -> None:
    dt = t - time.perf_counter()
    if dt > 0:
        time.sleep(dt)


def run(gen: Op, poll_s: float | None = None):
    """Drive one operation to completion in this thread; returns its value.

    Requests are waited for in MPI (which spins: lowest latency) unless `poll_s` is given; then
    they are tested every `poll_s` seconds with sleeps in between, leaving the core to other
    ranks (used with the link throttle, where ranks mostly wait for their wire slots).
    """
    if poll_s is not None:
        fine_sleep()
    try:
        wait = next(gen)
        while True:
            if isinstance(wait, list):
                if poll_s is not None:
                    while wait and not MPI.Request.Testall(wait):
                        time.sleep(poll_s)
                elif wait:
                    MPI.Request.Waitall(wait)
            elif isinstance(wait, float):
                _sleep_until(wait)
            elif wait is not None:
                while not wait():
                    time.sleep(1e-5)
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
            dt = poll_s if timer is None else min(poll_s, max(0.0, timer - time.perf_counter()))
            time.sleep(dt)
    if errors:
        raise errors[0]
    return results


__all__ = ["Op", "Scheduler", "Task", "ready", "run", "run_all"]
