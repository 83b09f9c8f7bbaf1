"""The step's global facts, gathered by one exact all-reduce.

At `GradNorm` every rank needs the same gradient norm (hence clip coefficient and overflow
flag), the mean loss, and the peak DDR and resident set (the process's whole memory) of every
rank. They travel as one float64 vector summed
over the world, in which every entry has exactly one non-zero contributor, so the sum is exact
and the same on every rank whatever the collective's order:

    [ sums of squares: (global block, dp segment), segment q written by replica q  | nb entries
      losses: global micro-batch (replica r's from its offset), by the last stage   | nl entries
      peak DDR bytes: one per world rank                                            | world
      resident bytes: one per world rank ]                                          | world

Every rank then reads the partials and losses in this fixed order, so the norm is independent
of the policy and of the pipeline split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FactsLayout:
    blocks: int  # blocks of the whole model
    dp: int
    shares: tuple[int, ...]  # micro-batches of each replica
    world: int

    @property
    def nb(self) -> int:
        return self.blocks * self.dp

    @property
    def nl(self) -> int:
        """Micro-batches of the global batch."""
        return sum(self.shares)

    def vector(self) -> np.ndarray:
        return np.zeros(self.nb + self.nl + 2 * self.world, np.float64)

    def put_sq(self, vec, global_block: int, replica: int, value: float) -> None:
        vec[global_block * self.dp + replica] = value

    def put_loss(self, vec, replica: int, mb: int, loss: float) -> None:
        vec[self.nb + sum(self.shares[:replica]) + mb] = loss

    def put_peak(self, vec, rank: int, nbytes: int) -> None:
        vec[self.nb + self.nl + rank] = nbytes

    def sq_partials(self, vec) -> list[float]:
        """The sums of squares in (global block, dp segment) order."""
        return vec[: self.nb].tolist()

    def replica_sq(self, vec, replica: int) -> list[float]:
        """Replica `replica`'s column of sums of squares, in global block order (partial
        synchronization: each replica puts its whole blocks' there)."""
        return vec[replica : self.nb : self.dp].tolist()

    def mean_loss(self, vec) -> float:
        return float(sum(vec[self.nb : self.nb + self.nl].tolist()) / self.nl)

    def put_resident(self, vec, rank: int, nbytes: int) -> None:
        vec[self.nb + self.nl + self.world + rank] = nbytes

    def peaks(self, vec) -> tuple[int, ...]:
        """Every rank's ledger peak, by world rank."""
        return tuple(int(v) for v in vec[self.nb + self.nl : self.nb + self.nl + self.world].tolist())

    def peak(self, vec) -> int:
        return max(self.peaks(vec))

    def resident(self, vec) -> tuple[int, ...]:
        """Every rank's resident bytes, by world rank."""
        return tuple(int(v) for v in vec[self.nb + self.nl + self.world :].tolist())


__all__ = ["FactsLayout"]
