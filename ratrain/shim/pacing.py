"""Compute pacing: pad each compute action to the platform's time for its flops.

With `platform.emulate` on and a `compute_flops` rate, a kernel of F flops that ran in t seconds
is padded with a sleep to `F / compute_flops x time_scale` (the same `time_scale` as the link
throttle), so a run with more ranks than cores keeps the platform's compute-to-communication
balance. A kernel slower than its target is not padded; `overruns` counts those (the host is
then too slow for the chosen time_scale: raise it). Off (a no-op) unless emulating.

    pacer = Pacer(profile)
    with pacer.compute(flops):
        y = x @ w
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class Pacer:
    def __init__(self, profile=None, *, compute_flops: float | None = None, time_scale: float = 1.0,
                 enabled: bool | None = None, sleep=time.sleep, clock=time.perf_counter):
        if profile is not None:
            compute_flops = profile.compute_flops
            time_scale = profile.time_scale
            enabled = profile.emulate if enabled is None else enabled
        self.compute_flops = compute_flops
        self.time_scale = float(time_scale)
        self.enabled = bool(enabled) and bool(compute_flops)
        self._sleep, self._clock = sleep, clock
        self.paced_s = 0.0  # total padding added
        self.busy_s = 0.0  # total real compute time seen
        self.overruns = 0  # actions that took longer than their target

    def target(self, flops: float) -> float:
        """Emulated seconds for `flops` of work (0 when pacing is off)."""
        if not self.enabled:
            return 0.0
        return flops / self.compute_flops * self.time_scale

    def pace(self, flops: float, elapsed: float) -> float:
        """Sleep so that an action of `flops` that took `elapsed` s lasts its target; returns the pad."""
        if not self.enabled:
            return 0.0
        self.busy_s += elapsed
        pad = self.target(flops) - elapsed
        if pad <= 0:
            self.overruns += 1
            return 0.0
        self._sleep(pad)
        self.paced_s += pad
        return pad

    @contextmanager
    def compute(self, flops: float):
        t0 = self._clock()
        yield
        self.pace(flops, self._clock() - t0)


__all__ = ["Pacer"]
