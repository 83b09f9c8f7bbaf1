"""Compute pacing: pad each piece of work to the platform's time for it.

With `platform.emulate` on and a `compute_flops` rate, a kernel of F flops that ran in t seconds
is padded with a sleep to `F / compute_flops x time_scale` (the same `time_scale` as the link
throttle), so a run with more ranks than cores keeps the platform's compute-to-communication
balance. Memory-bound lifecycle work (an AdamW update, the cast of a working view) is paced the
same way by the bytes it moves, at the profile's DDR bandwidth (the `ddr_bandwidth` fact of the
profile, or `ddr_bandwidth=`): `nbytes / ddr_bandwidth x time_scale`; without a DDR bandwidth
it runs at host speed. Work slower than its target is not padded; `overruns` counts those
(the host is then too slow for the chosen time_scale: raise it). Off (a no-op) unless emulating.

    pacer = Pacer(profile)
    with pacer.compute(flops):        # resource "compute", amount in flops
        y = x @ w
    with pacer.memory(28 * n):        # resource "memory", amount in bytes (AdamW over n params)
        opt.update_block(...)

Accounting (for benchmarks: the 1F1B ideal is built from it): `target_s[resource]` sums the
emulated seconds asked for (`compute_target_s`, `memory_target_s`), `busy_s` the real time,
`paced_s` the padding added.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

RESOURCES = ("compute", "memory")


class Pacer:
    def __init__(self, profile=None, *, compute_flops: float | None = None, time_scale: float = 1.0,
                 enabled: bool | None = None, ddr_bandwidth: float | None = None,
                 sleep=time.sleep, clock=time.perf_counter):
        if profile is not None:
            compute_flops = profile.compute_flops
            time_scale = profile.time_scale
            enabled = profile.emulate if enabled is None else enabled
            if ddr_bandwidth is None:
                fact = profile.fact("ddr_bandwidth")
                ddr_bandwidth = float(fact.value) if fact is not None and fact.value else None
        # the rate of each resource: flop/s of compute, bytes/s of DDR (None: not paced)
        self.rates = {"compute": compute_flops, "memory": ddr_bandwidth}
        self.time_scale = float(time_scale)
        self.enabled = bool(enabled) and bool(compute_flops)
        self._sleep, self._clock = sleep, clock
        self.paced_s = 0.0  # total padding added
        self.busy_s = 0.0  # total real time of paced work
        self.overruns = 0  # pieces of work that took longer than their target
        self.target_s = dict.fromkeys(RESOURCES, 0.0)  # emulated seconds asked for

    @property
    def compute_flops(self) -> float | None:
        return self.rates["compute"]

    @property
    def ddr_bandwidth(self) -> float | None:
        return self.rates["memory"]

    @property
    def compute_target_s(self) -> float:
        return self.target_s["compute"]

    @property
    def memory_target_s(self) -> float:
        return self.target_s["memory"]

    def target(self, amount: float, resource: str = "compute") -> float:
        """Emulated seconds for `amount` of `resource` (flops, or bytes through DDR); 0 when
        pacing is off or the resource has no rate."""
        rate = self.rates[resource]
        if not self.enabled or not rate:
            return 0.0
        return amount / rate * self.time_scale

    def pace(self, amount: float, elapsed: float, resource: str = "compute") -> float:
        """Sleep so that work of `amount` that took `elapsed` s lasts its target; returns the
        pad (0 when off, or when the work overran its target)."""
        if not self.enabled or not self.rates[resource]:
            return 0.0
        target = self.target(amount, resource)
        self.target_s[resource] += target
        self.busy_s += elapsed
        pad = target - elapsed
        if pad <= 0:
            self.overruns += 1
            return 0.0
        self._sleep(pad)
        self.paced_s += pad
        return pad

    @contextmanager
    def span(self, resource: str, amount: float):
        """Time the block and pad it to `amount` of `resource`."""
        t0 = self._clock()
        yield
        self.pace(amount, self._clock() - t0, resource)

    def compute(self, flops: float):
        return self.span("compute", flops)

    def memory(self, nbytes: float):
        return self.span("memory", nbytes)


__all__ = ["RESOURCES", "Pacer"]
