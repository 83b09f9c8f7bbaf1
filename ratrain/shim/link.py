"""The link model and throttle: what a message costs on the platform's links.

Model (LogGP-like, per rank): a message of n bytes costs `latency + n / bandwidth`; the rank's
outgoing link is one resource, so its concurrent sends share the bandwidth. Emulated times are
platform times x `time_scale`.

The throttle is a virtual clock of the rank's outgoing link. A message is cut into chunks of
`chunk_bytes`; each chunk reserves the next free slot of `chunk / bandwidth` seconds and is
handed to MPI when its slot ends (the bytes have "crossed the wire"). Concurrent messages
reserve one chunk at a time, so their chunks interleave round-robin: fair sharing. The first
chunk of a message cannot start before `now + latency`, but it may start while an earlier
message still occupies the link, so back-to-back messages pay the latency once (streaming
bandwidth == the configured bandwidth; an isolated message == latency + n / bandwidth).
Slot times are absolute, so a late wake-up of the sender delays one chunk, never the ones after.

Here no MPI is done: `ratrain.comm` asks `reserve` for each chunk's release time and sleeps (or
lets its engine wait) until then. The link is thread-safe.
"""

from __future__ import annotations

import math
import threading
import time

DEFAULT_CHUNK_BYTES = 256 * 1024  # the smallest automatic chunk
MAX_CHUNK_BYTES = 1 << 20  # the largest automatic chunk
CHUNK_SLOT_S = 1e-3  # automatic chunks: about this much emulated wire time each


def auto_chunk_bytes(bandwidth: float, time_scale: float = 1.0) -> int:
    """The chunk a link uses unless told: about `CHUNK_SLOT_S` of emulated wire time, the
    nearest power of two (so that power-of-two messages are whole chunks) between 256 KiB and
    1 MiB. Each chunk costs the host a wake-up, an MPI message and Python work, so fast links
    get the larger chunks (measured at 1 GB/s: 1 MiB chunks cut the communication engine's CPU
    per 64 MiB all-reduce from ~53 to ~40 ms); slow links keep 256 KiB so that a short message
    never waits long behind another message's chunk (fair sharing)."""
    c = 1 << max(0, round(math.log2(max(1.0, bandwidth / time_scale * CHUNK_SLOT_S))))
    return max(DEFAULT_CHUNK_BYTES, min(MAX_CHUNK_BYTES, c))

_fine = threading.local()


def fine_sleep() -> None:
    """Make this thread's short sleeps precise: Linux extends every sleep by the thread's timer
    slack (50 us by default), which would add to each emulated message. Once per thread."""
    if getattr(_fine, "done", False):
        return
    _fine.done = True
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK = 29: 1 us
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


class Link:
    """The outgoing link of one rank: `bandwidth` B/s, `latency` s per message, scaled by `time_scale`."""

    def __init__(
        self,
        bandwidth: float,
        latency: float = 0.0,
        time_scale: float = 1.0,
        chunk_bytes: int | None = None,
        clock=time.perf_counter,
    ):
        if not bandwidth or bandwidth <= 0:
            raise ValueError(f"link bandwidth must be > 0 B/s, got {bandwidth!r}")
        if latency < 0 or time_scale <= 0:
            raise ValueError(f"link latency must be >= 0 and time_scale > 0 ({latency}, {time_scale})")
        if chunk_bytes is None:
            chunk_bytes = auto_chunk_bytes(bandwidth, time_scale)
        if chunk_bytes < 8 or chunk_bytes % 8:
            raise ValueError(f"chunk_bytes must be a positive multiple of 8, got {chunk_bytes}")
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self.time_scale = float(time_scale)
        self.chunk_bytes = int(chunk_bytes)
        self.clock = clock
        self._s_per_byte = self.time_scale / self.bandwidth
        self._lat = self.latency * self.time_scale
        self._lock = threading.Lock()
        self._free_at = 0.0  # clock time at which the link's last reserved slot ends
        self.bytes_sent = 0
        self.messages = 0

    @classmethod
    def from_profile(cls, profile, chunk_bytes: int | None = None) -> Link | None:
        """The throttle for `profile`, or None when emulation is off or the link is not modelled."""
        if not profile.emulate or not profile.link_bandwidth:
            return None
        return cls(profile.link_bandwidth, profile.link_latency or 0.0, profile.time_scale, chunk_bytes)

    # -- the model ------------------------------------------------------------------------------

    def message_time(self, nbytes: int) -> float:
        """Emulated time of one isolated message: (latency + n / bandwidth) x time_scale."""
        return self._lat + nbytes * self._s_per_byte

    def transfer_time(self, nbytes: int) -> float:
        """Emulated wire time of `nbytes` (no latency), x time_scale."""
        return nbytes * self._s_per_byte

    def chunks(self, nbytes: int) -> list[tuple[int, int]]:
        """Byte ranges [lo, hi) a message of `nbytes` is cut into (one empty chunk for 0 bytes)."""
        c = self.chunk_bytes
        return [(lo, min(lo + c, nbytes)) for lo in range(0, nbytes, c)] or [(0, 0)]

    # -- the throttle ---------------------------------------------------------------------------

    def reserve(self, nbytes: int, after: float | None = None, t0: float | None = None) -> float:
        """Reserve the link for one chunk; returns the clock time at which it may be handed to MPI.

        `after=None` marks a message's first chunk, which pays the latency from `t0` (when the
        send was posted; default now); otherwise pass the previous chunk's release time.
        """
        with self._lock:
            now = self.clock()
            if after is None:
                earliest = (now if t0 is None else min(t0, now)) + self._lat
            else:
                earliest = after
            start = max(earliest, self._free_at)
            end = start + nbytes * self._s_per_byte
            self._free_at = end
            self.bytes_sent += nbytes
            self.messages += after is None
            return end

    def idle(self) -> bool:
        return self.clock() >= self._free_at

    def __repr__(self) -> str:
        return (
            f"Link(bandwidth={self.bandwidth:.3g} B/s, latency={self.latency:.3g} s, "
            f"time_scale={self.time_scale:g}, chunk_bytes={self.chunk_bytes})"
        )


__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_CHUNK_BYTES", "Link", "auto_chunk_bytes", "fine_sleep"]
