"""Where a step's time goes, kernel by kernel: `python -m ratrain.bench --profile`.

The kernels and layer helpers carry `@timed("category")`; while a `Profile` is active each call
adds its wall time (and, for GEMMs, its flops) to its category. Times are summed over the
compute threads, so they are CPU seconds of the compute threads; a category called inside
another (a GEMM inside attention) counts only in the innermost. Off (one flag test per call)
unless a profile is active.

    with Profile() as prof:
        step()
    prof.table(sgemm_gflops_per_thread)

On a GPU the calls only queue work: `Profile(sync=...)` (the device's synchronize) waits for
the device before and after each call, so a category's time is its kernels' (serialised,
launch gaps included); the step's time under it against its time without says how much of a
step the host's launching hides or exposes. `Profile(counter=...)` (a function returning a
running count, such as the stand-in's device operations) also gives each category its share of
that count, nested calls subtracted as for the time.
"""

from __future__ import annotations

import functools
import threading
import time

_active: list = []  # the running Profile, if any
_local = threading.local()  # per thread: the stack of categories being timed


def timed(category: str):
    """Decorator: account the function's calls under `category` while a profile runs."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not _active:
                return fn(*args, **kwargs)
            return _active[0].call(category, fn, args, kwargs)

        return run

    return wrap


def add_flops(flops: float) -> None:
    """Credit `flops` to the innermost category being timed (GEMMs call this)."""
    if _active:
        stack = getattr(_local, "stack", None)
        if stack:
            _active[0].flops[stack[-1]] = _active[0].flops.get(stack[-1], 0.0) + flops


class Profile:
    def __init__(self, sync=None, counter=None):
        self.sync = sync  # called before and after each timed call (a device's synchronize)
        self.counter = counter  # a running count to share out by category (or None)
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def __enter__(self):
        if _active:
            raise RuntimeError("a profile is already running")
        _active.append(self)
        return self

    def __exit__(self, *exc):
        _active.clear()

    def call(self, category, fn, args, kwargs):
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        if self.sync is not None:
            self.sync()
        c0 = self.counter() if self.counter is not None else 0
        t0 = time.perf_counter()
        stack.append(category)
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()
            if self.sync is not None:
                self.sync()
            dt = time.perf_counter() - t0
            dc = self.counter() - c0 if self.counter is not None else 0
            with self._lock:
                self.seconds[category] = self.seconds.get(category, 0.0) + dt
                self.calls[category] = self.calls.get(category, 0) + 1
                self.counts[category] = self.counts.get(category, 0) + dc
                if stack:  # the caller's category does not count this time again
                    self.seconds[stack[-1]] = self.seconds.get(stack[-1], 0.0) - dt
                    self.counts[stack[-1]] = self.counts.get(stack[-1], 0) - dc

    def rows(self, gemm_rate: float | None = None) -> list[dict]:
        """One row per category, most time first: seconds, calls, the counter's share where a
        counter runs, GFLOP/s where flops were counted, and their fraction of `gemm_rate`
        (flop/s of one thread's sgemm)."""
        out = []
        for cat, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            row = {"category": cat, "seconds": round(s, 4), "calls": self.calls.get(cat, 0)}
            if self.counter is not None:
                row["count"] = self.counts.get(cat, 0)
            fl = self.flops.get(cat)
            if fl and s > 0:
                row["gflops"] = round(fl / s / 1e9, 1)
                if gemm_rate:
                    row["of_sgemm"] = round(fl / s / gemm_rate, 3)
            out.append(row)
        return out


__all__ = ["Profile", "add_flops", "timed"]
