#!/usr/bin/env bash
# A private Slurm cluster on this host, for testing the batch scripts: munge, slurmctld and two
# slurmd playing two nodes (named after this host, and n2), everything (config, keys, sockets, state, logs, node temp
# dirs) under one state directory, on free ports, so that it touches nothing of the system's.
#
#   scripts/slurm-local.sh up STATE [CPUS]      # start; prints the SLURM_CONF to export
#   scripts/slurm-local.sh down STATE           # stop every daemon it started, remove STATE
#   scripts/slurm-local.sh run STATE CMD...     # up, CMD with SLURM_CONF set, down (always)
#
# Needs root (slurmd runs jobs as their users) and Debian's slurm-wlm, munge and libpmix-dev
# (installed with apt-get when missing; libpmix-dev gives srun its pmix plugin). CPUS per node
# (default 4) may exceed the cores: the nodes are declared with SlurmdParameters=config_overrides.
# Facts it relies on (docs/FAULTS.md "Slurm"): each slurmd needs its own TmpFS (%n), or the PMIx
# steps of the two nodes collide in one temp dir; `srun --mpi=pmix` then works with the pip Open
# MPI wheel (at most 2 tasks per node here: a third fails in MPI_Init against Debian's PMIx
# 4.2.2), and mpirun inside an allocation spans both nodes through Slurm. The first node bears
# this host's name, as a batch node does on a real cluster, so that mpirun starts the ranks of
# its own node itself (on a node named otherwise it would start them through a Slurm step).
# Credentials expire after 10 s (cred_expire; Slurm's default 120 s), which is also how long a
# requeued job waits before it may start again: the requeue tests need not wait two minutes.
set -euo pipefail

die() { echo "slurm-local: $*" >&2; exit 2; }

need_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurm-wlm)
  command -v munged >/dev/null || missing+=(munge)
  [ -e /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so ] || ls /usr/lib/*/libpmix.so >/dev/null 2>&1 \
    || missing+=(libpmix-dev)
  if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    echo "slurm-local: installing ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
      >/dev/null || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; } \
      || die "could not install ${missing[*]}"
  fi
}

free_ports() {  # N free TCP ports
  python3 -c "
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(('127.0.0.1', 0))
print(' '.join(str(s.getsockname()[1]) for s in socks))" "$1"
}

up() {
  local state=$1 cpus=${2:-4}
  [ "$(id -u)" = 0 ] || die "needs root (slurmd starts jobs as their users)"
  need_packages
  [ -e "$state/slurm.conf" ] && die "$state already holds a cluster (down it first)"
  mkdir -p "$state"
  state=$(cd "$state" && pwd)
  chmod 700 "$state"
  local host n1
  host=$(hostname)
  n1=$host
  mkdir -p "$state"/{munge,ctld,spool/"$n1",spool/n2,tmp/"$n1",tmp/n2}
  chmod 700 "$state/munge"
  dd if=/dev/urandom of="$state/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$state/munge/munge.key"
  munged --force --socket="$state/munge/munge.sock" --key-file="$state/munge/munge.key" \
    --pid-file="$state/munge/munged.pid" --log-file="$state/munge/munged.log" \
    --seed-file="$state/munge/munged.seed"
  read -r pctl p1 p2 <<<"$(free_ports 3)"
  cat >"$state/slurm.conf" <<EOF
ClusterName=ratrain-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$pctl
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$state/munge/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.%n.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
TmpFS=$state/tmp/%n
KillWait=15
MinJobAge=600
NodeName=$n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$p1 CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$p2 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  export SLURM_CONF=$state/slurm.conf
  slurmctld -c -f "$SLURM_CONF"
  echo "$n1" >"$state/nodes"
  slurmd -N "$n1" -f "$SLURM_CONF"
  slurmd -N n2 -f "$SLURM_CONF"
  local i
  for i in $(seq 100); do
    if [ "$(sinfo -h -o '%T' 2>/dev/null | sort -u)" = idle ]; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.2
  done
  sinfo >&2 || true
  tail -5 "$state"/*.log >&2 || true
  die "the nodes did not come up (logs under $state)"
}

down() {
  local state=$1 f pid
  [ -d "$state" ] || return 0
  if [ -e "$state/slurm.conf" ] && [ -s "$state/slurmctld.pid" ]; then
    # Every job of this cluster ends first, so that no job step outlives its slurmd.
    export SLURM_CONF=$state/slurm.conf
    scancel --quiet "--user=$(id -un)" 2>/dev/null || true
    for _ in $(seq 150); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  for f in "$state"/slurmd.*.pid "$state"/slurmctld.pid "$state"/munge/munged.pid; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  rm -rf "$state"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) shift; down "$@" ;;
  run)
    shift
    state=${1:?usage: slurm-local.sh run STATE CMD...}
    shift
    trap 'down "$state"' EXIT
    eval "$(up "$state")"
    "$@"
    ;;
  *) die "usage: slurm-local.sh up STATE [CPUS] | down STATE | run STATE CMD..." ;;
esac
