"""The host allocator: keep freed memory in the process instead of returning it to the kernel.

A compute cluster's DDR is a fixed pool: a buffer freed and allocated again costs nothing. A
Linux process behaves differently by default: glibc's malloc serves every block above its
mmap threshold (128 KiB, rising to at most 32 MiB as blocks are freed) with a fresh `mmap`
and returns it with `munmap` on free, and trims the heap top beyond 128 KiB. The next array
of that size then takes one page fault per 4 KiB page on first touch. A training step
allocates and frees hundreds of MiB of activations, gradients and temporaries, so on this
class of machine (a KVM guest, where a minor fault costs several microseconds) a step of
issue 2's benchmark model took about 64,000 page faults and spent about 10% of its time in
them.

`tune()` makes the process behave like the cluster's pool: blocks up to `MMAP_THRESHOLD` come
from the heap (`M_MMAP_THRESHOLD`), freed memory is not trimmed (`M_TRIM_THRESHOLD`), and the
heap grows in `TOP_PAD` steps (`M_TOP_PAD`). The resident set then stays at the step's peak
instead of falling back between steps; the peak itself does not change (measured: VmHWM
845 vs 849 MiB on that benchmark), and the DDR ledger still accounts and caps every buffer.

It is glibc-only (a no-op elsewhere: other allocators, macOS) and process-wide; `run.malloc:
default` (or RATRAIN_MALLOC=default) leaves the allocator alone.

`resident_bytes()` is the process's whole memory as the host sees it (its resident set:
imports, compiled kernels, the interpreter's heap and every buffer, the ledger's and the
rest), which the trainer reports beside the ledger's peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 1 << 30  # blocks above 1 GiB (whole flat buffers of a large stage) still mmap
TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt takes: in effect, never trim
TOP_PAD = 64 << 20  # grow the heap 64 MiB at a time

_state = {"tuned": None}


def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None
    except OSError:
        return None


def tune(mode: str = "tuned") -> bool:
    """Apply the settings above once per process (later calls return the first answer) unless
    `mode` (`run.malloc`) is `default`. Returns True when glibc accepted all three, False when
    skipped (not glibc, or `default`)."""
    if _state["tuned"] is not None:
        return _state["tuned"]
    ok = False
    if mode != "default":
        libc = _libc()
        if libc is not None:
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            # older glibc refuses thresholds above 32 MiB (HEAP_MAX_SIZE / 2): fall back
            mmap_ok = any(libc.mallopt(M_MMAP_THRESHOLD, v) == 1
                          for v in (MMAP_THRESHOLD, 32 << 20))
            ok = mmap_ok and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 \
                and libc.mallopt(M_TOP_PAD, TOP_PAD) == 1
    _state["tuned"] = ok
    return ok


def tuned() -> bool | None:
    """What `tune()` answered in this process (None: not called)."""
    return _state["tuned"]


def resident_bytes() -> int:
    """This process's resident set size in bytes now (Linux: /proc/self/statm); elsewhere its
    peak so far (getrusage), or 0 when neither is known."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes there, KiB elsewhere
    except (ImportError, OSError):
        return 0


__all__ = ["resident_bytes", "tune", "tuned"]
