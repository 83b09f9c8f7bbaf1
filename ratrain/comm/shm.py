"""Shared memory between the ranks of one node: MPI shared-memory windows.

`Staging` is the staging area of the hierarchical collectives (`hier`) for the members of one
run (ranks of one node, consecutive in their communicator): per member `depth` slots of `lanes`
chunks of `chunk_bytes` (each member's input, round by round), one set of output slots, and four
rows of round counters through which the members hand rounds to each other without barriers:

    filled[i]    rounds member i has copied into its slots         (written by member i)
    consumed[c]  rounds lane c has read out of every member's slots (written by lane c's member)
    ready[c]     rounds whose lane-c chunk is complete in the output (written by lane c's member)
    read[i]      rounds member i has copied out of the output       (written by member i)

Counters only grow, over the life of the window: a collective takes the next rounds
(`take(k)`, the same on every member because collectives on one group run in the same order),
and round g uses slot g mod depth, which may be written once every lane (input) or every member
(output) has finished round g - depth. A write of data, `fence()` (MPI_Win_sync, a memory
barrier), then the counter; a reader checks the counter, then `fence()`, then reads.

`SharedSlots` is the slot book of a node's network interface under the link throttle: one
int64 (the clock time at which the interface is next free, in ns) in a window of the node's
ranks, advanced by compare-and-swap, so the ranks of a node share the interface's bandwidth
(`ratrain.shim.link.Link(shared=...)`).

`LocalStaging` is the same interface for a run of one member: private arrays, no window.

`SharedBuffers` are plain buffers in a window of a node's ranks, one per rank, each rank able to
read and write every other's: a collective's caller may keep its data there, and the
hierarchical all-reduce of a one-node group then works on them in place (`hier`).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

ALIGN = 64


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class LocalStaging:
    """The staging of a run of one member (no other rank to share with): private arrays."""

    def __init__(self, lanes: int, chunk_bytes: int, depth: int):
        self.members, self.lanes, self.depth = 1, lanes, depth
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = depth * lanes * chunk_bytes
        self._mem = [np.zeros(self.slot_bytes, np.uint8)]
        self._out = np.zeros(self.slot_bytes, np.uint8)
        self._counts = np.zeros(2 + 2 * lanes, np.int64)
        self._split_counts()
        self.rounds = 0

    def _split_counts(self) -> None:
        L, C = self.members, self.lanes
        c = self._counts
        self.filled, self.read = c[:L], c[L : 2 * L]
        self.consumed, self.ready = c[2 * L : 2 * L + C], c[2 * L + C : 2 * L + 2 * C]

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for the staging (its slots, and the output's share)."""
        return self.slot_bytes + self.slot_bytes // self.members

    def take(self, rounds: int) -> int:
        """The first of the next `rounds` rounds, for one collective."""
        base = self.rounds
        self.rounds += rounds
        return base

    def slot(self, member: int, g: int, dtype) -> np.ndarray:
        """Member `member`'s input slot of round g: (lanes, chunk) elements of `dtype`."""
        return self._view(self._mem[member], g, dtype)

    def out(self, g: int, dtype) -> np.ndarray:
        """The output slot of round g: (lanes, chunk) elements of `dtype`."""
        return self._view(self._out, g, dtype)

    def _view(self, mem, g, dtype):
        dtype = np.dtype(dtype)
        s = (g % self.depth) * self.lanes * self.chunk_bytes
        part = mem[s : s + self.lanes * self.chunk_bytes]
        return part.view(dtype).reshape(self.lanes, self.chunk_bytes // dtype.itemsize)

    def fence(self) -> None:
        pass

    def free(self) -> None:
        pass


class Staging(LocalStaging):
    """The staging area of one run in an MPI shared-memory window over `comm` (its members,
    all on one node). Collective over `comm` (creation and `free`)."""

    def __init__(self, comm, lanes: int, chunk_bytes: int, depth: int):
        L, i = comm.Get_size(), comm.Get_rank()
        self.members, self.lanes, self.depth = L, lanes, depth
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = depth * lanes * chunk_bytes
        header = _round_up(8 * (2 * L + 2 * lanes))
        # member 0: [counters | output slots | its input slots]; the others: [input slots]
        size = self.slot_bytes + (header + self.slot_bytes if i == 0 else 0)
        self.win = MPI.Win.Allocate_shared(size, 1, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        mems = [np.frombuffer(self.win.Shared_query(k)[0], np.uint8) for k in range(L)]
        head = mems[0]
        self._counts = head[: 8 * (2 * L + 2 * lanes)].view(np.int64)
        self._out = head[header : header + self.slot_bytes]
        self._mem = [head[header + self.slot_bytes :]] + mems[1:]
        self._split_counts()
        if i == 0:
            self._counts[:] = 0
            self._mem[0][:] = 0  # touch the pages once, here, not in the first collective
            self._out[:] = 0
        else:
            self._mem[i][:] = 0
        self.fence()
        comm.Barrier()
        self.fence()
        self.rounds = 0

    def fence(self) -> None:
        """A memory barrier between this rank's accesses to the window and the others'."""
        self.win.Sync()

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()


class SharedSlots:
    """The slot book of a node's network interface, shared by the ranks of `comm` (one node):
    `reserve(earliest, duration)` as `ratrain.shim.link.Slots`, atomically across processes.
    Collective over `comm` (creation and `free`)."""

    def __init__(self, comm):
        self.win = MPI.Win.Allocate_shared(8 if comm.Get_rank() == 0 else 0, 8, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self._t = np.frombuffer(self.win.Shared_query(0)[0], np.int64)
        if comm.Get_rank() == 0:
            self._t[0] = 0
        self.win.Sync()
        comm.Barrier()
        self._new, self._cmp, self._old = (np.zeros(1, np.int64) for _ in range(3))

    def reserve(self, earliest: float, duration: float) -> float:
        while True:
            self.win.Sync()
            cur = int(self._t[0])
            end = max(int(earliest * 1e9), cur) + int(round(duration * 1e9))
            self._new[0], self._cmp[0] = end, cur
            self.win.Compare_and_swap(self._new, self._cmp, self._old, 0, 0)
            self.win.Flush(0)
            if int(self._old[0]) == cur:
                return end * 1e-9

    def free_at(self) -> float:
        self.win.Sync()
        return int(self._t[0]) * 1e-9

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()


class SharedBuffers:
    """`nbytes` of shared memory per rank of `comm` (one node): `mine` is this rank's buffer,
    `all[k]` rank k's. Collective over `comm` (creation and `free`)."""

    def __init__(self, comm, nbytes: int):
        self.win = MPI.Win.Allocate_shared(max(int(nbytes), 1), 1, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.all = [np.frombuffer(self.win.Shared_query(k)[0], np.uint8)[:nbytes]
                    for k in range(comm.Get_size())]
        self.mine = self.all[comm.Get_rank()]
        self.mine[:] = 0  # this rank's pages, touched here
        self.win.Sync()
        comm.Barrier()

    def fence(self) -> None:
        self.win.Sync()

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()


__all__ = ["LocalStaging", "SharedBuffers", "SharedSlots", "Staging"]
