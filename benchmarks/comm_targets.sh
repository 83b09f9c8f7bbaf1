#!/usr/bin/env bash
# The communication targets, measured in one go (docs/BENCHMARKS.md (Communication)). Run from the repo root:
#   bash benchmarks/comm_targets.sh > /tmp/comm_targets.jsonl
# Open MPI, oversubscribed ranks: --mca mpi_yield_when_idle 1 (a waiting rank yields its core).
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=.venv/bin/python
MPI=".venv/bin/mpirun --oversubscribe --mca mpi_yield_when_idle 1"
B="-m ratrain.comm.bench"
# 1. ring busbw at 64 MiB vs MPI_Allreduce, same run, interleaved (4 ranks, no throttle)
$MPI -n 4 $PY $B --op allreduce --algo ring,mpi --sizes 64M --iters 10 --warmup 2
# 2. tree latency at 8 B vs MPI_Allreduce (4 ranks)
$MPI -n 4 $PY $B --op allreduce --algo tree,mpi --sizes 8 --iters 200 --warmup 20
# 3. throttle 1 GB/s, 20 us: 64 MiB ring all-reduce vs the model 2(p-1)(a + n/(pB)) (4 ranks)
$MPI -n 4 $PY $B --op allreduce --algo ring --sizes 64M --iters 5 --warmup 1 --link --bandwidth 1e9 --latency 2e-5
# 4. throttle: p2p latency (osu_latency style) and streaming bandwidth (osu_bw style), 1 and 16 MiB
$MPI -n 2 $PY $B --op pingpong --sizes 1M,16M --iters 10 --warmup 2 --link --bandwidth 1e9 --latency 2e-5
$MPI -n 2 $PY $B --op stream --sizes 1M,16M --iters 3 --warmup 1 --window 64 --link --bandwidth 1e9 --latency 2e-5
# 5. overlap: 64 MiB all-reduce through the engine vs GEMMs of equal duration (2 ranks)
$MPI -n 2 $PY benchmarks/comm_overlap.py --link --bandwidth 1e9 --latency 2e-5
$MPI -n 2 $PY benchmarks/comm_overlap.py
# 6. DDR cap: failure on rank 1 -> every rank stopped (4 ranks)
$PY benchmarks/comm_ddr_abort.py --ranks 4
