"""One rank's files in the memory tier: memory-mapped, accounted, written and read in a thread.

    store = TierStore(directory, rank, ledger, link)  # ledger: a TierLedger; link: the throttle
    buf = store.region("act", ("layers.3", 2), nbytes)      # an extent of a file, as uint8
    fut = store.copy([(buf[a:b], src_bytes)], label=...)     # in the tier's thread, throttled
    store.free(("layers.3", 2)); store.close()

Files: one per kind (`act`: activations in flight, `state`: optimizer state), named
`rank<R>.<kind>` in `directory`, created exclusively without following a link (`fileio`),
preallocated (`posix_fallocate`: a full disk is an error when the room is asked for, never a
SIGBUS when a page is first written) and unlinked at once, so nothing is ever left behind: the
space goes back when the process ends, however it ends. A kind's file grows (a new mapping of
the same file) when its extents do not fit. Each extent is accounted in the `TierLedger` (its
cap: the rank's share of the node's tier) under its key.

Transfers run one at a time in the store's thread, chunk by chunk, each chunk booked on the
tier's `Link` (its slots shared by the node's ranks: fair sharing, as the interface) and handed
on when its slot ends, so an emulated run feels the tier's bandwidth; without a link at host
speed. A failed transfer's future holds a `TierError` naming the path and the key.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading
import time
from concurrent.futures import Future

import numpy as np

from ratrain.fileio import open_no_follow
from ratrain.shim.tier import TierFull

ALIGN = 4096  # extents start on pages


class TierError(OSError):
    """The tier's storage failed (full, missing, unwritable); the message is one line (the
    cause's errno in `errno`)."""

    @classmethod
    def of(cls, path: str, key: str, e: OSError) -> TierError:
        err = cls(tier_problem(path, key, e))
        err.errno = e.errno
        return err


def tier_problem(path: str, key: str, e: OSError) -> str:
    """One line: what failed at the tier's `path`, why, and the key that moves it."""
    why = e.strerror or str(e)
    return (f"the memory tier at {key}={path} failed ({why}): free space or fix the "
            f"permissions there, or set {key} to another directory (or offload less)")


class _File:
    def __init__(self, path: str):
        self.path = path
        self.fd = open_no_follow(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        os.unlink(path)  # scratch: gone with the process, whatever happens
        self.size = 0
        self.maps: list[mmap.mmap] = []
        self.view = np.zeros(0, np.uint8)

    def grow(self, size: int) -> None:
        size = -(-size // ALIGN) * ALIGN
        if size <= self.size:
            return
        os.posix_fallocate(self.fd, self.size, size - self.size)
        mm = mmap.mmap(self.fd, size)
        self.maps.append(mm)  # earlier mappings stay alive for views still in use
        self.view = np.frombuffer(mm, np.uint8)
        self.size = size

    def close(self) -> None:
        self.view = np.zeros(0, np.uint8)
        for mm in self.maps:
            with contextlib.suppress(BufferError):  # a view still exported: it goes with it
                mm.close()
        os.close(self.fd)


class TierStore:
    """One rank's extents in the tier (see the module)."""

    def __init__(self, directory: str, rank: int, ledger, link=None, key: str = "offload.path",
                 sleep=time.sleep, clock=time.perf_counter, made: bool = False):
        self.directory, self.rank, self.ledger, self.link, self.key = directory, rank, ledger, link, key
        self.made = made  # the directory was made for the tier: removed at close when empty
        self._sleep, self._clock = sleep, clock
        self.files: dict[str, _File] = {}
        self.free_list: dict[str, list[tuple[int, int]]] = {}  # kind -> [(offset, size)]
        self.extents: dict[object, tuple[str, int, int]] = {}  # key -> (kind, offset, size)
        self.bytes_moved = 0
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"tier-{rank}", daemon=True)
        self._thread.start()

    def _fail(self, e: OSError) -> TierError:
        return TierError.of(self.directory, self.key, e)

    # -- space ----------------------------------------------------------------------------

    def prepare(self, kind: str, nbytes: int) -> None:
        """Make (or grow) the file of `kind` to hold `nbytes` (a TierError when the storage
        cannot: missing, unwritable, full)."""
        try:
            f = self.files.get(kind)
            if f is None:
                f = self.files[kind] = _File(os.path.join(self.directory, f"rank{self.rank}.{kind}"))
                self.free_list[kind] = []
            old = f.size
            f.grow(max(int(nbytes), ALIGN))
            if f.size > old:
                self._release(kind, old, f.size - old)
        except TierError:
            raise
        except OSError as e:
            raise self._fail(e) from None

    def region(self, kind: str, key, nbytes: int) -> np.ndarray:
        """An extent of `nbytes` for `key` in the file of `kind` (grown when needed), accounted
        in the ledger; its bytes as a uint8 array."""
        if key in self.extents:
            raise RuntimeError(f"tier extent {key!r} is held already")
        size = -(-max(int(nbytes), 1) // ALIGN) * ALIGN
        self.ledger.reserve(f"tier.{kind}", size)  # TierFull over the rank's share
        try:
            off = self._take(kind, size)
        except BaseException:
            self.ledger.unreserve(f"tier.{kind}", size)
            raise
        self.extents[key] = (kind, off, size)
        return self.files[kind].view[off:off + int(nbytes)]

    def view(self, key, nbytes: int | None = None) -> np.ndarray:
        """The bytes of a held extent (its first `nbytes`)."""
        kind, off, size = self.extents[key]
        return self.files[kind].view[off:off + (size if nbytes is None else nbytes)]

    def free(self, key) -> None:
        kind, off, size = self.extents.pop(key)
        self.ledger.unreserve(f"tier.{kind}", size)
        self._release(kind, off, size)

    def _take(self, kind: str, size: int) -> int:
        if kind not in self.files:
            self.prepare(kind, size)
        for i, (off, n) in enumerate(self.free_list[kind]):  # first fit
            if n >= size:
                self.free_list[kind][i:i + 1] = [(off + size, n - size)] if n > size else []
                return off
        f = self.files[kind]
        tail = self.free_list[kind][-1] if self.free_list[kind] else None
        have = tail[1] if tail is not None and tail[0] + tail[1] == f.size else 0
        self.prepare(kind, max(f.size + size - have, 2 * f.size))
        return self._take(kind, size)

    def _release(self, kind: str, off: int, size: int) -> None:
        free = sorted(self.free_list[kind] + [(off, size)])
        out: list[tuple[int, int]] = []
        for o, n in free:  # coalesce neighbours
            if out and out[-1][0] + out[-1][1] == o:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((o, n))
        self.free_list[kind] = out

    # -- transfers ------------------------------------------------------------------------

    def copy(self, pairs, before=None, after=None) -> Future:
        """Copy each (destination, source) pair of equal-sized byte arrays in the store's
        thread (`before()` first, `after()` last, there too: a device's download / upload),
        throttled by the link; a future of the seconds it took (a TierError on failure)."""
        fut: Future = Future()
        self._q.put((list(pairs), before, after, fut))
        return fut

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            pairs, before, after, fut = job
            t0 = self._clock()
            try:
                if before is not None:
                    pairs = before() or pairs
                self._move(pairs)
                if after is not None:
                    after()
            except OSError as e:
                fut.set_exception(e if isinstance(e, (TierError, TierFull)) else self._fail(e))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                fut.set_exception(e)
            else:
                fut.set_result(self._clock() - t0)

    def _move(self, pairs) -> None:
        link = self.link
        chunk = link.chunk_bytes if link is not None else 1 << 26
        release = None
        t_post = self._clock()
        for dst, src in pairs:
            n = int(src.nbytes)
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                if link is not None:
                    release = link.reserve(hi - lo, after=release, t0=t_post)
                dst[lo:hi] = src[lo:hi]
                if release is not None:
                    wait = release - self._clock()
                    if wait > 0:
                        self._sleep(wait)
            self.bytes_moved += n

    def close(self) -> None:
        """End the thread, unmap and close the files (they are unlinked already)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        for f in self.files.values():
            f.close()
        self.files.clear()
        if self.made:
            with contextlib.suppress(OSError):  # another rank's files may still be open
                os.rmdir(self.directory)


__all__ = ["ALIGN", "TierError", "TierStore", "tier_problem"]
