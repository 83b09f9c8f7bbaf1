"""The DDR ledger: the one accounting point for every buffer a rank holds.

Long-lived buffers are allocated through `alloc` (the ledger creates the array) and released
with `free`; arrays created by kernels and kept (activation caches) are registered with
`track` and released with `release`. Each entry has a tag such as `params.master`,
`grads.layers.3` or `activations.mb3.layers.5`. The ledger keeps current and peak bytes, per
tag too, and refuses to go over its cap with `DDRCapExceeded`, naming the rank, the tag, the
bytes asked for, the bytes in use, the cap and the largest users.

Thread-safe: the compute threads and the communication engine may allocate concurrently.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np


class DDRCapExceeded(MemoryError):
    """An allocation would take the rank over its DDR cap."""


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


class Ledger:
    """Tracks every byte a rank holds against `cap` (None = unlimited)."""

    def __init__(self, cap: int | None = None, rank: int = 0):
        self.cap = cap
        self.rank = rank
        self._lock = threading.Lock()
        self._by_tag: dict[str, int] = defaultdict(int)
        self._peak_by_tag: dict[str, int] = defaultdict(int)
        self._tracked: dict[int, tuple[str, int]] = {}  # id(array) -> (tag, bytes)
        self.current = 0
        self.peak = 0

    # -- core accounting ------------------------------------------------------------------------

    def reserve(self, tag: str, nbytes: int) -> None:
        """Account `nbytes` under `tag`; raise DDRCapExceeded (and account nothing) over the cap."""
        nbytes = int(nbytes)
        with self._lock:
            if self.cap is not None and self.current + nbytes > self.cap:
                raise DDRCapExceeded(self._over_cap_message(tag, nbytes))
            self.current += nbytes
            self._by_tag[tag] += nbytes
            self.peak = max(self.peak, self.current)
            self._peak_by_tag[tag] = max(self._peak_by_tag[tag], self._by_tag[tag])

    def unreserve(self, tag: str, nbytes: int) -> None:
        nbytes = int(nbytes)
        with self._lock:
            have = self._by_tag.get(tag, 0)
            if nbytes > have:
                raise ValueError(
                    f"rank {self.rank}: ledger free of {nbytes} B under tag {tag!r} which holds "
                    f"only {have} B (double free?)"
                )
            self._by_tag[tag] = have - nbytes
            if self._by_tag[tag] == 0:
                del self._by_tag[tag]
            self.current -= nbytes

    # -- arrays ---------------------------------------------------------------------------------

    def alloc(self, tag: str, shape, dtype, xp=np, zero: bool = True):
        """A new array of `shape`/`dtype` from `xp`, accounted under `tag`."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.reserve(tag, nbytes)
        try:
            arr = xp.zeros(shape, dtype) if zero else xp.empty(shape, dtype)
        except BaseException:
            self.unreserve(tag, nbytes)
            raise
        with self._lock:
            self._tracked[id(arr)] = (tag, nbytes)
        return arr

    def track(self, tag: str, *arrays) -> int:
        """Account arrays made elsewhere (kept caches). Views of tracked arrays count nothing."""
        total = 0
        for a in arrays:
            if a is None or id(a) in self._tracked:
                continue
            if getattr(a, "base", None) is not None and id(a.base) in self._tracked:
                continue
            nbytes = int(a.nbytes)
            self.reserve(tag, nbytes)
            with self._lock:
                self._tracked[id(a)] = (tag, nbytes)
            total += nbytes
        return total

    def free(self, *arrays) -> None:
        """Release arrays that came from `alloc` or `track`."""
        for a in arrays:
            if a is None:
                continue
            with self._lock:
                entry = self._tracked.pop(id(a), None)
            if entry is not None:
                self.unreserve(*entry)

    release = free

    def free_tag(self, tag: str) -> int:
        """Release every array under `tag`; returns the bytes released."""
        with self._lock:
            ids = [k for k, (t, _) in self._tracked.items() if t == tag]
            entries = [self._tracked.pop(k) for k in ids]
        for t, n in entries:
            self.unreserve(t, n)
        return sum(n for _, n in entries)

    # -- reports --------------------------------------------------------------------------------

    def in_use(self, tag: str | None = None, prefix: str | None = None) -> int:
        with self._lock:
            if tag is not None:
                return self._by_tag.get(tag, 0)
            if prefix is not None:
                return sum(v for k, v in self._by_tag.items() if k.startswith(prefix))
            return self.current

    def by_tag(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_tag)

    def peak_by_tag(self) -> dict[str, int]:
        with self._lock:
            return dict(self._peak_by_tag)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current
            self._peak_by_tag = defaultdict(int, self._by_tag)

    def largest(self, n: int = 5) -> list[tuple[str, int]]:
        with self._lock:
            return sorted(self._by_tag.items(), key=lambda kv: -kv[1])[:n]

    def _over_cap_message(self, tag: str, nbytes: int) -> str:
        top = sorted(self._by_tag.items(), key=lambda kv: -kv[1])[:5]
        users = ", ".join(f"{t}={_fmt(b)}" for t, b in top) or "none"
        return (
            f"rank {self.rank}: DDR cap exceeded allocating {_fmt(nbytes)} ({nbytes} B) for "
            f"{tag!r}: in use {_fmt(self.current)} ({self.current} B), cap {_fmt(self.cap)} "
            f"({self.cap} B); largest users: {users}. Lower the micro-batch, raise "
            "schedule.recompute, add pipeline stages, or raise platform.ddr_bytes."
        )


__all__ = ["DDRCapExceeded", "Ledger"]
