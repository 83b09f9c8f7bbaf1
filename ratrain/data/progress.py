"""How ``prepare`` shows its progress: documents, MB read, MB/s, tokens and an ETA.

On a terminal a bar is redrawn in place a few times a second; elsewhere (a log, a pipe) a line
is printed every ``interval`` seconds. The ETA is the input bytes left over the rate so far
(compressed bytes for compressed inputs, which is what is read).

    p = Progress(total_bytes, out=sys.stderr)
    p.update(documents, bytes_read, tokens)    # cheap: draws only when it is time
    p.close()                                   # the last state, and a newline on a terminal
"""

from __future__ import annotations

import time

MB = 1e6


def _eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):  # nan, inf
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """A progress display for `total_bytes` of input on `out` (None: nothing is shown)."""

    def __init__(self, total_bytes: int, out=None, tty: bool | None = None,
                 interval: float = 10.0, width: int = 24, clock=time.monotonic):
        self.total, self.out, self.clock = max(1, int(total_bytes)), out, clock
        self.tty = bool(out is not None and (tty if tty is not None else
                                             getattr(out, "isatty", lambda: False)()))
        self.interval = 0.25 if self.tty else interval
        self.width = width
        self.t0 = self.last = clock()
        self.state = (0, 0, 0)

    def line(self) -> str:
        docs, read, tokens = self.state
        dt = max(self.clock() - self.t0, 1e-9)
        rate = read / dt
        frac = min(1.0, read / self.total)
        eta = (self.total - read) / rate if rate > 0 else float("inf")
        text = (f"{docs:,} documents | {read / MB:,.1f} / {self.total / MB:,.1f} MB read | "
                f"{rate / MB:.2f} MB/s | {tokens:,} tokens | ETA {_eta(eta)}")
        if not self.tty:
            return f"prepare: {100 * frac:5.1f}% | {text}"
        filled = int(frac * self.width)
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {100 * frac:5.1f}% {text}"

    def update(self, docs: int, read: int, tokens: int) -> None:
        self.state = (docs, read, tokens)
        if self.out is None:
            return
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self._draw()

    def _draw(self) -> None:
        if self.tty:
            self.out.write("\r" + self.line() + "\x1b[K")
        else:
            self.out.write(self.line() + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.out is None:
            return
        self._draw()
        if self.tty:
            self.out.write("\n")
            self.out.flush()

    def elapsed(self) -> float:
        return self.clock() - self.t0


__all__ = ["Progress"]
