#!/usr/bin/env bash
# An emulated cluster of nodes on one Linux host: each node is a network namespace with its own
# hostname (a UTS namespace per process tree) and a veth link into a shared bridge; the links
# can be shaped in the kernel (tc tbf: rate only, this kernel has no netem). Open MPI starts its
# daemons on the nodes through its ssh-agent setting, pointed at a small script that enters the
# node's namespaces, so ranks on different nodes talk TCP over the shaped links and ranks on one
# node shared memory, as on a cluster.
#
#   scripts/cluster.sh up --nodes N [--slots K] [--rate 1gbit] [--mtu 9000] [--name NAME]
#   scripts/cluster.sh run [--name NAME] -- <mpirun arguments>    # mpirun from node 1
#   scripts/cluster.sh exec NODE [--name NAME] -- <command>        # a command on one node
#   scripts/cluster.sh kill NODE [--name NAME]                     # SIGKILL every process of NODE
#   scripts/cluster.sh status [--name NAME]
#   scripts/cluster.sh down [--name NAME]
#
# Nodes are NAME-n1 .. NAME-nN (NAME: 1-8 lowercase letters or digits, default rtc), on the
# private subnet 10.213.X.0/24 (X from NAME) that exists only inside those namespaces: the root
# namespace gets no address and no route, the bridge only switches frames between the nodes.
# `--rate` shapes both directions of every node's link (a `tbf` on each end of its veth);
# `--mtu` (default 9000, jumbo frames as HPC Ethernet uses) keeps TCP's header overhead under
# 1%, so that a shaped link carries ~99% of its rate as payload. `run` adds to mpirun the hosts
# (NAME-n1:K,...; not when the arguments give --host / --hostfile), the agent, `--bind-to
# none`, the TCP interface of the subnet and Open MPI's TCP tuning (TCP_TUNING below), sets
# OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM), and watches the nodes: when the job loses a node (Open MPI
# reports a lost daemon, or a node that held ranks has had no process for 10 s), it names the
# MPI ranks that were on it and exits non-zero (Open MPI 5.0's mpirun may itself exit 0 then).
# Under a fault-tolerant launch (`--with-ft ulfm`, elastic mode) it names them and leaves the job
# to its survivors: its status is mpirun's.
# Everything `up` creates is removed again if `up` fails; `down` kills the nodes' processes and
# removes the namespaces, the bridge and the state directory ($RATRAIN_CLUSTER_STATE, default
# /run/ratrain-cluster/NAME). Root runs the agent written there, so the directory
# $RATRAIN_CLUSTER_STATE must be root's with mode 0700 (created so when absent; refused otherwise). Needs root, `ip`, `tc` (for --rate), `unshare`, and a kernel with
# network namespaces, veth and bridges; refuses with a one-line reason otherwise.
set -euo pipefail

die() { echo "cluster.sh: $*" >&2; exit 2; }

NAME=rtc NODES="" SLOTS=4 RATE="" MTU=9000
usage() { sed -n '/^#   scripts/s/^#   //p' "$0" >&2; exit 2; }

[ $# -ge 1 ] || usage
CMD=$1; shift
NODE_ARG=""
if [ "$CMD" = exec ] || [ "$CMD" = kill ]; then
  [ $# -ge 1 ] || die "$CMD needs a node name or number"
  NODE_ARG=$1; shift
fi
REST=()
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) NODES=${2:-}; shift 2 ;;
    --slots) SLOTS=${2:-}; shift 2 ;;
    --rate) RATE=${2:-}; shift 2 ;;
    --mtu) MTU=${2:-}; shift 2 ;;
    --name) NAME=${2:-}; shift 2 ;;
    --) shift; REST=("$@"); break ;;
    -h|--help) usage ;;
    *) die "unknown argument '$1' (see scripts/cluster.sh --help)" ;;
  esac
done
[[ $NAME =~ ^[a-z0-9]{1,8}$ ]] || die "--name '$NAME': use 1-8 lowercase letters or digits"
STATE_ROOT=${RATRAIN_CLUSTER_STATE:-/run/ratrain-cluster}
STATE=$STATE_ROOT/$NAME
BR="${NAME}-br"
# the third octet of the subnet, from the name (clusters of different names never share one)
OCTET=$(( $(printf '%s' "$NAME" | cksum | cut -d' ' -f1) % 200 + 20 ))
SUBNET="10.213.$OCTET.0/24"
node() { echo "${NAME}-n$1"; }

need_root() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces, veth and tc need CAP_NET_ADMIN); run it as root or with sudo"
  for tool in ip unshare; do
    command -v "$tool" >/dev/null || die "'$tool' not found (install iproute2 / util-linux)"
  done
  private_dir "$STATE_ROOT"
}

private_dir() {  # $1: a directory only root can enter (root runs the agent written there), or die
  [ -L "$1" ] && die "state directory '$1' is a symbolic link: remove it, or set RATRAIN_CLUSTER_STATE to a private directory"
  [ -e "$1" ] || mkdir -m 700 "$1" 2>/dev/null || [ -d "$1" ] ||
    die "cannot create the state directory '$1' (RATRAIN_CLUSTER_STATE)"
  [ "$(stat -c '%u %a' "$1")" = "0 700" ] ||
    die "state directory '$1' is owned by $(stat -c '%U with mode %a' "$1"), not by root with mode 0700: remove it, or set RATRAIN_CLUSTER_STATE to a directory of root's with mode 0700 (mktemp -d)"
}

nodes_up() {  # the node names of the cluster, from its state
  [ -f "$STATE/nodes" ] || die "no cluster '$NAME' is up (scripts/cluster.sh up --nodes N --name $NAME)"
  cat "$STATE/nodes"
}

resolve_node() {  # a node number or name -> its name
  local n=$1
  [[ $n =~ ^[0-9]+$ ]] && n=$(node "$n")
  grep -qx "$n" "$STATE/nodes" || die "'$1' is not a node of cluster '$NAME' ($(tr '\n' ' ' < "$STATE/nodes"))"
  echo "$n"
}

teardown() {  # remove whatever exists of cluster NAME; never fails
  local n
  for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NAME}-n[0-9]+$" || true); do
    ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns delete "$n" 2>/dev/null || true
  done
  ip link delete "$BR" 2>/dev/null || true
  rm -rf "$STATE"
}

write_agent() {
  cat > "$STATE/agent" <<'EOF'
#!/bin/sh
# Open MPI's ssh agent for the emulated cluster: AGENT [ssh options] HOST COMMAND... runs
# COMMAND in HOST's network namespace, in a new UTS namespace named HOST.
while [ $# -gt 0 ]; do
  case $1 in -*) shift ;; *) break ;; esac
done
host=$1; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host && $*"
EOF
  chmod 755 "$STATE/agent"
}

cmd_up() {
  need_root
  [[ $NODES =~ ^[0-9]+$ ]] && [ "$NODES" -ge 1 ] && [ "$NODES" -le 64 ] ||
    die "--nodes '$NODES': give a number of nodes from 1 to 64"
  [[ $SLOTS =~ ^[0-9]+$ ]] && [ "$SLOTS" -ge 1 ] || die "--slots '$SLOTS': give a positive number"
  [[ $MTU =~ ^[0-9]+$ ]] && [ "$MTU" -ge 1280 ] && [ "$MTU" -le 65535 ] ||
    die "--mtu '$MTU': give 1280..65535"
  if [ -n "$RATE" ]; then
    [[ $RATE =~ ^[0-9.]+([kmg]?bit|[kmg]?bps)$ ]] || die "--rate '$RATE': use tc's units, e.g. 1gbit or 500mbit"
    command -v tc >/dev/null || die "--rate needs 'tc' (iproute2)"
  fi
  [ -e "$STATE/nodes" ] && die "cluster '$NAME' is up already (scripts/cluster.sh down --name $NAME)"
  ip netns list 2>/dev/null | grep -qE "^${NAME}-n[0-9]+( |$)" &&
    die "namespaces ${NAME}-n* exist without state: remove them (scripts/cluster.sh down --name $NAME)"
  unshare --uts true 2>/dev/null || die "cannot create UTS namespaces here (unshare --uts failed)"
  mkdir -m 700 "$STATE"
  trap 'echo "cluster.sh: up failed; removing what it made" >&2; teardown' ERR
  ip netns add "${NAME}-probe" 2>/dev/null || { rmdir "$STATE" 2>/dev/null; trap - ERR;
    die "cannot create network namespaces here (ip netns add failed: no CAP_SYS_ADMIN or no kernel support)"; }
  ip netns delete "${NAME}-probe"
  ip link add "$BR" mtu "$MTU" type bridge
  ip link set "$BR" up
  local i n v addr
  : > "$STATE/nodes.tmp"
  for i in $(seq 1 "$NODES"); do
    n=$(node "$i") v="${NAME}-v$i"
    addr="10.213.$OCTET.$i"
    ip netns add "$n"
    ip link add "$v" mtu "$MTU" type veth peer name eth0 netns "$n"
    ip link set "$v" master "$BR" up
    ip -n "$n" link set lo up
    ip -n "$n" link set eth0 mtu "$MTU" up
    ip -n "$n" addr add "$addr/24" dev eth0
    if [ -n "$RATE" ]; then  # both directions: what the node sends, what it receives
      ip netns exec "$n" tc qdisc add dev eth0 root tbf rate "$RATE" burst 256kb latency 50ms
      tc qdisc add dev "$v" root tbf rate "$RATE" burst 256kb latency 50ms
    fi
    echo "$n" >> "$STATE/nodes.tmp"
  done
  write_agent
  echo "$SLOTS" > "$STATE/slots"
  echo "$SUBNET" > "$STATE/subnet"
  echo "${RATE:-none}" > "$STATE/rate"
  mv "$STATE/nodes.tmp" "$STATE/nodes"
  trap - ERR
  echo "cluster $NAME: $NODES nodes ($(tr '\n' ' ' < "$STATE/nodes" | sed 's/ $//')) x $SLOTS slots," \
       "subnet $SUBNET, link rate ${RATE:-unshaped}, mtu $MTU"
}

# Open MPI's TCP transport, tuned for ranks that share few cores: socket buffers and eager
# sends large enough for a collective's round of messages (up to 4 MiB), so that the kernel
# moves a message across the shaped link while its ranks wait for a core (measured here, 2
# nodes x 4 ranks on 2 cores, hierarchical all-reduce of 16 MiB through 1 Gbit/s: 63 MB/s
# untuned, 81 tuned). RATRAIN_CLUSTER_TCP=default leaves Open MPI's defaults.
TCP_TUNING=(--mca btl_tcp_sndbuf 8388608 --mca btl_tcp_rcvbuf 8388608
            --mca btl_tcp_eager_limit 4194304 --mca btl_tcp_rndv_eager_limit 4194304
            --mca btl_tcp_max_send_size 4194304)
[ "${RATRAIN_CLUSTER_TCP:-tuned}" = default ] && TCP_TUNING=()

cmd_run() {
  need_root
  local nodes first hosts=() a given=0
  nodes=$(nodes_up)
  first=$(head -1 <<< "$nodes")
  [ ${#REST[@]} -gt 0 ] || die "run: give mpirun's arguments after --, e.g. -- -n 8 python -m ratrain.train ..."
  for a in "${REST[@]}"; do
    case $a in --host|-H|--hostfile|--machinefile|-hostfile) given=1 ;; esac
  done
  local slots subnet mpirun=${MPIRUN:-mpirun}
  slots=$(cat "$STATE/slots") subnet=$(cat "$STATE/subnet")
  if [ "$given" = 0 ]; then
    hosts=(--host "$(sed "s/\$/:$slots/" <<< "$nodes" | paste -sd,)")
  fi
  command -v "$mpirun" >/dev/null || die "mpirun '$mpirun' not found (set MPIRUN=/path/to/mpirun)"
  mpirun=$(command -v "$mpirun")
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx}  # shared-memory windows: sm, not the wheel's UCX
  local run
  run=$(mktemp -d "$STATE/run.XXXXXX")
  ip netns exec "$first" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$first" \
    "$mpirun" --prtemca plm_ssh_agent "$STATE/agent" --prtemca oob_tcp_if_include "$subnet" \
    --mca btl tcp,self,sm --mca btl_tcp_if_include "$subnet" "${TCP_TUNING[@]}" \
    --bind-to none "${hosts[@]}" \
    "${REST[@]}" > >(tee "$run/stdout") 2> >(tee "$run/stderr" >&2) &
  local pid=$! rc=0 ft=0
  # a fault-tolerant launch (elastic mode): a lost node is the survivors' to handle
  [[ " ${REST[*]} " == *" --with-ft "* ]] && ft=1
  set +e  # from here on a failing probe of a vanished process must not end the script
  trap 'kill -TERM $pid 2>/dev/null' INT TERM
  watch_nodes "$pid" "$run" "$nodes" "$ft"
  wait "$pid" || rc=$?
  trap - INT TERM
  sleep 0.2  # let tee finish the stderr file
  report_lost "$run" "$nodes" "$rc" "$ft" || rc=$?
  rm -rf "$run"
  return "$rc"
}

watch_nodes() {  # while mpirun runs: which MPI ranks each node holds; a node that held ranks
  # and has had no process at all for $LOST_AFTER s is lost: mpirun is stopped then (unless the
  # launch is fault-tolerant, $4 = 1: the survivors go on without it)
  local pid=$1 run=$2 nodes=$3 ft=${4:-0} n p r empty
  declare -A since=()
  while kill -0 "$pid" 2>/dev/null; do
    for n in $nodes; do
      empty=1
      for p in $(ip netns pids "$n" 2>/dev/null); do
        empty=0
        r=$(tr '\0' '\n' 2>/dev/null < "/proc/$p/environ" | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
        [ -n "$r" ] && ! grep -qx "$r" "$run/ranks.$n" 2>/dev/null && echo "$r" >> "$run/ranks.$n"
      done
      if [ "$empty" = 1 ] && [ -s "$run/ranks.$n" ]; then
        since[$n]=${since[$n]:-$SECONDS}
        if [ $((SECONDS - since[$n])) -ge "${LOST_AFTER:-10}" ]; then
          grep -qx "$n" "$run/lost" 2>/dev/null || echo "$n" >> "$run/lost"
          [ "$ft" = 1 ] && continue
          echo "cluster.sh: $n has had no process for ${LOST_AFTER:-10} s; stopping the job" >&2
          kill -TERM "$pid" 2>/dev/null; sleep 2; kill -KILL "$pid" 2>/dev/null
          return
        fi
      else
        unset "since[$n]"
      fi
    done
    sleep 0.5
  done
}

report_lost() {  # name the ranks of the nodes the job lost; non-zero when it lost any (a
  # fault-tolerant launch, $4 = 1: mpirun's own status, the survivors having gone on)
  local run=$1 nodes=$2 rc=$3 ft=${4:-0} n lost=""
  for n in $nodes; do  # Open MPI names the node it lost a daemon on (and may still exit 0)
    # (Open MPI prints the report on stdout or stderr: both are read)
    if cat "$run/stdout" "$run/stderr" | grep -q "lost communication with a remote daemon\|daemon failed to report back" &&
       cat "$run/stdout" "$run/stderr" | grep -q "\(Remote daemon\|Remote host\):.* $n\b"; then
      lost="$lost $n"
    elif grep -qx "$n" "$run/lost" 2>/dev/null; then
      lost="$lost $n"
    fi
  done
  [ -z "$lost" ] && return "$rc"
  for n in $lost; do
    echo "cluster.sh: the job lost node $n: MPI rank(s) $(sort -n "$run/ranks.$n" 2>/dev/null | paste -sd, || echo unknown) gone" >&2
  done
  [ "$ft" = 1 ] && return "$rc"
  [ "$rc" != 0 ] && return "$rc"
  return 1
}

cmd_exec() {
  need_root
  nodes_up >/dev/null
  local n
  n=$(resolve_node "$NODE_ARG")
  [ ${#REST[@]} -gt 0 ] || die "exec: give a command after --"
  exec ip netns exec "$n" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$n" "${REST[@]}"
}

cmd_kill() {
  need_root
  nodes_up >/dev/null
  local n pids
  n=$(resolve_node "$NODE_ARG")
  pids=$(ip netns pids "$n" | tr '\n' ' ')
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  echo "cluster $NAME: killed ${pids:-no processes} on $n"
}

cmd_status() {
  need_root
  local n
  for n in $(nodes_up); do
    echo "$n: $(ip -n "$n" -4 -o addr show dev eth0 | awk '{print $4}')," \
         "$(ip netns pids "$n" | wc -l) processes, qdisc: $(ip netns exec "$n" tc qdisc show dev eth0 | head -1 | cut -d' ' -f2,8-9)"
  done
}

case $CMD in
  up) cmd_up ;;
  run) cmd_run ;;
  exec) cmd_exec ;;
  kill) cmd_kill ;;
  status) cmd_status ;;
  down) need_root; teardown; echo "cluster $NAME: down" ;;
  *) usage ;;
esac
