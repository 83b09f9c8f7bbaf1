#!/usr/bin/env bash
# Re-measures every figure of the summary tables of docs/BENCHMARKS.md and docs/FAULTS.md on the
# current code, writing one record per figure group (benchmarks/record.py) to docs/records/,
# then regenerates the tables (benchmarks/tables.py). Run it from a clean checkout, as root (the
# disk-full and Slurm trials), on a quiet host (the load is recorded with every figure):
#   bash benchmarks/remeasure.sh              # about 50-55 minutes on 2 quiet cores
#   SMOKE=1 bash benchmarks/remeasure.sh      # tiny versions of every step (2-3 minutes): proves
#                                             # each piece works; its records go to a temp dir
#                                             # (RATRAIN_RECORDS) and never to docs/
# PARTS (default all): bench (bench-step, bench-blas) parity comm lifecycle hetero tier plan psync checkpoint data faults elastic slurm timing
# (the wall-clock tests, `pytest --timing -m timing`, which need the quiet host); `memory` (the
# 20,000-step soaks and 64 ranks on one host, about 45 minutes and 7 GiB) only when named. A step that fails
# is reported and the script goes on, then exits 1 naming it; its record (when it printed
# figures) holds its exit_status and the table says so.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
PY=${PY:-.venv/bin/python}  # relative: the records' commands read as run from the repo root
MPIRUN=${MPIRUN:-.venv/bin/mpirun}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx
export OMPI_MCA_mpi_yield_when_idle=1 PYTHONHASHSEED=0
MPI=("$MPIRUN" --oversubscribe --mca mpi_yield_when_idle 1)
PARTS=${*:-bench parity comm lifecycle hetero tier plan psync checkpoint data faults elastic slurm timing}
SMOKE=${SMOKE:-0}
WORK=$(mktemp -d /tmp/ratrain-remeasure.XXXX)
trap 'rm -rf "$WORK"' EXIT
if [ "$SMOKE" = 1 ]; then
  export RATRAIN_RECORDS=${RATRAIN_RECORDS:-$WORK/records}
  echo "== SMOKE=1: tiny versions; records to $RATRAIN_RECORDS (not docs/records)"
fi
s() { if [ "$SMOKE" = 1 ]; then echo "$1"; else echo "$2"; fi; }  # s SMOKE_VALUE FULL_VALUE
failed=()
rec() {  # rec NAME [record.py options] -- COMMAND...: one figure group, timed, never fatal
  local name=$1 t0=$SECONDS
  echo "== $name (load $(cut -d' ' -f1 /proc/loadavg))"
  "$PY" benchmarks/record.py "$@" > "$WORK/$name.out" || failed+=("$name")
  tail -3 "$WORK/$name.out"
  echo "== $name: $((SECONDS - t0)) s"
}
TOKENS=data/stdlib/train.bin
[ -f "$TOKENS" ] || "$PY" -m ratrain.data prepare || exit 1  # the default corpus, once

for part in $PARTS; do
  case $part in
  bench)  # ~2 min: fp32 and fp16 steps against PyTorch eager, interleaved (needs torch)
    "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0" ||
      { echo "error: could not install torch (torch==2.13.0); bench needs it" >&2; failed+=(bench-step); continue; }
    rec bench-step -- "$PY" -m ratrain.bench --rounds "$(s 1 7)" --warmup "$(s 0 2)"
    # ~3 min: OpenBLAS against oneMKL forced, fp32 and bf16 (needs the mkl extra)
    "$PY" -c "from ratrain.exec.blas import load_mkl; load_mkl()" 2>/dev/null ||
      "$PY" -m pip install -q --no-deps "mkl>=2024" ||
      { echo "error: could not install mkl; bench-blas needs it" >&2; failed+=(bench-blas); continue; }
    rec bench-blas -- "$PY" -m ratrain.bench --no-torch --rounds "$(s 1 7)" --warmup "$(s 0 2)" \
      --precisions fp32,bf16 --blas openblas,mkl ;;
  parity)  # ~3 min: 100 steps against PyTorch + HF LlamaForCausalLM (needs torch, transformers)
    "$PY" -c "import transformers" 2>/dev/null || "$PY" -m pip install -q transformers ||
      { echo "error: could not install transformers; parity needs it" >&2; failed+=(hf-parity); continue; }
    rec hf-parity -- "$PY" benchmarks/hf_parity.py --steps "$(s 3 100)" --out "$WORK/hfp" ;;
  comm)  # ~1 min: tree and auto (hier) at 8 B vs MPI_Allreduce (4 ranks, 5 launches);
    # throttled 64 MiB ring
    rec comm-tree-8B --rounds "$(s 1 5)" \
      --ratio "tree_over_mpi=allreduce/tree/4/8.time_s:allreduce/mpi/4/8.time_s" \
      --ratio "auto_over_mpi=allreduce/auto/4/8.time_s:allreduce/mpi/4/8.time_s" -- \
      "${MPI[@]}" -n 4 "$PY" -m ratrain.comm.bench --op allreduce --algo tree,auto,mpi --sizes 8 \
      --iters "$(s 20 200)" --warmup "$(s 2 20)"
    rec comm-ring-throttled --rounds "$(s 1 3)" \
      --ratio "time_over_model=allreduce/ring/4/$(s 1048576 67108864).time_s:allreduce/ring/4/$(s 1048576 67108864).model_s" -- \
      "${MPI[@]}" -n 4 "$PY" -m ratrain.comm.bench --op allreduce --algo ring \
      --sizes "$(s 1M 64M)" --iters "$(s 2 5)" --warmup 1 --link --bandwidth 1e9 --latency 2e-5 ;;
  lifecycle)  # ~4 min: jobs/bench-lifecycle.yaml, 3 policies x 3 rounds on 8 ranks
    rec lifecycle -- "${MPI[@]}" -n 8 "$PY" -m ratrain.runtime.bench time \
      --config jobs/bench-lifecycle.yaml --rounds "$(s 1 3)" --steps "$(s 3 5)" --skip "$(s 1 2)" ;;
  hetero)  # ~30 min: jobs/mixed.yaml, the planner's plan against the best symmetric one on 8
    # ranks of one host and on 2 emulated nodes (root), and against a uniform cluster of the
    # same total compute; each beside the simulator
    H=("$PY" benchmarks/hetero.py --config jobs/mixed.yaml --rounds "$(s 1 3)" --steps "$(s 2 4)"
       --skip 1)
    [ "$SMOKE" = 1 ] && H+=(--set parallel.num_micro_batches=3)
    rec hetero-one-host -- "${H[@]}"
    rec hetero-same-flops -- "${H[@]}" --versus-uniform
    NODES='platform.classes=[{name: full, hosts: ["*-n1"]}, {name: half, hosts: ["*-n2"], compute_flops: 2.25e12}]'
    if scripts/cluster.sh up --nodes 2 --slots 4 --rate 1gbit --name hx; then
      MPIRUN=$MPIRUN rec hetero-two-nodes -- "${H[@]}" --set "$NODES" \
        --launcher "scripts/cluster.sh run --name hx --"
      scripts/cluster.sh down --name hx
    else
      failed+=(hetero-two-nodes)
    fi
    # simulated, not timed: the paper's four models on a mixed cluster of 1024 (~10 min)
    if [ "$SMOKE" = 1 ]; then P=(--jobs jobs/llama2-7b.yaml --policies ratrain); else P=(); fi
    rec hetero-plan -- "$PY" benchmarks/hetero_plan.py "${P[@]}" ;;
  tier)  # ~6 min, then ~15 simulated: jobs/bench-tier.yaml on 2 ranks: the DDR peak with every
    # layer offloaded; offload against recomputation at three tier bandwidths, beside the
    # simulator and the planner's choice; the paper's four models with the nvme tier (planner)
    rec tier-peaks -- "${MPI[@]}" -n 2 "$PY" benchmarks/tier.py peaks
    T=(--bandwidths "$(s 1e11,5e9 1e11,2e10,5e9)" --rounds "$(s 1 2)")
    [ "$SMOKE" = 1 ] && T+=(--skip 1 --set run.steps=3)
    rec tier-bench -- "${MPI[@]}" -n 2 "$PY" benchmarks/tier.py measure "${T[@]}"
    if [ "$SMOKE" = 1 ]; then M=(jobs/llama2-7b.yaml); else M=(); fi
    rec tier-models -- "$PY" benchmarks/tier.py models "${M[@]}" ;;
  plan)  # ~2.5 min: python -m ratrain.plan on the paper's four models, no tier, host, nvme;
    # PLAN_GOLDEN=DIR compares each output with DIR/MODEL-TIER.txt (a run of older code)
    G=(); [ -n "${PLAN_GOLDEN:-}" ] && G=(--golden "$PLAN_GOLDEN")
    if [ "$SMOKE" = 1 ]; then G+=(--models llama2-7b --tiers none,nvme); fi
    rec plan-speed -- "$PY" benchmarks/plan_speed.py "${G[@]}" ;;
  psync)  # ~30 min: partial against full synchronization (jobs/psync.yaml) on 2 emulated nodes
    # (root): steps/s interleaved beside the simulator, then both trained on the default corpus
    # and judged by ratrain.compare (the curves: docs/psync-curves.png)
    if scripts/cluster.sh up --nodes 2 --slots 2 --rate 1gbit --name ps; then
      PS=("$PY" benchmarks/psync.py)
      L=(--launcher "scripts/cluster.sh run --name ps --")
      MPIRUN=$MPIRUN rec psync-speed -- "${PS[@]}" speed --config jobs/psync.yaml --periods 4 \
        --rounds "$(s 1 3)" --steps "$(s 6 10)" --skip 2 "${L[@]}"
      Q=(); [ "$SMOKE" = 1 ] && Q=(--set run.steps=8 --set data.eval_interval=4)
      MPIRUN=$MPIRUN rec psync-quality -- "${PS[@]}" quality --config jobs/psync.yaml --period 4 \
        --out "$WORK/psync" --png "$(s "$WORK/psync-curves.png" docs/psync-curves.png)" "${Q[@]}" "${L[@]}"
      scripts/cluster.sh down --name ps
    else
      failed+=(psync-speed psync-quality)
    fi ;;
  checkpoint)  # ~1 min: a save against plain h5py, interleaved
    rec checkpoint-save --ratio "save_over_h5py=save.median_s:h5py.median_s" -- \
      "$PY" benchmarks/bench_checkpoint.py --reps "$(s 1 5)" --dir "$WORK" ;;
  data)  # ~15 min: prepare against a bare encode_batch loop; its peak RSS on 2 GB of jsonl
    rec prepare-throughput -- "$PY" benchmarks/prepare.py throughput --mb "$(s 1 20)" \
      --rounds "$(s 1 3)"
    rec prepare-memory -- "$PY" benchmarks/prepare.py memory --also-mb "$(s 2 200)" \
      --jsonl-mb "$(s 10 2000)" --text-mb "$(s 5 200)" ;;
  faults)  # ~8 min: stop, share, disk full (root), kill -9 trials on jobs/tiny.yaml
    F=("$PY" benchmarks/faults.py)
    rec faults-stop -- "${F[@]}" stop --trials "$(s 1 4)" --timeout 10 --tokens "$TOKENS" \
      --seed 14 --work "$WORK/faults"
    rec faults-share -- "${F[@]}" share --trials "$(s 1 2)" --tokens "$TOKENS" --seed 14 \
      --work "$WORK/faults"
    rec faults-diskfull -- "${F[@]}" diskfull --trials "$(s 1 2)" --tokens "$TOKENS" --seed 14 \
      --work "$WORK/faults"
    rec faults-kill9 -- "${F[@]}" kill9 --trials "$(s 1 10)" --tokens "$TOKENS" --seed 14 \
      --work "$WORK/faults"
    # ~5 min: random damage to two checkpoints, resume judged (issue 33)
    rec ckpt-fuzz -- "$PY" benchmarks/ckpt_fuzz.py --cases "$(s 20 1200)" --every 25 \
      --work "$WORK/ckpt-fuzz" ;;
  elastic)  # ~15 min: elastic mode under mpirun --with-ft ulfm (issue 45), pp 2 x dp 3 of tiny
    E=("$PY" benchmarks/faults_elastic.py --tokens "$TOKENS")
    rec elastic-kill -- "${E[@]}" --cases "$(s 2 20)" --kinds kill
    rec elastic-stop-raise -- "${E[@]}" --cases "$(s 2 18)" --kinds stop,raise
    rec elastic-respawn -- "${E[@]}" --cases "$(s 1 9)" --kinds kill --respawn
    rec elastic-overhead -- "$PY" benchmarks/elastic_overhead.py --rounds "$(s 1 5)" \
      --steps "$(s 6 40)" --tokens "$TOKENS" ;;
  memory)  # ~45 min, ~7 GiB: RSS over 20,000 steps, and 64 ranks of jobs/tiny.yaml on one host
    rec soak -- "$PY" benchmarks/soak.py --steps "$(s 1200 20000)" --base "$(s 200 1000)" \
      --cases 1x1,pp2xdp2,1x1-trace,pp2xdp2-trace --trace-bytes 1048576 --work "$WORK/soak"
    rec rank-memory-64 -- "$PY" benchmarks/rank_memory.py --ranks "$(s 8 64)" --pp "$(s 4 8)" \
      --dp "$(s 2 8)" --steps 10 --work "$WORK/rank-memory" ;;
  slurm)  # ~3 min: a private Slurm (root; Debian's slurm-wlm, munge, libpmix-dev)
    "$PY" -c "import numpy as np; from ratrain.data import write_tokens; write_tokens('$WORK/slurm.bin', np.random.default_rng(0).integers(0, 256, 400_000), vocab_size=256)"
    venv=$(cd "$(dirname "$PY")/.." && pwd)  # absolute: the jobs run elsewhere
    rec slurm-quick -- env RATRAIN_VENV="$venv" TMPDIR="$WORK" \
      bash scripts/slurm-local.sh run "$WORK/slurm" "$venv/bin/python" benchmarks/slurm_trials.py quick \
      --tokens "$WORK/slurm.bin" --work "$WORK/slurm-work"
    # elastic mode under Slurm: a rank killed, the job COMPLETED, never requeued (issue 45)
    rec elastic-slurm -- env RATRAIN_VENV="$venv" TMPDIR="$WORK" \
      bash scripts/slurm-local.sh run "$WORK/slurm" "$venv/bin/python" benchmarks/slurm_trials.py elastic \
      --trials "$(s 1 3)" --tokens "$WORK/slurm.bin" --work "$WORK/slurm-work" ;;
  timing)  # ~2 min: the wall-clock upper bounds, which only a quiet host can check
    echo "== timing tests (load $(cut -d' ' -f1 /proc/loadavg))"
    if [ "$SMOKE" = 1 ]; then sel=(--collect-only); else sel=(); fi
    "$PY" -m pytest -q -rs --timing -m timing -p no:cacheprovider "${sel[@]}" tests/ ||
      failed+=(timing)
    "${MPI[@]}" -n 2 "$PY" -m pytest -q -rs --with-mpi --timing -m "mpi and timing" \
      -p no:cacheprovider "${sel[@]}" tests/ || failed+=(timing-mpi) ;;
  *) echo "unknown part $part (bench parity comm lifecycle hetero tier plan psync checkpoint data faults elastic slurm timing memory)" >&2; exit 2 ;;
  esac
done
if [ "$SMOKE" = 1 ]; then
  echo "== SMOKE=1: records in $RATRAIN_RECORDS:"; ls "$RATRAIN_RECORDS" 2>/dev/null
  cp -r "$RATRAIN_RECORDS" "${SMOKE_KEEP:-/tmp/ratrain-smoke-records}" 2>/dev/null
else
  "$PY" benchmarks/tables.py
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "error: these steps failed: ${failed[*]} (their output: rerun the part)" >&2
  exit 1
fi
