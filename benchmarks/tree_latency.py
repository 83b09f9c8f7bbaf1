"""Small all-reduce latency back to back (issue 15): MPI_Allreduce against ratrain's tree, with
the shared-memory board (`comm.board`), through the default `algo="auto"`, and with messages
(the board off), interleaved in the same processes. `comm.bench` times each operation alone between barriers (its figure includes
how unevenly the ranks leave the barrier); this loop times calls that follow each other, where
every rank's own work per call counts.

    mpirun -n 4 --oversubscribe --mca mpi_yield_when_idle 1 python benchmarks/tree_latency.py
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

from ratrain.comm import board
from ratrain.comm import collectives as C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=8, help="message size (float32 elements x 4)")
    ap.add_argument("--calls", type=int, default=1000, help="calls per timed block")
    ap.add_argument("--rounds", type=int, default=9, help="timed blocks per contender")
    a = ap.parse_args()
    if a.bytes < 4 or a.bytes % 4:
        raise SystemExit(f"--bytes {a.bytes}: give a positive multiple of 4 (float32 elements)")
    comm = MPI.COMM_WORLD.Dup()
    x = np.zeros(a.bytes // 4, np.float32)

    def mpi():
        comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)

    def tree():
        C.allreduce(x, comm, "tree")

    def auto():  # the default algo: the model picks tree for small arrays
        C.allreduce(x, comm)

    def messages():
        with board.disabled():
            C.allreduce(x, comm, "tree")

    runs = {"mpi": mpi, "tree (board)": tree, "auto (board)": auto, "tree (messages)": messages}
    times: dict = {k: [] for k in runs}
    for _ in range(a.rounds):
        for name, f in runs.items():
            comm.Barrier()
            for _ in range(a.calls // 20):
                f()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                f()
            times[name].append((time.perf_counter() - t0) / a.calls)
    worst = {k: max(comm.allgather(float(np.median(v)))) for k, v in times.items()}
    if comm.Get_rank() == 0:
        base = worst["mpi"]
        on = "on" if board.board_of(comm) is not None else "off (no numba, or RATRAIN_FUSED=0)"
        print(f"{comm.Get_size()} ranks, {a.bytes} B, board {on}; median per call, slowest rank:")
        for k, v in worst.items():
            print(f"  {k:16s} {v * 1e6:7.2f} us  {v / base:5.2f}x MPI_Allreduce")
    comm.Free()


if __name__ == "__main__":
    main()
