# Sourced by scripts/k8s.sh: the cluster's certificates, the node's namespaces and configuration
# files, and taking it all down again without a trace on the host.
# Needs the settings of scripts/k8s.sh (RUN, PKI, CONF, NS, NSFS, SOCKS, NODE*, *_CIDR, ...), log, die.

cidr_host() {  # cidr_host CIDR N: the network's N-th address (10.76.0.0/24 1 -> 10.76.0.1)
  python3 -c 'import ipaddress, sys; print(ipaddress.ip_network(sys.argv[1])[int(sys.argv[2])])' "$1" "$2"
}

# ---- certificates ------------------------------------------------------------------------------
# Each file is made when missing (a run dir of an older version of this script gets the new ones);
# a serving certificate whose names changed (other addresses) is made again. Kubeconfigs are
# rewritten on every `up` (the API port may have changed).
sign() {  # sign NAME SUBJECT EXTENSIONS: NAME.key + NAME.crt signed by the CA
  local name=$1 subject=$2 ext=$3
  if [[ -s $name.crt && -s $name.ext && $(<"$name.ext") == "$ext" ]]; then return 0; fi
  printf '%s\n' "$ext" >"$name.ext"
  [[ -s $name.key ]] || openssl genrsa -out "$name.key" 2048 2>/dev/null
  openssl req -new -key "$name.key" -out "$name.csr" -subj "$subject" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$name.crt.tmp" -days 3650 \
    -extfile "$name.ext" 2>/dev/null
  mv "$name.crt.tmp" "$name.crt"
}

kubeconfig() {  # kubeconfig CERT_NAME OUT
  b64() { base64 -w0 <"$1"; }
  put "$2" <<KC
apiVersion: v1
kind: Config
clusters:
- name: gpuferry
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $(b64 ca.crt)
users:
- name: $1
  user:
    client-certificate-data: $(b64 "$1.crt")
    client-key-data: $(b64 "$1.key")
contexts:
- name: gpuferry
  context: {cluster: gpuferry, user: $1, namespace: default}
current-context: gpuferry
KC
}

make_pki() {
  mkdir -p "$PKI"
  (
    cd "$PKI"
    umask 077
    if [[ ! -s ca.crt ]]; then
      openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj "/CN=gpuferry-k8s-ca" 2>/dev/null
    fi
    local server='basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth' client='basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth'
    sign apiserver "/CN=kube-apiserver" "$server
subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:$(cidr_host "$SERVICE_CIDR" 1),IP:$NODE_IP"
    sign kubelet-serving "/CN=$NODE" "$server
subjectAltName=DNS:$NODE,IP:$NODE_IP"
    sign admin "/O=system:masters/CN=gpuferry-admin" "$client"
    sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client"
    sign kubelet "/O=system:nodes/CN=system:node:$NODE" "$client"
    sign kube-proxy "/CN=system:kube-proxy" "$client"   # bound to system:node-proxier by default
    if [[ ! -s sa.pub ]]; then
      openssl genrsa -out sa.key 2048 2>/dev/null
      openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    fi
    kubeconfig admin admin.kubeconfig
    kubeconfig kubelet kubelet.kubeconfig
    kubeconfig kube-proxy kube-proxy.kubeconfig
  )
}

# ---- the node's namespaces -----------------------------------------------------------------------
mounted() { findmnt -rn -M "$1" >/dev/null 2>&1; }

# The kernel tunables the kubelet sets at start (pkg/kubelet/cm/container_manager_linux.go,
# setupKernelTunables), each host-wide, with the values it wants. Inside the node a file holding that
# value is mounted over each: the kubelet finds it set and writes nothing.
KUBELET_SYSCTLS=(vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1
                 kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000)

namespaces_up() {
  if mounted "$NS/net" && mounted "$NS/mnt"; then return 0; fi
  namespaces_down   # what a half-made or a crashed earlier run left
  log "creating the node's network and mount namespaces ($NS)"
  rm -rf "$RUN/sysctl"
  mkdir -p "$NS" "$NSFS/run" "$NSFS/var/lib" "$NSFS/var/log" "$NSFS/var/tmp" "$RUN/sysctl"
  ln -sfn /run "$NSFS/var/run"
  ln -sfn /run/lock "$NSFS/var/lock"
  chmod 1777 "$NSFS/var/tmp"
  local s f sysctls=()
  for s in "${KUBELET_SYSCTLS[@]}"; do
    f=${s%%=*}
    mkdir -p "$(dirname "$RUN/sysctl/$f")"
    echo "${s#*=}" >"$RUN/sysctl/$f"
    sysctls+=("$f")
  done
  # A namespace file can be bind-mounted only onto a mount whose propagation is private.
  mounted "$NS" || mount --bind "$NS" "$NS"
  mount --make-private "$NS"
  : >"$NS/net"
  : >"$NS/mnt"
  local prefix=${NODE_IP_PREFIX:-24}
  unshare --net="$NS/net" --mount="$NS/mnt" --propagation private -- bash -euc '
    ip link set lo up
    ip link add "$1" type veth peer name "$1p"   # no dummy interfaces on this kernel; both ends stay here
    ip addr add "$2/$3" dev "$1"
    ip link set "$1" up
    ip link set "$1p" up
    ip route add "$4" dev "$1"                     # the Service CIDR (kube-proxy DNATs it); no default route
    mount --bind "$5/run" /run
    mount --bind "$5/var" /var
    for f in "${@:7}"; do mount --bind "$6/$f" "/proc/sys/$f"; done
  ' _ "$NODE_IFACE" "$NODE_IP" "$prefix" "$SERVICE_CIDR" "$NSFS" "$RUN/sysctl" "${sysctls[@]}" \
    || { namespaces_down; die "could not create the node's namespaces"; }
  cgroups_up
}

# The kubelet's cgroup root must exist in every v1 hierarchy (pods go below it).
cgroup_dirs() {
  local h
  for h in /sys/fs/cgroup/*/; do
    if [[ -e ${h}cgroup.procs ]]; then echo "${h%/}$CGROUP_ROOT"; fi
  done
}

cgroups_up() {
  local d
  for d in $(cgroup_dirs); do
    if [[ $d != */unified/* ]]; then mkdir -p "$d"; fi
  done
}

# Every process inside the node: in its network or mount namespace, or in its cgroups.
node_pids() {
  local net="" mnt="" p d
  mounted "$NS/net" && net="net:[$(stat -L -c %i "$NS/net")]"
  mounted "$NS/mnt" && mnt="mnt:[$(stat -L -c %i "$NS/mnt")]"
  {
    if [[ -n $net || -n $mnt ]]; then
      for p in /proc/[0-9]*; do
        local n m
        n=$(readlink "$p/ns/net" 2>/dev/null) || continue
        m=$(readlink "$p/ns/mnt" 2>/dev/null) || continue
        if [[ -n $net && $n == "$net" ]] || [[ -n $mnt && $m == "$mnt" ]]; then echo "${p#/proc/}"; fi
      done
    fi
    for d in $(cgroup_dirs); do
      if [[ -d $d ]]; then find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null; fi
    done
  } | sort -un
}

# stop_pods: SIGKILL every process left inside the node (pods, shims, ...), until none is.
stop_pods() {
  local pids i
  for i in $(seq 1 100); do
    pids=$(node_pids)
    [[ -z $pids ]] && return 0
    ((i == 1)) && log "stopping $(wc -w <<<"$pids") processes left in the node"
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    sleep 0.1
  done
  die "processes still in the node after SIGKILL: $(node_pids | tr '\n' ' ')"
}

namespaces_down() {
  stop_pods
  local f
  for f in "$NS/net" "$NS/mnt"; do
    if mounted "$f"; then umount "$f" || die "cannot unmount $f"; fi
  done
  if mounted "$NS"; then umount "$NS" || die "cannot unmount $NS"; fi
  local d i
  for d in $(cgroup_dirs); do
    [[ -d $d ]] || continue
    for i in $(seq 1 50); do   # a cgroup whose last process just died may be busy for a moment
      find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
      [[ -d $d ]] || break
      sleep 0.1
    done
    if [[ -d $d ]]; then die "cannot remove the cgroup $d"; fi
  done
  # With the namespaces gone nothing is mounted below the run dir: what /run and /var held goes.
  if findmnt -rn -o TARGET | grep -q "^$RUN/"; then die "something is still mounted below $RUN: not removing $NSFS"; fi
  rm -rf "$NSFS" "$RUN/containerd/state" "$SOCKS"
  rm -f "$NS/net" "$NS/mnt"
}

# ---- the node's configuration -------------------------------------------------------------------
# put FILE: stdin into FILE, unless FILE holds that already (kube-proxy exits when its config changes).
put() {
  cat >"$1.tmp"
  if cmp -s "$1.tmp" "$1"; then rm -f "$1.tmp"; else mv "$1.tmp" "$1"; fi
}

write_registry_host() {  # write_registry_host 127.0.0.1:PORT: containerd pulls from it over plain HTTP
  mkdir -p "$CONF/certs.d/$1"
  put "$CONF/certs.d/$1/hosts.toml" <<TOML
server = "http://$1"
[host."http://$1"]
  capabilities = ["pull", "resolve"]
TOML
}

write_node_config() {
  mkdir -p "$CONF/cni" "$CONF/certs.d" "$RUN/containerd" "$RUN/cni" "$SOCKS"
  printf '# no nameserver: nothing inside the node resolves names\n' | put "$CONF/resolv.conf"
  put "$CONF/containerd.toml" <<TOML
version = 2
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"
oom_score = 0
[grpc]
  address = "$RUN/containerd/containerd.sock"
[ttrpc]
  address = ""
[debug]
  address = ""
  level = "info"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  # This machine lacks CAP_SYS_RESOURCE: a negative oom_score_adj (pause -998) makes runc init fail.
  restrict_oom_score_adj = true
  max_container_log_line_size = 16384
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$CONF/cni"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$CONF/certs.d"
[plugins."io.containerd.internal.v1.opt"]
  path = "$RUN/containerd/opt"
TOML
  put "$CONF/cni/10-gpuferry.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "gpuferry",
  "plugins": [
    {
      "type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$(cidr_host "$POD_CIDR" 1)"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "/var/lib/cni/networks"
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
  put "$CONF/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $PKI/kubelet-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
cgroupsPerQOS: true
enforceNodeAllocatable: ["pods"]
failSwapOn: false
protectKernelDefaults: false
makeIPTablesUtilChains: true
clusterDomain: cluster.local
resolvConf: $CONF/resolv.conf
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
syncFrequency: 10s
nodeStatusUpdateFrequency: 2s
fileCheckFrequency: 20s
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "5%"
  imagefs.available: "5%"
imageGCHighThresholdPercent: 95
imageGCLowThresholdPercent: 90
maxPods: 50
YAML
  put "$CONF/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: $PKI/kube-proxy.kubeconfig
mode: iptables
clusterCIDR: $POD_CIDR
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
hostnameOverride: $NODE
conntrack:            # all zero: kube-proxy leaves the (host-wide) conntrack sysctls alone
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
iptables:
  masqueradeAll: false
  syncPeriod: 10s
  minSyncPeriod: 1s
YAML
}

import_pause_image() {
  local ctr=(ctr --address "$RUN/containerd/containerd.sock" -n k8s.io)
  if in_node "${ctr[@]}" images ls -q | grep -qxF "$PAUSE_IMAGE"; then return 0; fi
  python3 "$HERE/k8s_pause_image.py" "$BIN/pause" "$PAUSE_IMAGE" "$RUN/pause-image.tar"
  in_node "${ctr[@]}" images import "$RUN/pause-image.tar" >>"$LOGS/containerd.log" 2>&1 \
    || die "importing the pause image failed (log: $LOGS/containerd.log)"
}
