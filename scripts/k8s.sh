#!/usr/bin/env bash
# A real one-node Kubernetes 1.20 cluster: `scripts/k8s.sh up|down|build`.
#
#   control plane: etcd (Debian's etcd-server) -> kube-apiserver -> kube-controller-manager
#     -> kube-scheduler, TLS from an openssl CA made under the run dir;
#   the node: containerd 1.6 + runc + the bridge/host-local CNI plugins (Debian's), the kubelet and
#     kube-proxy (iptables mode), and a device plugin advertising fake GPUs and MIG slices
#     (nvidia.com/gpu, nvidia.com/mig-<profile>) through the kubelet's device-plugin API, and hands each
#     container the chosen devices' nodes (fake character devices the plugin makes under $RUN/dev).
#
# Everything runs inside one network namespace and one private mount namespace that `up` creates
# and bind-mounts under $RUN/ns (no name in /run/netns). The network namespace holds only lo and a
# veth pair whose two ends both stay inside (the node IP); pods get a CNI bridge, Services a
# route; every iptables rule the kubelet, kube-proxy and CNI write lives there. Nothing in it
# reaches another address: there is no default route and no link out. The mount namespace puts
# private directories over /run and /var (containerd's and the kubelet's hard-wired paths) and
# files over the /proc/sys entries the kubelet would otherwise set host-wide. Pods' cgroups go
# under $CGROUP_ROOT.
#
# Two things cross the namespace boundary, each as a Unix socket relayed by socat: the API server
# (127.0.0.1:$API_PORT inside) is published on the host's 127.0.0.1:$API_PORT, and the registry
# stack's port (127.0.0.1:5090 on the host) is published on the node's 127.0.0.1:5090, where
# containerd pulls the workload image with the credentials of the pod's image pull secret.
#
# Binaries are built once per machine (scripts/lib-k8s-build.sh; 8-15 min) and cached in
# $GPUFERRY_CACHE/k8s. `up` is idempotent; `down` stops what `up` started (by pid, then every process
# left in the node's namespaces or cgroups), removes the namespaces, the cgroups, the device nodes and
# the cluster's state, and keeps the cached binaries and containerd's image store. Settings: $RUN/env.
set -euo pipefail

GPUFERRY_CACHE=${GPUFERRY_CACHE:-$HOME/.cache/gpuferry}
GPUFERRY_STACKS=${GPUFERRY_STACKS:-$GPUFERRY_CACHE/stacks}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RUN=$GPUFERRY_STACKS/k8s
PKI=$RUN/pki
PIDS=$RUN/pids
LOGS=$RUN/log
CONF=$RUN/conf
NS=$RUN/ns        # the namespaces' bind mounts: $NS/net, $NS/mnt
NSFS=$RUN/nsfs    # what the node's mount namespace sees at /run and /var
SOCKS=$RUN/sock   # the relays' Unix sockets

K8S_VERSION=v1.20.2                         # what Debian bookworm's source package builds
K8S=$GPUFERRY_CACHE/k8s
SRC=$K8S/src
BIN=$K8S/bin-$K8S_VERSION
# The host port of the API server; inside the node's network namespace the same port. The etcd ports
# are inside the namespace only.
API_PORT=${GPUFERRY_K8S_API_PORT:-16443}
ETCD_PORT=${GPUFERRY_K8S_ETCD_PORT:-22379}
ETCD_PEER_PORT=${GPUFERRY_K8S_ETCD_PEER_PORT:-22380}
ETCD_METRICS_PORT=${GPUFERRY_K8S_ETCD_METRICS_PORT:-22381}
NODE=${GPUFERRY_K8S_NODE:-gpu-node-1}
NODE_GPUS=${GPUFERRY_K8S_NODE_GPUS:-4}
NODE_MIG_PROFILE=${GPUFERRY_K8S_NODE_MIG_PROFILE:-1g.10gb}
NODE_MIG_COUNT=${GPUFERRY_K8S_NODE_MIG_COUNT:-7}
# Addresses inside the node's network namespace (not on the host; apart from the slurm stack's 10.231.x).
NODE_IP=${GPUFERRY_K8S_NODE_IP:-10.77.0.10}          # on a /24
POD_CIDR=${GPUFERRY_K8S_POD_CIDR:-10.75.0.0/24}
SERVICE_CIDR=${GPUFERRY_K8S_SERVICE_CIDR:-10.76.0.0/24}
NODE_IFACE=${GPUFERRY_K8S_NODE_IFACE:-gfk8s0}        # the veth end holding NODE_IP (its peer: <name>p)
BRIDGE=${GPUFERRY_K8S_BRIDGE:-gfk8sbr0}              # the pods' CNI bridge
CGROUP_ROOT=${GPUFERRY_K8S_CGROUP_ROOT:-/gpuferry-k8s}
REGISTRY_ENV=$GPUFERRY_STACKS/registry/env
PAUSE_IMAGE=gpuferry.local/pause:3.4

log() { printf '[k8s.sh] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---- processes, by pid file (and the process's name, as pids are reused) -------------------------
# shellcheck source=scripts/lib.sh
source "$HERE/lib.sh"

# start_bg NAME COMM COMMAND... : start COMMAND in the background unless NAME's pid file is alive.
start_bg() {
  local name=$1 comm=$2
  shift 2
  if pid_alive "$PIDS/$name.pid" "$comm"; then return 0; fi
  log "starting $name"
  setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1 &
  echo $! >"$PIDS/$name.pid"
}

# "${IN_NODE[@]}" COMMAND...: run COMMAND inside the node's network and mount namespaces.
IN_NODE=(nsenter --net="$NS/net" --mount="$NS/mnt" --)
in_node() { "${IN_NODE[@]}" "$@"; }

install_packages() {  # install_packages LOGFILE PKG...
  local logfile=$1 missing=() p
  shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # No service starts at install (containerd's postinst would): policy-rc.d answers "not now".
  local policy=/usr/sbin/policy-rc.d made_policy=""
  if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; made_policy=1; fi
  local rc=0
  apt-get -o DPkg::Lock::Timeout=900 install -y --no-install-recommends "${missing[@]}" >>"$logfile" 2>&1 || {
    apt-get -o DPkg::Lock::Timeout=900 update >>"$logfile" 2>&1
    apt-get -o DPkg::Lock::Timeout=900 install -y --no-install-recommends "${missing[@]}" >>"$logfile" 2>&1 || rc=1
  }
  [[ -z $made_policy ]] || rm -f "$policy"
  ((rc == 0)) || { tail -n 30 "$logfile" >&2; die "apt-get install failed"; }
}

# shellcheck source=scripts/lib-k8s-build.sh
source "$HERE/lib-k8s-build.sh"
# shellcheck source=scripts/lib-k8s-node.sh
source "$HERE/lib-k8s-node.sh"

# ---- the cluster ---------------------------------------------------------------------------------
api_ready() {
  curl -fsS --max-time 3 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz" 2>/dev/null | grep -q ok
}

kget() { "$BIN/kubectl" --kubeconfig "$PKI/admin.kubeconfig" --request-timeout=5s "$@"; }

node_ready() {  # registered, Ready, without the not-ready taint, and its devices advertised
  local out want="True $NODE_GPUS $NODE_MIG_COUNT"
  out=$(kget get node "$NODE" -o "jsonpath={.status.conditions[?(@.type==\"Ready\")].status} \
{.status.allocatable.nvidia\\.com/gpu} {.status.allocatable.nvidia\\.com/mig-${NODE_MIG_PROFILE//./\\.}} {.spec.taints}") || return 1
  [[ $out == "$want"* && $out != *not-ready* ]]
}

start_control_plane() {
  start_bg etcd etcd "${IN_NODE[@]}" /usr/bin/etcd --name gpuferry --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "gpuferry=http://127.0.0.1:$ETCD_PEER_PORT" --listen-metrics-urls "http://127.0.0.1:$ETCD_METRICS_PORT"
  wait_for 60 "$LOGS/etcd.log" "etcd healthy" in_node etcdctl --endpoints "http://127.0.0.1:$ETCD_PORT" endpoint health

  start_bg kube-apiserver kube-apiserver "${IN_NODE[@]}" "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --advertise-address="$NODE_IP" --secure-port="$API_PORT" --insecure-port=0 \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" --client-ca-file="$PKI/ca.crt" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority="$PKI/ca.crt" --kubelet-preferred-address-types=InternalIP \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --service-node-port-range=30000-32767 \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction --allow-privileged=true \
    --enable-priority-and-fairness=false --endpoint-reconciler-type=none --profiling=false
  # The API server on the host's loopback: host 127.0.0.1:API_PORT -> socket -> the node's 127.0.0.1:API_PORT.
  start_bg api-relay-node socat "${IN_NODE[@]}" socat "UNIX-LISTEN:$SOCKS/api.sock,fork,unlink-early" "TCP:127.0.0.1:$API_PORT"
  start_bg api-relay-host socat socat "TCP-LISTEN:$API_PORT,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$SOCKS/api.sock"
  wait_for 120 "$LOGS/kube-apiserver.log" "kube-apiserver ready (through the host relay)" api_ready

  # Node lifecycle stays ON: it removes the not-ready taint admission puts on a new node.
  start_bg kube-controller-manager kube-controller "${IN_NODE[@]}" "$BIN/kube-controller-manager" \
    --kubeconfig="$PKI/admin.kubeconfig" --authentication-kubeconfig="$PKI/admin.kubeconfig" \
    --authorization-kubeconfig="$PKI/admin.kubeconfig" --use-service-account-credentials=true \
    --bind-address=127.0.0.1 --secure-port=0 --port=0 --leader-elect=false --profiling=false \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key"
  start_bg kube-scheduler kube-scheduler "${IN_NODE[@]}" "$BIN/kube-scheduler" --kubeconfig="$PKI/admin.kubeconfig" \
    --authentication-kubeconfig="$PKI/admin.kubeconfig" --authorization-kubeconfig="$PKI/admin.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port=0 --port=0 --leader-elect=false --profiling=false
  wait_for 90 "$LOGS/kube-controller-manager.log" "the default ServiceAccount" kget get serviceaccount default
}

# The registry stack's port, inside the node at the same address (containerd pulls from there).
registry_address() { [[ -s $REGISTRY_ENV ]] && sed -n 's/^REGISTRY_URL=//p' "$REGISTRY_ENV" | head -n1; }

start_registry_relay() {
  local address port
  address=$(registry_address) || true
  if [[ -z $address ]]; then
    log "the registry stack is not up: the node cannot pull the workload image (\`make registry-up\`, then \`make k8s-up\`)"
    return 0
  fi
  [[ $address == 127.0.0.1:* ]] || die "the registry stack's REGISTRY_URL=$address is not on 127.0.0.1"
  port=${address##*:}
  write_registry_host "$address"
  start_bg registry-relay-host socat socat "UNIX-LISTEN:$SOCKS/registry.sock,fork,unlink-early" "TCP:127.0.0.1:$port"
  start_bg registry-relay-node socat "${IN_NODE[@]}" socat "TCP-LISTEN:$port,bind=127.0.0.1,fork,reuseaddr" \
    "UNIX-CONNECT:$SOCKS/registry.sock"
}

start_node() {
  start_bg containerd containerd "${IN_NODE[@]}" /usr/bin/containerd --config "$CONF/containerd.toml"
  wait_for 60 "$LOGS/containerd.log" "containerd" in_node ctr --address "$RUN/containerd/containerd.sock" version
  import_pause_image
  # No instance-metadata lookups (the kubelet's AWS credential provider would wait on one).
  start_bg kubelet kubelet "${IN_NODE[@]}" env AWS_EC2_METADATA_DISABLED=true "$BIN/kubelet" --config="$CONF/kubelet.yaml" \
    --kubeconfig="$PKI/kubelet.kubeconfig" --container-runtime=remote \
    --container-runtime-endpoint="unix://$RUN/containerd/containerd.sock" --containerd="$RUN/containerd/containerd.sock" \
    --runtime-request-timeout=5m --pod-infra-container-image="$PAUSE_IMAGE" \
    --hostname-override="$NODE" --node-ip="$NODE_IP"
  start_bg kube-proxy kube-proxy "${IN_NODE[@]}" "$BIN/kube-proxy" --config="$CONF/kube-proxy.yaml"
  start_bg fake-gpu-plugin fake-gpu-plugin "${IN_NODE[@]}" "$PLUGIN_BIN" --gpus="$NODE_GPUS" --mig-profile="$NODE_MIG_PROFILE" \
    --mig-count="$NODE_MIG_COUNT" --node="$NODE" --dev-root="$RUN/dev"
  wait_for 180 "$LOGS/kubelet.log" "node $NODE Ready, untainted, its GPUs advertised" node_ready
}

write_env() {
  cat >"$RUN/env.tmp" <<ENV
KUBECONFIG=$PKI/admin.kubeconfig
K8S_VERSION=$K8S_VERSION
K8S_NODE=$NODE
K8S_API_URL=https://127.0.0.1:$API_PORT
K8S_CA_FILE=$PKI/ca.crt
K8S_CLIENT_CERT=$PKI/admin.crt
K8S_CLIENT_KEY=$PKI/admin.key
K8S_NODE_GPUS=$NODE_GPUS
K8S_NODE_MIG_RESOURCE=nvidia.com/mig-$NODE_MIG_PROFILE
K8S_NODE_MIG_COUNT=$NODE_MIG_COUNT
K8S_KUBECTL=$BIN/kubectl
K8S_NODE_NETNS=$NS/net
K8S_NODE_MNTNS=$NS/mnt
K8S_CGROUP_ROOT=$CGROUP_ROOT
K8S_PAUSE_IMAGE=$PAUSE_IMAGE
K8S_NODE_IP=$NODE_IP
K8S_POD_CIDR=$POD_CIDR
K8S_SERVICE_CIDR=$SERVICE_CIDR
K8S_NODE_REGISTRY=$(registry_address || true)
ENV
  mv "$RUN/env.tmp" "$RUN/env"
}

# A stack started by an earlier version of this script (control plane on the host's loopback, the
# Python kubelet stand-in) holds the API port: stop it first.
stop_legacy() {
  [[ -e $PIDS/kubelet-standin.pid ]] || return 0
  log "stopping the k8s stack an earlier version of this script started (kubelet stand-in)"
  stop_pid "$PIDS/kubelet-standin.pid" python
  stop_pid "$PIDS/kube-scheduler.pid" kube-scheduler
  stop_pid "$PIDS/kube-controller-manager.pid" kube-controller
  stop_pid "$PIDS/kube-apiserver.pid" kube-apiserver
  stop_pid "$PIDS/etcd.pid" etcd
  rm -rf "$RUN/etcd" "$RUN/kubelet"
}

up() {
  case $RUN/ in /run/* | /var/run/* | /var/*) die "GPUFERRY_STACKS=$GPUFERRY_STACKS: the node hides /run and /var; use another directory" ;; esac
  mkdir -p "$RUN" "$PIDS" "$LOGS" "$CONF" "$SOCKS"
  stop_legacy
  build
  install_packages "$LOGS/apt.log" etcd-server etcd-client openssl curl socat iptables conntrack \
    containerd runc containernetworking-plugins
  make_pki
  namespaces_up
  write_node_config
  start_control_plane
  start_registry_relay
  start_node
  write_env
  log "up: KUBECONFIG=$PKI/admin.kubeconfig ($K8S_VERSION, node $NODE at $NODE_IP); settings in $RUN/env"
}

down() {
  rm -f "$RUN/env"
  stop_legacy
  local name
  # The node's daemons, then the control plane, each by its pid file; pods keep running without them
  # and go with everything else left inside the node when its namespaces are taken down.
  for name in fake-gpu-plugin kube-proxy kubelet containerd; do stop_pid "$PIDS/$name.pid" "$name"; done
  for name in registry-relay-node registry-relay-host api-relay-host api-relay-node; do stop_pid "$PIDS/$name.pid" socat; done
  stop_pid "$PIDS/kube-scheduler.pid" kube-scheduler
  stop_pid "$PIDS/kube-controller-manager.pid" kube-controller
  stop_pid "$PIDS/kube-apiserver.pid" kube-apiserver
  stop_pid "$PIDS/etcd.pid" etcd
  namespaces_down
  rm -rf "$RUN/etcd" "$RUN/dev"   # the next `up` starts from an empty cluster, its plugin makes the nodes again
}

case ${1:-} in
  up) up ;;
  down) down ;;
  build) mkdir -p "$K8S"; build ;;
  *) echo "usage: $0 up|down|build" >&2; exit 2 ;;
esac
