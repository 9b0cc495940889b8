#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this machine, reached over SSH: `scripts/slurm.sh up|down`.
#
#   munged -> slurmdbd (accounting in the MariaDB that runs here)
#   -> slurmctld -> two slurmd on one host (nodes n1, n2; own ports; fake GPUs)
#   + an sshd (own host key, key-only login) = the cluster's login node.
#
# Nodes can join: slurmctld is reached at $CTLD_ADDR (a /32 on the loopback interface, so that
# other network namespaces and hosts routed to this one reach it; slurmctld listens on every
# address), MaxNodeCount leaves room for dynamic nodes, and a node that registers with
# `slurmd -Z --conf "... Feature=joined"` lands in the `joined` partition (a NodeSet by feature),
# never in the default one. blocks/hosts/provider.py joins hosts this way (see README, provisioning).
#
# The cluster has a filesystem and a network of its own: slurmd (and so every job) and the login node's sshd
# (and so every command over SSH) run in a mount and a network namespace.
#   * Files: $CLUSTER_ROOT (/srv) holds the cluster's shared directory ($CLUSTER_ROOT/shared) and its own
#     Python environment ($CLUSTER_ROOT/env: Debian's python3 with the examples' and gpuferry runtime's
#     requirements, not the worker's venv). Those paths do not exist on this machine outside the namespace,
#     so a test that gives the block them proves the orchestrator never reads the cluster's files. The older
#     shared directory ($SHARED, visible to both) stays for the same-host tests.
#   * Network: a veth pair, this machine at $NET.1 and the cluster at $NET.2 (the login node's address and
#     both nodes' NodeAddr), the cluster's default route through this machine: slurmd reaches slurmctld and
#     slurmdbd at $CTLD_ADDR, slurmctld reaches the nodes at $NET.2. The cluster's loopback is its own; the
#     services a job talks to (the s3, mlflow and registry stacks, loopback-only on this machine) are relayed
#     into it on the same addresses ($REACH), as a site's gateway would, and nothing else on this machine's
#     loopback is reachable from a job.
#
# Everything this script writes lives under $GPUFERRY_STACKS/slurm (configs, state, pids, logs,
# keys, the fake GPU device nodes and the "shared filesystem" for job directories); nothing is
# written to /etc. Because there is no /etc/slurm/slurm.conf, EVERY Slurm command must see
# SLURM_CONF (without a config a Slurm client falls back to a DNS SRV lookup of the controller):
#   * here: exported below, before the first Slurm command;
#   * over SSH: the login key's authorized_keys line sets it (environment="SLURM_CONF=...",
#     allowed by the sshd's `PermitUserEnvironment SLURM_CONF`), and the SlurmCluster block also
#     passes it explicitly (its `slurm_conf` field), so both plain `ssh` and the block work;
#   * in jobs: sbatch exports the submitter's environment, SLURM_CONF included.
#
# `up` is idempotent (a second `up` only checks); `down` stops, by pid, only what `up` started and
# leaves the shared MariaDB running (unless `up` had to start it). The connection settings go to
# $GPUFERRY_STACKS/slurm/env. `stop-controller`, `start-controller` and `restart-controller` stop
# (SIGTERM) and start slurmctld alone, for failure drills.
set -euo pipefail

GPUFERRY_CACHE=${GPUFERRY_CACHE:-$HOME/.cache/gpuferry}
GPUFERRY_STACKS=${GPUFERRY_STACKS:-$GPUFERRY_CACHE/stacks}
RUN=$GPUFERRY_STACKS/slurm
ETC=$RUN/etc
PIDS=$RUN/pids
LOGS=$RUN/log
STATE=$RUN/state
SSHDIR=$RUN/ssh
DEV=$RUN/dev
SHARED=$RUN/shared
NS=$RUN/ns                                                   # the cluster's mount namespace (a bound ns file)
CLUSTERFS=$RUN/clusterfs                                     # what the cluster sees at $CLUSTER_ROOT
CLUSTER_ROOT=${GPUFERRY_SLURM_CLUSTER_ROOT:-/srv}
NET=${GPUFERRY_SLURM_CLUSTER_NET:-10.231.5}                   # the cluster's network: this machine .1, the cluster .2
NET_IFACE=${GPUFERRY_SLURM_NET_IFACE:-gfslurm0}              # this machine's end of the veth pair
CLUSTER_ADDR=$NET.2
SOCKS=$RUN/sock                                              # the relays' Unix sockets
# The loopback ports of this machine a job reaches (relayed into the cluster's network on the same port): the s3
# stack (http, https), the mlflow stack and the registry stack, at their scripts' default ports.
REACH=${GPUFERRY_SLURM_CLUSTER_REACHES:-"${GPUFERRY_S3_PORT:-5070} $((${GPUFERRY_S3_PORT:-5070} + 1)) ${GPUFERRY_MLFLOW_PORT:-5075} ${GPUFERRY_REGISTRY_PORT:-5090}"}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

CLUSTER=${GPUFERRY_SLURM_CLUSTER:-gpuferry}
PARTITION=${GPUFERRY_SLURM_PARTITION:-debug}
ACCOUNT=${GPUFERRY_SLURM_ACCOUNT:-gpuferry}
CTLD_PORT=${GPUFERRY_SLURM_CTLD_PORT:-16817}
DBD_PORT=${GPUFERRY_SLURM_DBD_PORT:-16819}
SLURMD_PORT_BASE=${GPUFERRY_SLURM_SLURMD_PORT_BASE:-16820}   # n1 gets +1, n2 +2
SSH_PORT=${GPUFERRY_SLURM_SSH_PORT:-2299}
CTLD_ADDR=${GPUFERRY_SLURM_CTLD_ADDR:-10.231.6.1}            # where joined nodes reach slurmctld
JOIN_PARTITION=${GPUFERRY_SLURM_JOIN_PARTITION:-joined}      # partition (and feature) of joined nodes
MAX_JOINED=${GPUFERRY_SLURM_MAX_JOINED:-64}                  # dynamic nodes at a time
GPUS_PER_NODE=${GPUFERRY_SLURM_GPUS_PER_NODE:-4}
CPUS_PER_NODE=${GPUFERRY_SLURM_CPUS_PER_NODE:-8}              # overcommitted on purpose (throughput)
DB_NAME=${GPUFERRY_SLURM_DB:-gpuferry_slurm_acct_db}          # own DB: accounts/QoS are per database
DB_USER=${GPUFERRY_SLURM_DB_USER:-gpuferry_slurm}
NODES=(n1 n2)
export SLURM_CONF=$ETC/slurm.conf   # before ANY Slurm command (see above)

log() { printf '[slurm.sh] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---- processes, by pid file (and the process's name, as pids are reused) -------------------------
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# ---- install -----------------------------------------------------------------------------------
install_packages() {
  local missing=() p
  for p in munge slurm-wlm slurmctld slurmd slurm-client slurmdbd mariadb-server mariadb-client openssh-server socat; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=900 install -y "${missing[@]}" >"$LOGS/apt.log" 2>&1 || {
    apt-get -o DPkg::Lock::Timeout=900 update >>"$LOGS/apt.log" 2>&1
    apt-get -o DPkg::Lock::Timeout=900 install -y "${missing[@]}" >>"$LOGS/apt.log" 2>&1 || { tail -n 30 "$LOGS/apt.log" >&2; die "apt-get install failed"; }
  }
}

# ---- configs -----------------------------------------------------------------------------------
# write_if_changed FILE MODE < content; returns 0 when the file changed.
write_if_changed() {
  local file=$1 mode=$2 tmp
  tmp=$(mktemp "$file.XXXXXX")
  cat >"$tmp"
  chmod "$mode" "$tmp"
  if [[ -f $file ]] && cmp -s "$tmp" "$file"; then rm -f "$tmp"; return 1; fi
  mv -f "$tmp" "$file"
  return 0
}

use_cgroup() {
  [[ ${GPUFERRY_SLURM_CGROUP:-auto} != 0 ]] && [[ -d /sys/fs/cgroup/memory && -d /sys/fs/cgroup/devices && -d /sys/fs/cgroup/cpuset ]]
}

write_configs() {
  local changed=1 host n i first
  host=$(hostname -s)
  if use_cgroup; then
    PROCTRACK=proctrack/cgroup TASKPLUGIN=task/cgroup JOBACCT=jobacct_gather/cgroup
  else
    PROCTRACK=proctrack/linuxproc TASKPLUGIN=task/none JOBACCT=jobacct_gather/linux
  fi
  {
    cat <<EOF
# Written by scripts/slurm.sh; rewritten by every \`up\`.
ClusterName=$CLUSTER
SlurmctldHost=localhost($CTLD_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPidFile=$PIDS/slurmctld.pid
SlurmdPidFile=$PIDS/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=$PROCTRACK
TaskPlugin=$TASKPLUGIN
JobAcctGatherType=$JOBACCT
JobAcctGatherFrequency=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Fast scheduling for tests (see notes/slurm.md): jobs share nodes, no 3 s batch delay.
DefMemPerCPU=100
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTLD_ADDR
AccountingStoragePort=$DBD_PORT
AccountingStorageTRES=gres/gpu
AccountingStorageEnforce=associations,limits,qos
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
PriorityType=priority/multifactor
PriorityWeightQOS=100000
PriorityWeightAge=100
PreemptType=preempt/qos
PreemptMode=REQUEUE
JobRequeue=1
MaxArraySize=10001
MinJobAge=300
KillWait=5
Waittime=0
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
# Dynamic nodes (slurmd -Z): room for them, and no fan-out through nodes that do not know them.
MaxNodeCount=$((${#NODES[@]} + MAX_JOINED))
TreeWidth=65533
EOF
    i=0
    for n in "${NODES[@]}"; do
      i=$((i + 1))
      echo "NodeName=$n NodeHostname=$host NodeAddr=$CLUSTER_ADDR Port=$((SLURMD_PORT_BASE + i)) CPUs=$CPUS_PER_NODE RealMemory=8000 Gres=gpu:fake:$GPUS_PER_NODE State=UNKNOWN"
    done
    echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
    echo "NodeSet=$JOIN_PARTITION Feature=$JOIN_PARTITION"
    echo "PartitionName=$JOIN_PARTITION Nodes=$JOIN_PARTITION MaxTime=INFINITE State=UP"
  } | write_if_changed "$ETC/slurm.conf" 644 && changed=0

  {
    echo "AutoDetect=off"
    i=0
    for n in "${NODES[@]}"; do
      first=$((i * GPUS_PER_NODE))
      echo "NodeName=$n Name=gpu Type=fake File=$DEV/fakenvidia[$first-$((first + GPUS_PER_NODE - 1))]"
      i=$((i + 1))
    done
  } | write_if_changed "$ETC/gres.conf" 644 && changed=0

  cat <<EOF | write_if_changed "$ETC/cgroup.conf" 644 && changed=0
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=yes
ConstrainDevices=yes
EOF

  cat <<EOF | write_if_changed "$ETC/slurmdbd.conf" 600 && changed=0
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$LOGS/slurmdbd.log
PidFile=$PIDS/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$(<"$ETC/db_password")
StorageLoc=$DB_NAME
EOF
  return $changed
}

make_fake_gpus() {
  local i total=$((GPUS_PER_NODE * ${#NODES[@]}))
  for ((i = 0; i < total; i++)); do
    # Character devices (major 195 = nvidia): a plain file or a Count-only gres leaves the node INVAL.
    [[ -c $DEV/fakenvidia$i ]] || mknod -m 666 "$DEV/fakenvidia$i" c 195 "$i"
  done
}

# ---- the controller's address for joined nodes --------------------------------------------------
# Read the whole listing first: `grep -q` quitting early would fail the pipe (SIGPIPE) under pipefail.
ctld_addr_present() { local addrs; addrs=$(ip -o addr show dev lo) && [[ $addrs == *" inet $CTLD_ADDR/32 "* ]]; }

ensure_ctld_addr() {
  ctld_addr_present && return 0
  ip addr add "$CTLD_ADDR/32" dev lo || die "cannot add $CTLD_ADDR/32 to lo (set GPUFERRY_SLURM_CTLD_ADDR to a free address)"
  log "added $CTLD_ADDR/32 to lo (slurmctld's address for joined nodes)"
}

# ---- the cluster's own filesystem and network: a mount and a network namespace ------------------------
mounted() { findmnt -rn -M "$1" >/dev/null 2>&1; }
ns_ids() { echo "mnt:[$(stat -L -c %i "$NS/mnt")] net:[$(stat -L -c %i "$NS/net")]"; }
in_cluster() { nsenter --mount="$NS/mnt" --net="$NS/net" -- "$@"; }
on_cluster_fs() { nsenter --mount="$NS/mnt" -- "$@"; }   # the cluster's files with this machine's network

namespace_up() {
  if mounted "$NS/mnt" && mounted "$NS/net" && ip link show "$NET_IFACE" >/dev/null 2>&1; then return 0; fi
  namespace_down   # what an older `up` (a mount namespace only) or a half-made one left
  [[ -d $CLUSTER_ROOT ]] || die "$CLUSTER_ROOT does not exist (the cluster's filesystem is mounted there; set GPUFERRY_SLURM_CLUSTER_ROOT to an existing directory)"
  [[ ! -e $CLUSTER_ROOT/shared ]] || die "$CLUSTER_ROOT/shared exists on this machine: the cluster's paths must not (set GPUFERRY_SLURM_CLUSTER_ROOT to another directory)"
  mkdir -p "$NS" "$CLUSTERFS/shared"
  chmod 1777 "$CLUSTERFS/shared"
  # A namespace file can be bind-mounted only onto a mount whose propagation is private.
  mounted "$NS" || mount --bind "$NS" "$NS"
  mount --make-private "$NS"
  : >"$NS/mnt"
  : >"$NS/net"
  unshare --mount="$NS/mnt" --net="$NS/net" --propagation private -- bash -euc '
    ip link set lo up
    mount --bind "$1" "$2"
  ' _ "$CLUSTERFS" "$CLUSTER_ROOT" || { namespace_down; die "could not make the cluster's namespaces"; }
  # The veth pair: this machine's end stays here, the other goes into the cluster as eth0 (moved through a
  # process that holds the namespace for a moment).
  local holder deadline
  nsenter --net="$NS/net" sleep 60 &
  holder=$!
  # `$!` is nsenter's pid before it has entered the namespace: wait until it is inside, or the peer would be
  # made here, where an eth0 already exists ("RTNETLINK answers: File exists").
  deadline=$((SECONDS + 30))
  until [[ $(stat -L -c %i "/proc/$holder/ns/net" 2>/dev/null) == "$(stat -L -c %i "$NS/net")" ]]; do
    kill -0 "$holder" 2>/dev/null && ((SECONDS < deadline)) ||
      { kill "$holder" 2>/dev/null; namespace_down; die "could not enter the cluster's network namespace $NS/net"; }
    sleep 0.05
  done
  ip link add "$NET_IFACE" type veth peer name eth0 netns "$holder" &&
    ip addr add "$NET.1/24" dev "$NET_IFACE" && ip link set "$NET_IFACE" up &&
    nsenter --net="$NS/net" bash -euc '
      ip addr add "$1/24" dev eth0
      ip link set eth0 up
      ip route add default via "$2"
    ' _ "$CLUSTER_ADDR" "$NET.1" ||
    { kill "$holder" 2>/dev/null; namespace_down; die "could not connect the cluster's network ($NET_IFACE, $NET.0/24; set GPUFERRY_SLURM_CLUSTER_NET to a free /24)"; }
  kill "$holder" 2>/dev/null || true
  wait "$holder" 2>/dev/null || true
  log "the cluster: $CLUSTERFS at $CLUSTER_ROOT and $CLUSTER_ADDR, in the namespaces $NS/mnt and $NS/net"
}

namespace_down() {
  local f
  for f in "$NS/mnt" "$NS/net"; do
    if mounted "$f"; then umount "$f" || die "cannot unmount $f"; fi
  done
  if mounted "$NS"; then umount "$NS" || die "cannot unmount $NS"; fi
  # The pair goes with the network namespace once nothing runs in it; an end left behind goes now.
  if ip link show "$NET_IFACE" >/dev/null 2>&1; then ip link del "$NET_IFACE" 2>/dev/null || true; fi
  rm -f "$NS/mnt" "$NS/net"
}

# A daemon started outside the cluster's namespaces (an older `up`, or namespaces made anew) is stopped, to
# start it inside.
outside_namespace() {
  local pid
  pid_alive "$1" "$2" || return 1
  pid=$(<"$1")
  [[ "$(readlink "/proc/$pid/ns/mnt") $(readlink "/proc/$pid/ns/net")" != "$(ns_ids)" ]]
}

# ---- what a job reaches on this machine: relays into the cluster's network ---------------------------------
# For each port in $REACH: inside the cluster, 127.0.0.1:PORT -> a Unix socket -> this machine's 127.0.0.1:PORT
# (connected when a job connects, so the service may come up after this stack).
start_relays() {
  local port
  mkdir -p "$SOCKS"
  for port in $REACH; do
    if outside_namespace "$PIDS/relay-$port-in.pid" socat; then stop_pid "$PIDS/relay-$port-in.pid" socat; fi
    if ! pid_alive "$PIDS/relay-$port-out.pid" socat; then
      start-stop-daemon --start --background --make-pidfile --pidfile "$PIDS/relay-$port-out.pid" --exec /usr/bin/socat -- \
        "UNIX-LISTEN:$SOCKS/$port.sock,fork,unlink-early" "TCP:127.0.0.1:$port"
    fi
    if ! pid_alive "$PIDS/relay-$port-in.pid" socat; then
      wait_for 10 /dev/null "the relay's socket $SOCKS/$port.sock" test -S "$SOCKS/$port.sock"
      start-stop-daemon --start --background --make-pidfile --pidfile "$PIDS/relay-$port-in.pid" \
        --exec /usr/bin/nsenter -- --mount="$NS/mnt" --net="$NS/net" /usr/bin/socat \
        "TCP-LISTEN:$port,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$SOCKS/$port.sock"
    fi
  done
}

stop_relays() {
  local f
  for f in "$PIDS"/relay-*.pid; do [[ -e $f ]] && stop_pid "$f" socat; done
  rm -rf "$SOCKS"
}

# The cluster's Python: Debian's interpreter in a venv of its own, with what the examples and gpuferry's
# runtime (the cluster-side store) import, at the lock's versions. Made once per set of inputs.
cluster_env() {
  local env=$CLUSTER_ROOT/env want uv=${GPUFERRY_UV:-$REPO/.venv/bin/uv}
  want=$(cat "$REPO/requirements.lock" "$REPO"/examples/*/requirements.txt "$REPO/runtime/requirements.txt" | sha256sum | cut -c1-16)
  if [[ -s $CLUSTERFS/env/.inputs && $(<"$CLUSTERFS/env/.inputs") == "$want" ]]; then return 0; fi
  [[ -x $uv ]] || die "uv is needed to make the cluster's Python environment ($uv; run \`make venv\` first)"
  log "making the cluster's Python environment $env (Debian's python3; ~1 min once)"
  local reqs=() f
  for f in "$REPO"/examples/*/requirements.txt "$REPO/runtime/requirements.txt"; do reqs+=(-r "$f"); done
  local links=()
  [[ -d /opt/wheels ]] && links=(--find-links /opt/wheels)
  on_cluster_fs "$uv" venv -q --clear --python /usr/bin/python3 "$env" >"$LOGS/cluster-env.log" 2>&1 &&
    on_cluster_fs "$uv" pip install --python "$env/bin/python" "${links[@]}" -c "$REPO/requirements.lock" \
      "${reqs[@]}" pyyaml >>"$LOGS/cluster-env.log" 2>&1 ||
    { tail -n 20 "$LOGS/cluster-env.log" >&2; die "could not make the cluster's Python environment"; }
  echo "$want" >"$CLUSTERFS/env/.inputs"
}

# ---- daemons -----------------------------------------------------------------------------------
start_munge() {
  # The default socket: slurmctld's connection to slurmdbd ignores AuthInfo=socket= in 22.05.
  # A munged that already serves it (the machine's own) is used as is and left alone by `down`.
  local sock=/run/munge/munge.socket.2
  if pid_alive "$PIDS/munged.pid" munged; then return; fi
  if munge -n -S "$sock" 2>/dev/null | unmunge -S "$sock" >/dev/null 2>&1; then
    log "using the munged already running on $sock"
    return
  fi
  [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  rm -f "$sock" "$sock.lock"
  start-stop-daemon --start --chuid munge:munge --exec /usr/sbin/munged
  wait_for 20 /var/log/munge/munged.log "munged answering" bash -c "munge -n -S '$sock' | unmunge -S '$sock'"
  cp /run/munge/munged.pid "$PIDS/munged.pid"
  log "munged started ($(<"$PIDS/munged.pid"))"
}

mysql_ok() { mysqladmin --connect-timeout=2 ping >/dev/null 2>&1; }

ensure_mariadb() {
  if ! mysql_ok; then
    # Not running (a fresh machine): start it ourselves and stop it again in `down`.
    log "MariaDB is not running; starting it"
    mkdir -p /run/mysqld && chown mysql:root /run/mysqld
    if [[ ! -d /var/lib/mysql/mysql ]]; then mariadb-install-db --user=mysql >"$LOGS/mariadb-install.log" 2>&1; fi
    start-stop-daemon --start --background --make-pidfile --pidfile "$PIDS/mariadbd.pid" --exec /usr/sbin/mariadbd -- \
      --user=mysql --bind-address=127.0.0.1 --log-error="$LOGS/mariadbd.log"
    wait_for 60 "$LOGS/mariadbd.log" "MariaDB answering" mysql_ok
  fi
  [[ -s $ETC/db_password ]] || { (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$ETC/db_password"); }
  local pw
  pw=$(<"$ETC/db_password")
  mysql --batch <<EOF
CREATE DATABASE IF NOT EXISTS \`$DB_NAME\`;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$pw';
ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$pw';
GRANT ALL ON \`$DB_NAME\`.* TO '$DB_USER'@'localhost';
EOF
}

start_slurm() {
  local restart=$1 n
  if [[ $restart == 1 ]]; then
    log "configuration changed: restarting the Slurm daemons"
    for n in "${NODES[@]}"; do stop_pid "$PIDS/slurmd-$n.pid" slurmd; done
    stop_pid "$PIDS/slurmctld.pid" slurmctld
    stop_pid "$PIDS/slurmdbd.pid" slurmdbd
  fi
  if ! pid_alive "$PIDS/slurmdbd.pid" slurmdbd; then
    slurmdbd   # reads slurmdbd.conf next to $SLURM_CONF; daemonizes
    wait_for 60 "$LOGS/slurmdbd.log" "slurmdbd listening on $DBD_PORT" bash -c "echo > /dev/tcp/127.0.0.1/$DBD_PORT"
    log "slurmdbd started ($(<"$PIDS/slurmdbd.pid"))"
  fi
  if ! pid_alive "$PIDS/slurmctld.pid" slurmctld; then
    slurmctld -f "$SLURM_CONF"
    wait_for 60 "$LOGS/slurmctld.log" "slurmctld answering" scontrol ping
    log "slurmctld started ($(<"$PIDS/slurmctld.pid"))"
  fi
  for n in "${NODES[@]}"; do
    if outside_namespace "$PIDS/slurmd-$n.pid" slurmd; then stop_pid "$PIDS/slurmd-$n.pid" slurmd; fi
    if ! pid_alive "$PIDS/slurmd-$n.pid" slurmd; then
      in_cluster slurmd -f "$SLURM_CONF" -N "$n"   # its jobs see the cluster's filesystem
      wait_for 30 "$LOGS/slurmd-$n.log" "slurmd $n running" pid_alive "$PIDS/slurmd-$n.pid" slurmd
      log "slurmd $n started ($(<"$PIDS/slurmd-$n.pid"))"
    fi
  done
}

nodes_idle() {
  local states
  states=$(sinfo -h -N -p "$PARTITION" -o '%N %T' | sort -u)
  [[ $(grep -c . <<<"$states") -eq ${#NODES[@]} ]] || return 1
  ! grep -qvE ' (idle|mixed|allocated|completing)$' <<<"$states"
}

resume_drained() {
  # A node drained by an earlier run keeps that state across restarts (StateSaveLocation).
  local bad
  bad=$(sinfo -h -N -p "$PARTITION" -o '%N %T' | awk '$2 ~ /drain|down|inval|fail/ {print $1}' | sort -u | paste -sd, -)
  if [[ -n $bad ]]; then
    log "resuming nodes $bad"
    scontrol update nodename="$bad" state=resume 2>/dev/null || true
  fi
}

ensure_accounting() {
  local user
  user=$(id -un)
  # sacctmgr's `add` fails when the entry exists; check first so that `up` twice stays quiet.
  sacctmgr -n -P show qos format=name | grep -qx normal || sacctmgr -i add qos normal >/dev/null
  sacctmgr -n -P show qos format=name | grep -qx high ||
    sacctmgr -i add qos high Priority=1000 Preempt=normal PreemptMode=requeue >/dev/null
  sacctmgr -n -P show account format=account | grep -qx "$ACCOUNT" ||
    sacctmgr -i add account "$ACCOUNT" Description=gpuferry Organization=gpuferry >/dev/null
  sacctmgr -n -P show assoc where user="$user" account="$ACCOUNT" format=user | grep -qx "$user" ||
    sacctmgr -i add user "$user" Account="$ACCOUNT" DefaultAccount="$ACCOUNT" >/dev/null
  sacctmgr -n -P show assoc where user="$user" account="$ACCOUNT" format=qos | grep -q high ||
    sacctmgr -i modify user "$user" set qos+=normal,high >/dev/null
}

start_sshd() {
  [[ -s $SSHDIR/host_ed25519_key ]] || ssh-keygen -q -t ed25519 -N '' -C gpuferry-slurm-host -f "$SSHDIR/host_ed25519_key"
  [[ -s $SSHDIR/client_ed25519 ]] || ssh-keygen -q -t ed25519 -N '' -C gpuferry-slurm-client -f "$SSHDIR/client_ed25519"
  printf 'environment="SLURM_CONF=%s" %s\n' "$SLURM_CONF" "$(<"$SSHDIR/client_ed25519.pub")" |
    write_if_changed "$SSHDIR/authorized_keys" 600 || true
  printf '[%s]:%s %s\n' "$CLUSTER_ADDR" "$SSH_PORT" "$(cut -d' ' -f1,2 "$SSHDIR/host_ed25519_key.pub")" |
    write_if_changed "$SSHDIR/known_hosts" 644 || true
  local changed=1
  cat <<EOF | write_if_changed "$SSHDIR/sshd_config" 600 && changed=0
Port $SSH_PORT
ListenAddress $CLUSTER_ADDR
HostKey $SSHDIR/host_ed25519_key
PidFile $PIDS/sshd.pid
AuthorizedKeysFile $SSHDIR/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitUserEnvironment SLURM_CONF
X11Forwarding no
AllowTcpForwarding no
Subsystem sftp internal-sftp
EOF
  if [[ $changed == 0 ]] || outside_namespace "$PIDS/sshd.pid" sshd; then stop_pid "$PIDS/sshd.pid" sshd; fi
  if ! pid_alive "$PIDS/sshd.pid" sshd; then
    mkdir -p /run/sshd
    /usr/sbin/sshd -t -f "$SSHDIR/sshd_config" || die "sshd rejected $SSHDIR/sshd_config"
    in_cluster /usr/sbin/sshd -f "$SSHDIR/sshd_config" -E "$LOGS/sshd.log"   # the login node: the cluster's files
    wait_for 20 "$LOGS/sshd.log" "sshd listening on $SSH_PORT" bash -c "echo > /dev/tcp/$CLUSTER_ADDR/$SSH_PORT"
    log "sshd started ($(<"$PIDS/sshd.pid")) on $CLUSTER_ADDR:$SSH_PORT"
  fi
}

ssh_works() {
  ssh -n -o BatchMode=yes -o UserKnownHostsFile="$SSHDIR/known_hosts" -o StrictHostKeyChecking=yes \
    -o GlobalKnownHostsFile=/dev/null -i "$SSHDIR/client_ed25519" -p "$SSH_PORT" "$(id -un)@$CLUSTER_ADDR" \
    sinfo -h -o %P >/dev/null 2>&1
}

write_env() {
  cat <<EOF | write_if_changed "$RUN/env" 644 || true
SLURM_SSH_HOST=$CLUSTER_ADDR
SLURM_SSH_PORT=$SSH_PORT
SLURM_SSH_USER=$(id -un)
SLURM_SSH_KEY=$SSHDIR/client_ed25519
SLURM_KNOWN_HOSTS=$SSHDIR/known_hosts
SLURM_CONF=$SLURM_CONF
SLURM_PARTITION=$PARTITION
SLURM_ACCOUNT=$ACCOUNT
SLURM_QOS_HIGH=high
SLURM_SHARED_DIR=$SHARED
SLURM_CLUSTER_DIR=$CLUSTER_ROOT/shared
SLURM_CLUSTER_PYTHON=$CLUSTER_ROOT/env/bin/python
SLURM_GPUS_PER_NODE=$GPUS_PER_NODE
SLURM_NODES=${#NODES[@]}
SLURM_CTLD_ADDR=$CTLD_ADDR
SLURM_JOIN_PARTITION=$JOIN_PARTITION
SLURM_JOIN_FEATURE=$JOIN_PARTITION
SLURM_GRES_CONF=$ETC/gres.conf
SLURM_MUNGE_KEY=/etc/munge/munge.key
EOF
}

up() {
  local t0=$SECONDS restart=0
  mkdir -p "$ETC" "$PIDS" "$LOGS" "$STATE/slurmctld" "$SSHDIR" "$DEV" "$SHARED"
  for n in "${NODES[@]}"; do mkdir -p "$STATE/slurmd-$n"; done
  install_packages
  ensure_ctld_addr
  ensure_mariadb
  write_configs && restart=1
  [[ -n $(ls -A "$PIDS" 2>/dev/null) ]] || restart=0   # first start: nothing to restart
  make_fake_gpus
  namespace_up
  start_relays
  cluster_env
  start_munge
  start_slurm "$restart"
  wait_for 60 "$LOGS/slurmctld.log" "nodes registered" bash -c "sinfo -h -N -o %N | grep -q ."
  resume_drained
  wait_for 90 "$LOGS/slurmd-n1.log" "nodes ${NODES[*]} idle in sinfo" nodes_idle
  ensure_accounting
  start_sshd
  wait_for 30 "$LOGS/sshd.log" "an sinfo over SSH" ssh_works
  write_env
  log "up in $((SECONDS - t0)) s; settings in $RUN/env"
}

down() {
  local n
  rm -f "$RUN/env"
  stop_pid "$PIDS/sshd.pid" sshd
  stop_relays
  for n in "${NODES[@]}"; do stop_pid "$PIDS/slurmd-$n.pid" slurmd; done
  stop_pid "$PIDS/slurmctld.pid" slurmctld
  stop_pid "$PIDS/slurmdbd.pid" slurmdbd
  stop_pid "$PIDS/munged.pid" munged
  stop_pid "$PIDS/mariadbd.pid" mariadbd   # only when `up` started it
  if ctld_addr_present; then ip addr del "$CTLD_ADDR/32" dev lo || true; fi
  # Empty cgroup directories slurmd created for its nodes.
  for n in "${NODES[@]}"; do
    find /sys/fs/cgroup/*/slurm_"$n" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  namespace_down
  log "down"
}

# The controller alone, for failure drills (tests): a normal stop (SIGTERM: slurmctld saves its state,
# running jobs survive) and a start with the same command line `up` uses.
stop_controller() {
  pid_alive "$PIDS/slurmctld.pid" slurmctld || die "slurmctld is not running (run \`$0 up\` first)"
  stop_pid "$PIDS/slurmctld.pid" slurmctld
}

start_controller() {
  [[ -f $RUN/env ]] || die "the stack is not up (run \`$0 up\` first)"
  ensure_ctld_addr
  namespace_up
  start_relays
  start_slurm 0
  wait_for 90 "$LOGS/slurmctld.log" "nodes ${NODES[*]} usable in sinfo" nodes_idle
}

case ${1:-} in
  up) up ;;
  down) down ;;
  stop-controller) stop_controller ;;
  start-controller) start_controller ;;
  restart-controller) stop_controller; start_controller ;;
  *) echo "usage: $0 up|down|stop-controller|start-controller|restart-controller" >&2; exit 2 ;;
esac
