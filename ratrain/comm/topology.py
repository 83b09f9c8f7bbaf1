"""Topology: rank <-> (stage, replica) on the pp x dp grid, and the sub-communicators.

The grid is `np.arange(world).reshape(dp, pp)`: rank = replica * pp + stage, so the stages of one
replica are neighbouring ranks (pipeline messages stay close) and the replicas of one stage are
`pp` apart.

    topo = Topology(MPI.COMM_WORLD, pp=2, dp=2)
    topo.stage, topo.replica              # this rank's place
    topo.pp_comm                          # the ranks of my replica, ordered by stage
    topo.dp_comm                          # the ranks of my stage, ordered by replica
    topo.prev_rank, topo.next_rank        # neighbours in pp_comm (None at the pipeline's ends)
"""

from __future__ import annotations

import numpy as np


def grid(pp: int, dp: int) -> np.ndarray:
    """World ranks by (replica, stage)."""
    return np.arange(pp * dp).reshape(dp, pp)


def coords(rank: int, pp: int) -> tuple[int, int]:
    """(stage, replica) of a world rank."""
    return rank % pp, rank // pp


class Topology:
    def __init__(self, comm, pp: int, dp: int):
        assert isinstance(pp, int) and pp >= 1, f"pp must be a positive integer, got {pp!r}"
        assert isinstance(dp, int) and dp >= 1, f"dp must be a positive integer, got {dp!r}"
        world = comm.Get_size()
        assert world == pp * dp, (
            f"world size {world} != pp x dp = {pp} x {dp} = {pp * dp}: launch {pp * dp} ranks or "
            "change parallel.pp / parallel.dp"
        )
        self.comm = comm
        self.pp, self.dp, self.world = pp, dp, world
        self.rank = comm.Get_rank()
        self.grid = grid(pp, dp)
        self.stage, self.replica = coords(self.rank, pp)
        assert self.grid[self.replica, self.stage] == self.rank
        # Split is collective: every rank calls both, in the same order.
        self.pp_comm = comm.Split(color=self.replica, key=self.stage)
        self.dp_comm = comm.Split(color=self.stage, key=self.replica)
        self.pp_comm.Set_name(f"pp[replica {self.replica}]")
        self.dp_comm.Set_name(f"dp[stage {self.stage}]")
        assert self.pp_comm.Get_rank() == self.stage and self.pp_comm.Get_size() == pp
        assert self.dp_comm.Get_rank() == self.replica and self.dp_comm.Get_size() == dp
        self.is_first = self.stage == 0
        self.is_last = self.stage == pp - 1
        self.prev_rank = None if self.is_first else self.stage - 1  # in pp_comm
        self.next_rank = None if self.is_last else self.stage + 1  # in pp_comm

    def world_rank(self, stage: int, replica: int) -> int:
        assert 0 <= stage < self.pp and 0 <= replica < self.dp, (
            f"(stage {stage}, replica {replica}) is outside the {self.pp} x {self.dp} grid"
        )
        return int(self.grid[replica, stage])

    def free(self) -> None:
        self.pp_comm.Free()
        self.dp_comm.Free()

    def __repr__(self) -> str:
        return (f"Topology(rank {self.rank} = stage {self.stage} of {self.pp}, "
                f"replica {self.replica} of {self.dp})")


__all__ = ["Topology", "coords", "grid"]
