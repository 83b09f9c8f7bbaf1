#!/usr/bin/env bash
# The communication figures of docs/history/communication.md (issues 3 and 15), measured in
# one go, each contender interleaved with MPI_Allreduce in the same processes where there is
# one. Run from the repo root on a quiet host (the load is printed before every command):
#   ROUNDS=3 bash benchmarks/comm_targets.sh > /tmp/comm_targets.txt
# Open MPI, oversubscribed ranks: --mca mpi_yield_when_idle 1 (a waiting rank yields its core).
# PARTS (default all): ring tree throttle p2p overlap ddr.
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx
PY=${PY:-.venv/bin/python}
MPI="${MPIRUN:-.venv/bin/mpirun} --oversubscribe --mca mpi_yield_when_idle 1"
B="-m ratrain.comm.bench"
ROUNDS=${ROUNDS:-3}
PARTS=${*:-ring tree throttle p2p overlap ddr}
run() { echo "# load $(cut -d' ' -f1-3 /proc/loadavg): $*"; "$@"; }
for r in $(seq "$ROUNDS"); do
  echo "## round $r"
  for part in $PARTS; do
    case $part in
    ring)  # ring busbw at 64 MiB vs MPI_Allreduce, interleaved (4 ranks, no throttle)
      run $MPI -n 4 $PY $B --op allreduce --algo ring,mpi --sizes 64M --iters 10 --warmup 2 ;;
    tree)  # tree and auto (hier) latency at 8 B vs MPI_Allreduce (4 and 2 ranks)
      run $MPI -n 4 $PY $B --op allreduce --algo tree,auto,mpi --sizes 8 --iters 200 --warmup 20
      run $MPI -n 2 $PY $B --op allreduce --algo tree,auto,mpi --sizes 8 --iters 200 --warmup 20 ;;
    throttle)  # 1 GB/s, 20 us: 64 MiB ring all-reduce vs 2(p-1)(a + n/(pB)) (4 ranks)
      run $MPI -n 4 $PY $B --op allreduce --algo ring --sizes 64M --iters 5 --warmup 1 --link \
        --bandwidth 1e9 --latency 2e-5 ;;
    p2p)  # throttle: ping-pong (osu_latency style) and streaming (osu_bw style), 1 and 16 MiB
      run $MPI -n 2 $PY $B --op pingpong --sizes 1M,16M --iters 10 --warmup 2 --link \
        --bandwidth 1e9 --latency 2e-5
      run $MPI -n 2 $PY $B --op stream --sizes 1M,16M --iters 3 --warmup 1 --window 64 --link \
        --bandwidth 1e9 --latency 2e-5 ;;
    overlap)  # 64 MiB all-reduce through the engine vs GEMMs of equal duration (2 ranks)
      run $MPI -n 2 $PY benchmarks/comm_overlap.py --link --bandwidth 1e9 --latency 2e-5 ;;
    ddr)  # DDR cap: a failure on rank 1 stops every rank (4 ranks)
      if [ "$r" = 1 ]; then run $PY benchmarks/comm_ddr_abort.py --ranks 4; fi ;;
    *) echo "unknown part $part (ring tree throttle p2p overlap ddr)" >&2; exit 2 ;;
    esac
  done
done
echo "# load $(cut -d' ' -f1-3 /proc/loadavg): end"
