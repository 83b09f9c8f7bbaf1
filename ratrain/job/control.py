"""The control plane: small pickled exchanges between steps that never block inside MPI.

    ctl = Control(MPI.COMM_WORLD, watchdog)       # collective (duplicates the communicator)
    verdicts = ctl.allgather(err)                 # start-up agreement
    reports = ctl.gather(mine, root=0)            # checkpoint commit
    ctl.bcast(result, root=0); ctl.barrier(); ctl.send(obj, 1, tag); ctl.recv(0, tag)

mpi4py-like (`Get_rank`, `Get_size`, lower-case pickled calls), so the checkpoint and data
code, which take "an mpi4py-like comm", take it as is. Each call posts non-blocking sends and
probes for the messages it waits for, sleeping between tests (from 50 us up to 20 ms), so a
rank waiting for a slow peer (one writing its checkpoint shard) leaves its core to the others
instead of spinning in MPI, and never waits where the job's watchdog cannot end it: a peer that
stops answering is named by the watchdog (`comm.watchdog`), which ends the job on every rank.
A wait longer than the watchdog's timeout prints one line naming the ranks waited for (they
answer heartbeats, so they are busy, not stopped).

Collectives are linear (root to each rank and back): these exchanges carry a few kilobytes
between steps, at start-up and at checkpoints, never the training traffic.
"""

from __future__ import annotations

import sys
import time

from mpi4py import MPI

from ratrain.job import faults
from ratrain.job.watchdog import Watchdog

TAG_COLL = 31  # gather / bcast (point-to-point tags of callers are their own)


class Control:
    """Pickled exchanges on a duplicate of `comm` (see the module)."""

    def __init__(self, comm, watchdog=None, *, out=None):
        self.comm = comm.Dup()  # collective
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.watchdog = watchdog
        self.out = out or sys.stderr

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    @classmethod
    def for_job(cls, comm, timeout_s: float) -> Control:
        """The control plane of a job, with its watchdog (`comm.watchdog`) when there is more
        than one rank and `timeout_s` > 0. Collective; `close()` it at the end, on every rank."""
        dog = Watchdog(comm, timeout_s) if comm.Get_size() > 1 and timeout_s else None
        return cls(comm, dog)

    def close(self) -> None:
        """Collective: the watchdog says goodbye, then the communicator is freed."""
        if self.watchdog is not None:
            self.watchdog.close()
        self.comm.Free()

    # -- waiting -----------------------------------------------------------------------------

    def _wait(self, done, what: str, peers) -> None:
        """Poll `done()` until it is True, sleeping between tests; say once if it takes long."""
        sleep, t0, said = 5e-5, time.monotonic(), False
        limit = self.watchdog.timeout if self.watchdog is not None else None
        while not done():
            faults.check()  # elastic: a lost peer ends the wait (a no-op off)
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.02)
            if limit and not said and time.monotonic() - t0 > limit:
                if self.watchdog.silent(peers()):
                    continue  # a silent rank: the watchdog names it and ends the job
                said = True
                waiting = ", ".join(str(p) for p in peers()) or "?"
                self.out.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] warning: waiting "
                               f"{time.monotonic() - t0:.0f} s in {what} for rank(s) {waiting} "
                               "(they answer the watchdog: busy, not stopped)\n")
                self.out.flush()

    def _send_all(self, obj, dests, tag: int, what: str) -> None:
        reqs = [self.comm.isend(obj, d, tag) for d in dests]
        self._wait(lambda: MPI.Request.Testall(reqs), what, lambda: list(dests))

    def _recv_from(self, sources, tag: int, what: str) -> dict:
        got: dict = {}

        def poll() -> bool:
            for s in sources:
                if s not in got:
                    msg = self.comm.improbe(s, tag)
                    if msg is not None:
                        got[s] = msg.recv()
            return len(got) == len(sources)

        self._wait(poll, what, lambda: [s for s in sources if s not in got])
        return got

    # -- mpi4py-like calls -------------------------------------------------------------------

    def send(self, obj, dest: int, tag: int = 0) -> None:
        self._send_all(obj, [dest], tag, f"a send to rank {dest}")

    def recv(self, source: int, tag: int = 0):
        return self._recv_from([source], tag, f"a receive from rank {source}")[source]

    def gather(self, obj, root: int = 0):
        if self.rank != root:
            self._send_all(obj, [root], TAG_COLL, "a gather")
            return None
        got = self._recv_from([r for r in range(self.size) if r != root], TAG_COLL, "a gather")
        got[root] = obj
        return [got[r] for r in range(self.size)]

    def bcast(self, obj, root: int = 0):
        if self.rank == root:
            self._send_all(obj, [r for r in range(self.size) if r != root], TAG_COLL, "a bcast")
            return obj
        return self._recv_from([root], TAG_COLL, "a bcast")[root]

    def allgather(self, obj) -> list:
        return self.bcast(self.gather(obj, 0), 0)

    def barrier(self) -> None:
        self.allgather(None)

    Barrier = barrier  # mpi4py's spelling


__all__ = ["Control"]
