"""Small all-reduce latency back to back (issue 15): MPI_Allreduce against ratrain's tree (the
blocking path: one Sendrecv per step) and against what the runtime runs for its small
all-reduces (the step's facts over the world: `algo="auto"` on a communicator grouped by node,
the hierarchical rank-order fold), interleaved in the same processes. `comm.bench` times each
operation alone between barriers (its figure includes how unevenly the ranks leave the
barrier); this loop times calls that follow each other, where every rank's own work per call
counts.

    mpirun -n 4 --oversubscribe --mca mpi_yield_when_idle 1 python benchmarks/tree_latency.py
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

from ratrain.comm import collectives as C
from ratrain.comm.topology import Topology


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=8, help="message size (float32 elements x 4)")
    ap.add_argument("--calls", type=int, default=1000, help="calls per timed block")
    ap.add_argument("--rounds", type=int, default=9, help="timed blocks per contender")
    a = ap.parse_args()
    if a.bytes < 4 or a.bytes % 4:
        raise SystemExit(f"--bytes {a.bytes}: give a positive multiple of 4 (float32 elements)")
    topo = Topology(MPI.COMM_WORLD, 1, MPI.COMM_WORLD.Get_size())  # the ranks' nodes
    comm, group = topo.dp_comm, topo.dp_group
    x = np.zeros(a.bytes // 4, np.float32)

    def mpi():
        comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)

    def tree():
        C.allreduce(x, comm, "tree")

    def auto():  # the runtime's rule on a communicator grouped by node: hier
        C.allreduce(x, comm, group=group)

    chosen = C.choose_algo(x.nbytes, comm.Get_size(), group=group)
    runs = {"mpi": mpi, "tree": tree, f"auto ({chosen})": auto}
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
        print(f"{comm.Get_size()} ranks ({topo.describe()}), {a.bytes} B; median per call, "
              "slowest rank:")
        for k, v in worst.items():
            print(f"  {k:16s} {v * 1e6:7.2f} us  {v / base:5.2f}x MPI_Allreduce")
    topo.free()


if __name__ == "__main__":
    main()
