"""A stage's optimizer state moved from the survivors' old layout to the new one, in memory.

After a shrink each stage's state lives on its surviving ranks: whole on every replica when
the optimizer state is not sharded, else replica q's segment q of each block (or, its rank
lost, the copy its stage's next replica keeps, `runtime.passes.mirror`). The new layout's ranks
need their own part: the whole block, or their new segment of it. `transfers` lists, for every
new rank, which survivor sends which element range of which block's `master`, `m` and `v`; the
lists are the same on every survivor (a pure function of what they all know), and messages
between two ranks are posted in that order on both sides, so one tag serves (MPI keeps their
order). A source and a destination on one rank copy locally.

    moves = transfers(sizes, sources, dests)             # every survivor, the same list
    sends = post_sends(comm, me, moves, {False: old_state, True: copy})  # a source's sends
    receive(comm, me, moves, new_state, {False: old_state, True: copy})  # a new rank's part
    wait(sends)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ratrain.exec.params import STATE_BUFFERS

TAG = 911  # one tag: the messages between two ranks are ordered by the list


@dataclass(frozen=True)
class Move:
    """Elements [lo, hi) of block `block`'s buffers (`master`, `m`, `v`), from survivor `src`
    (a rank of the shrunk communicator; `copy`: from the peer copy it keeps) to `dst`, both
    offsets within the block."""

    src: int
    dst: int
    block: str
    lo: int
    hi: int
    copy: bool = False


@dataclass(frozen=True)
class Held:
    """What one survivor holds of a stage: for each block, the element range [lo, hi) of the
    block its buffers hold (whole, or a segment), in its own state or (`copy`) in the peer
    copy it keeps; both give them by `flat(buf, block)` (`exec.params.StageState`)."""

    rank: int
    ranges: dict  # block -> (lo, hi)
    copy: bool = False


def transfers(sizes: dict[str, int], sources: list[Held], dests: list[Held]) -> list[Move]:
    """Every move that fills `dests` (each new rank's ranges of the stage's blocks, `sizes`:
    block -> elements) from `sources` (the survivors that hold the stage's state): the
    destination's own old part where it holds the element, else the first holder in `sources`'
    order. Raises ValueError when some element has no holder."""
    moves = []
    for d in dests:
        # its own old part first (a local copy), then the others in their order
        order = [s for s in sources if s.rank == d.rank] + [s for s in sources if s.rank != d.rank]
        for block, (lo, hi) in d.ranges.items():
            at = lo
            while at < hi:
                src = next((s for s in order if s.ranges[block][0] <= at < s.ranges[block][1]),
                           None)
                if src is None:
                    raise ValueError(f"no survivor holds element {at} of block {block!r} of "
                                     f"{sizes[block]}")
                end = min(hi, src.ranges[block][1])
                moves.append(Move(src.rank, d.rank, block, at, end, src.copy))
                at = end
    return moves


def _part(state, buf: str, m: Move):
    lo = state.segment(m.block)[0]
    return state.flat(buf, m.block)[m.lo - lo:m.hi - lo]


def post_sends(comm, me: int, moves: list[Move], held: dict) -> list:
    """This rank's sends of `moves` as a source, non-blocking (`held`: its own old state under
    False, the peer copy it keeps under True); the arrays must stay as they are until `wait`.
    Local moves are left to `receive`."""
    reqs = []
    for m in moves:
        if m.src == me and m.dst != me:
            for k in STATE_BUFFERS:
                part = np.ascontiguousarray(_part(held[m.copy], k, m))
                reqs.append((comm.Isend([part, MPI.FLOAT], m.dst, TAG), part))
    return reqs


def receive(comm, me: int, moves: list[Move], state, held: dict | None = None) -> None:
    """Fill this rank's new `state` (its `segment(block)` ranges) from `moves`: received, or
    copied from what this rank held itself (`held`, as `post_sends` takes it)."""
    reqs = []
    for m in moves:
        if m.dst != me:
            continue
        for k in STATE_BUFFERS:
            out = _part(state, k, m)
            if m.src == me:
                out[...] = _part(held[m.copy], k, m)
            else:
                reqs.append(comm.Irecv([out, MPI.FLOAT], m.src, TAG))
    MPI.Request.Waitall(reqs)


def wait(sends) -> None:
    """Complete this rank's sends (`post_sends`)."""
    MPI.Request.Waitall([q for q, _ in sends])


__all__ = ["Held", "Move", "post_sends", "receive", "transfers", "wait"]
