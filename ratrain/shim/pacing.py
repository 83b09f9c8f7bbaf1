"""Compute pacing: pad each compute action to the platform's time for its flops (or its bytes).

With `platform.emulate` on and a `compute_flops` rate, a kernel of F flops that ran in t seconds
is padded with a sleep to `F / compute_flops x time_scale` (the same `time_scale` as the link
throttle), so a run with more ranks than cores keeps the platform's compute-to-communication
balance. Memory-bound lifecycle work (an AdamW update, the cast of a working view) is paced the
same way by the bytes it moves, at the profile's DDR bandwidth (the `ddr_bandwidth` fact of the
profile, or `ddr_bandwidth=`): `nbytes / ddr_bandwidth x time_scale`; without a DDR bandwidth
it runs at host speed. A kernel slower than its target is not padded; `overruns` counts those
(the host is then too slow for the chosen time_scale: raise it). Off (a no-op) unless emulating.

    pacer = Pacer(profile)
    with pacer.compute(flops):
        y = x @ w
    with pacer.memory(28 * n):        # AdamW over n parameters
        opt.update_block(...)

Accounting (for benchmarks: the 1F1B ideal is built from it): `compute_target_s` /
`memory_target_s` sum the emulated seconds asked for, `busy_s` the real time, `paced_s` the
padding added.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class Pacer:
    def __init__(self, profile=None, *, compute_flops: float | None = None, time_scale: float = 1.0,
                 enabled: bool | None = None, ddr_bandwidth: float | None = None,
                 sleep=time.sleep, clock=time.perf_counter):
        if profile is not None:
            compute_flops = profile.compute_flops
            time_scale = profile.time_scale
            enabled = profile.emulate if enabled is None else enabled
            if ddr_bandwidth is None:
                fact = getattr(profile, "facts", {}).get("ddr_bandwidth")
                ddr_bandwidth = float(fact.value) if fact is not None and fact.value else None
        self.compute_flops = compute_flops
        self.ddr_bandwidth = ddr_bandwidth
        self.time_scale = float(time_scale)
        self.enabled = bool(enabled) and bool(compute_flops)
        self._sleep, self._clock = sleep, clock
        self.paced_s = 0.0  # total padding added
        self.busy_s = 0.0  # total real compute time seen
        self.overruns = 0  # actions that took longer than their target
        self.compute_target_s = 0.0  # emulated seconds of compute asked for
        self.memory_target_s = 0.0  # emulated seconds of memory-bound work asked for

    def target(self, flops: float) -> float:
        """Emulated seconds for `flops` of work (0 when pacing is off)."""
        if not self.enabled:
            return 0.0
        return flops / self.compute_flops * self.time_scale

    def memory_target(self, nbytes: float) -> float:
        """Emulated seconds for moving `nbytes` through DDR (0 when off or not modelled)."""
        if not self.enabled or not self.ddr_bandwidth:
            return 0.0
        return nbytes / self.ddr_bandwidth * self.time_scale

    def _pad(self, target: float, elapsed: float) -> float:
        self.busy_s += elapsed
        pad = target - elapsed
        if pad <= 0:
            self.overruns += 1
            return 0.0
        self._sleep(pad)
        self.paced_s += pad
        return pad

    def pace(self, flops: float, elapsed: float) -> float:
        """Sleep so that an action of `flops` that took `elapsed` s lasts its target; returns the pad."""
        if not self.enabled:
            return 0.0
        target = self.target(flops)
        self.compute_target_s += target
        return self._pad(target, elapsed)

    def pace_memory(self, nbytes: float, elapsed: float) -> float:
        """As `pace`, for work that moves `nbytes` through DDR (no-op without a DDR bandwidth)."""
        if not self.enabled or not self.ddr_bandwidth:
            return 0.0
        target = self.memory_target(nbytes)
        self.memory_target_s += target
        return self._pad(target, elapsed)

    @contextmanager
    def compute(self, flops: float):
        t0 = self._clock()
        yield
        self.pace(flops, self._clock() - t0)

    @contextmanager
    def memory(self, nbytes: float):
        t0 = self._clock()
        yield
        self.pace_memory(nbytes, self._clock() - t0)


__all__ = ["Pacer"]
