"""The link model and throttle: what a message costs on the platform's links.

Model (LogGP-like): a message of n bytes costs `latency + n / bandwidth` on the link it crosses;
a link is one resource, so its concurrent sends share the bandwidth. Emulated times are platform
times x `time_scale`. Links come in two levels (`Levels`): a message to a rank of the same node
crosses the sender's own intra-node link; a message to another node crosses the node's network
interface, one link whose slots every rank of the node reserves from (`Link(shared=...)`: a
slot book that the ranks of a node share, e.g. in shared memory; `ratrain.comm` provides it),
so the node's ranks share the interface's bandwidth.

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


class Slots:
    """When a link is free, for the threads of one process: `reserve(earliest, duration)` books
    the next slot of `duration` seconds starting no sooner than `earliest` and returns its end.
    A node's ranks share their interface through an object with the same method that lives in
    shared memory (`ratrain.comm.shm.SharedSlots`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free_at = 0.0  # clock time at which the last reserved slot ends

    def reserve(self, earliest: float, duration: float) -> float:
        with self._lock:
            start = max(earliest, self._free_at)
            self._free_at = start + duration
            return self._free_at

    def free_at(self) -> float:
        return self._free_at


class Link:
    """One link: `bandwidth` B/s, `latency` s per message, scaled by `time_scale`; its slots
    are this process's own, or `shared` by the ranks of a node (their network interface)."""

    def __init__(
        self,
        bandwidth: float,
        latency: float = 0.0,
        time_scale: float = 1.0,
        chunk_bytes: int | None = None,
        clock=time.perf_counter,
        shared=None,
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
        self.slots = shared if shared is not None else Slots()
        self.bytes_sent = 0
        self.messages = 0

    @classmethod
    def from_profile(cls, profile, chunk_bytes: int | None = None, shared=None) -> Link | None:
        """The inter-node throttle of `profile` (its interface, `shared` by the node's ranks),
        or None when emulation is off or the link is not modelled."""
        if not profile.emulate or not profile.link_bandwidth:
            return None
        return cls(profile.link_bandwidth, profile.link_latency or 0.0, profile.time_scale,
                   chunk_bytes, shared=shared)

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
        now = self.clock()
        if after is None:
            earliest = (now if t0 is None else min(t0, now)) + self._lat
        else:
            earliest = after
        end = self.slots.reserve(earliest, nbytes * self._s_per_byte)
        with self._lock:
            self.bytes_sent += nbytes
            self.messages += after is None
        return end

    def idle(self) -> bool:
        return self.clock() >= self.slots.free_at()

    def __repr__(self) -> str:
        return (
            f"Link(bandwidth={self.bandwidth:.3g} B/s, latency={self.latency:.3g} s, "
            f"time_scale={self.time_scale:g}, chunk_bytes={self.chunk_bytes})"
        )


class Levels:
    """The links of one rank in two levels: `intra` (to ranks of the same node: the rank's own
    link) and `inter` (to other nodes: the node's interface, shared).

    Both levels cut messages into the same chunks (the inter level's), so that a receiver, which
    posts one receive per chunk, cuts a message as its sender did whichever level it crossed.
    `latency`, `bandwidth` and `time_scale` are the inter level's (what a cost model of the
    network asks)."""

    def __init__(self, intra: Link, inter: Link):
        if intra.chunk_bytes != inter.chunk_bytes:
            raise ValueError(f"the link levels cut messages differently: {intra} and {inter}")
        self.intra, self.inter = intra, inter
        self.latency, self.bandwidth = inter.latency, inter.bandwidth
        self.time_scale, self.chunk_bytes = inter.time_scale, inter.chunk_bytes

    def level(self, same_node: bool) -> Link:
        """The link a message crosses: intra when both ranks are on one node."""
        return self.intra if same_node else self.inter

    @classmethod
    def from_profile(cls, profile, shared=None) -> Levels | None:
        """The two link levels of `profile` (the interface's slots `shared` by the node's ranks), or
        None when emulation is off or the network is not modelled. Without an `intra_bandwidth`
        the intra level costs nothing (an infinitely fast link)."""
        inter = Link.from_profile(profile, shared=shared)
        if inter is None:
            return None
        intra = Link(profile.intra_bandwidth or math.inf, profile.intra_latency or 0.0,
                     profile.time_scale, inter.chunk_bytes)
        return cls(intra, inter)

    def __repr__(self) -> str:
        return f"Levels(intra={self.intra}, inter={self.inter})"


__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_CHUNK_BYTES", "Levels", "Link", "Slots", "auto_chunk_bytes",
           "fine_sleep"]
