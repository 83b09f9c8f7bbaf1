"""The elastic section: whether the job survives a lost rank (MPI's fault tolerance, ULFM);
typed, documented and checked as the other sections are (`sections`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ratrain.config.typedyaml import ConfigError


@dataclass(frozen=True)
class ElasticConfig:
    """Whether the job survives a lost rank. Launch with `mpirun --with-ft ulfm` (Open MPI's
    fault-tolerant MPI). The survivors of a rank that dies or stops answering agree on who is
    lost, drop each data-parallel replica that lost a rank, and go on as pp x (dp - k) with the
    same global batch, the step in flight redone. A run with nothing failing trains as with
    elastic off.

    enabled: survive a lost rank (off: a lost rank ends the job, which is requeued from its
        last checkpoint)
    copies: with the optimizer state sharded over the replicas, keep a copy of each replica's
        segment on the next replica of its stage, kept current every step, so that a lost
        segment is recovered from its copy. Off: the survivors go back to the last checkpoint
        instead (no requeue either way)
    respawn: spawn a process in each lost rank's place (MPI_Comm_spawn, slots permitting), give
        it its stage's state from its peers, and go on in the original layout; where no process
        can be spawned, the job shrinks instead
    """
    enabled: bool = False
    copies: bool = True
    respawn: bool = False

    def check(self) -> None:
        for key in ("enabled", "copies", "respawn"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"elastic.{key}={getattr(self, key)!r} must be true or false")


__all__ = ["ElasticConfig"]
