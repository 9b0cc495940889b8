#!/usr/bin/env bash
# A real Kubernetes 1.20 control plane on loopback: `scripts/k8s.sh up|down|build`.
#
#   etcd (Debian's etcd-server) -> kube-apiserver -> kube-controller-manager (node lifecycle on)
#   -> kube-scheduler, all on 127.0.0.1, TLS from an openssl CA made under the run dir,
#   + scripts/kubelet_standin.py: registers one GPU node (nvidia.com/gpu and a MIG resource),
#     heartbeats (node status + Lease) and brings the pods scheduled to it to Running/Ready —
#     by running the pod's container with podman when the registry stack's API socket is up,
#     otherwise by writing the status only (no process runs).
#
# No registry ships kube-apiserver for this machine, so `build` compiles it ONCE per machine from
# Debian bookworm's `kubernetes` source package (1.20, whose orig tarball carries vendor/) with
# Debian's golang-go in GOPATH mode; the binaries are cached in $GPUFERRY_CACHE/k8s/bin-<version>.
# The deb-src entries are derived from this machine's own apt sources into a private apt config
# (the system's apt config is not touched). `up` runs `build` when the cache is empty (8-15 min).
#
# `up` is idempotent; `down` stops, by pid, only what `up` started. Settings: $RUN/env
# (KUBECONFIG, K8S_VERSION, K8S_NODE, K8S_API_URL, ...).
set -euo pipefail

GPUFERRY_CACHE=${GPUFERRY_CACHE:-$HOME/.cache/gpuferry}
GPUFERRY_STACKS=${GPUFERRY_STACKS:-$GPUFERRY_CACHE/stacks}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
RUN=$GPUFERRY_STACKS/k8s
PKI=$RUN/pki
PIDS=$RUN/pids
LOGS=$RUN/log

K8S_VERSION=v1.20.2                         # what Debian bookworm's source package builds
K8S=$GPUFERRY_CACHE/k8s
SRC=$K8S/src
BIN=$K8S/bin-$K8S_VERSION
API_PORT=${GPUFERRY_K8S_API_PORT:-16443}
ETCD_PORT=${GPUFERRY_K8S_ETCD_PORT:-22379}
ETCD_PEER_PORT=${GPUFERRY_K8S_ETCD_PEER_PORT:-22380}
ETCD_METRICS_PORT=${GPUFERRY_K8S_ETCD_METRICS_PORT:-22381}
NODE=${GPUFERRY_K8S_NODE:-gpu-node-1}
NODE_GPUS=${GPUFERRY_K8S_NODE_GPUS:-4}
NODE_MIG_PROFILE=${GPUFERRY_K8S_NODE_MIG_PROFILE:-1g.10gb}
NODE_MIG_COUNT=${GPUFERRY_K8S_NODE_MIG_COUNT:-7}
PYTHON=${GPUFERRY_PYTHON:-$ROOT/.venv/bin/python}

log() { printf '[k8s.sh] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---- processes, by pid file (and the process's name, as pids are reused) -------------------------
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# start_bg NAME COMM COMMAND... : start COMMAND in the background unless NAME's pid file is alive.
start_bg() {
  local name=$1 comm=$2
  shift 2
  if pid_alive "$PIDS/$name.pid" "$comm"; then return 0; fi
  log "starting $name"
  setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1 &
  echo $! >"$PIDS/$name.pid"
}

install_packages() {  # install_packages LOGFILE PKG...
  local logfile=$1 missing=() p
  shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=900 install -y "${missing[@]}" >>"$logfile" 2>&1 || {
    apt-get -o DPkg::Lock::Timeout=900 update >>"$logfile" 2>&1
    apt-get -o DPkg::Lock::Timeout=900 install -y "${missing[@]}" >>"$logfile" 2>&1 || { tail -n 30 "$logfile" >&2; die "apt-get install failed"; }
  }
}

# ---- build (once per machine) --------------------------------------------------------------------
# deb-src entries for bookworm, derived from the machine's own apt sources (deb822 and one-line).
write_deb_src() {  # write_deb_src OUTFILE
  python3 - "$1" <<'PY'
import glob, re, sys
suite_ok = re.compile(r"^bookworm(-updates|-security)?$")
out = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields, key = {}, None
        for line in stanza.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line[0] in " \t" and key:
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
            continue
        suites = [s for s in fields.get("suites", "").split() if suite_ok.match(s)]
        if not suites or not fields.get("uris"):
            continue
        for uri in fields["uris"].split():
            opts = f"[signed-by={fields['signed-by']}] " if fields.get("signed-by", "").startswith("/") else ""
            for s in suites:
                out.append(f"deb-src {opts}{uri} {s} {fields.get('components', 'main')}")
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"^\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line)
        if m and suite_ok.match(m.group(3)):
            out.append(f"deb-src {m.group(1) or ''}{m.group(2)} {m.group(3)} {m.group(4)}")
if not out:
    sys.exit("no bookworm deb entries in this machine's apt sources to derive deb-src entries from")
open(sys.argv[1], "w").write("\n".join(dict.fromkeys(out)) + "\n")
PY
}

fetch_source() {
  local apt=$K8S/apt
  if compgen -G "$SRC/kubernetes_*.orig.tar.gz" >/dev/null; then return 0; fi
  mkdir -p "$apt/lists/partial" "$SRC"
  write_deb_src "$apt/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$apt/lists")
  log "fetching Debian's kubernetes source package into $SRC"
  apt-get "${opts[@]}" update >>"$K8S/build.log" 2>&1 || { tail -n 20 "$K8S/build.log" >&2; die "apt-get update (deb-src) failed"; }
  (cd "$SRC" && apt-get "${opts[@]}" source --download-only kubernetes) >>"$K8S/build.log" 2>&1 \
    || { tail -n 20 "$K8S/build.log" >&2; die "apt-get source kubernetes failed"; }
}

build() {
  if [[ -f $BIN/.complete ]]; then return 0; fi
  mkdir -p "$K8S"
  # One build per machine at a time; the lock's fd is not inherited by the daemons `up` starts.
  ( log "taking the build lock ($K8S/build.lock)"; flock 9; build_locked ) 9>"$K8S/build.lock"
}

build_locked() {
  if [[ -f $BIN/.complete ]]; then return 0; fi
  local started=$SECONDS
  install_packages "$K8S/build.log" golang-go make etcd-server etcd-client openssl
  fetch_source
  local tarball W tree
  tarball=$(ls "$SRC"/kubernetes_*.orig.tar.gz | head -n1)
  W=$K8S/build
  rm -rf "$W/gopath" "$W"/kubernetes-*
  mkdir -p "$W/gopath/src/k8s.io" "$W/home" "$BIN"
  log "building $K8S_VERSION from $(basename "$tarball") (8-15 min on 2 cores; log: $K8S/build.log)"
  tar xzf "$tarball" -C "$W"
  tree=$(ls -d "$W"/kubernetes-*/ | head -n1)
  ln -sfn "${tree%/}" "$W/gopath/src/k8s.io/kubernetes"
  (
    # Kubernetes 1.20 builds in GOPATH mode (hack/lib/init.sh sets GO111MODULE=off).
    export GOCACHE=$W/gocache GOPATH=$W/gopath GOFLAGS= CGO_ENABLED=0 GOPROXY=off GO111MODULE=off HOME=$W/home
    cd "$W/gopath/src/k8s.io/kubernetes"
    make gen_openapi   # pkg/generated/openapi is not in the tarball
    ld="-s -w"
    for p in k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
      ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=20 -X $p.gitTreeState=clean"
      ld+=" -X $p.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    done
    for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
      t0=$SECONDS
      go build -trimpath -ldflags "$ld" -o "$BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c"
      mv "$BIN/$c.tmp" "$BIN/$c"
      echo "built $c in $((SECONDS - t0))s"
    done
  ) >>"$K8S/build.log" 2>&1 || { tail -n 40 "$K8S/build.log" >&2; die "building Kubernetes failed (log: $K8S/build.log)"; }
  basename "$tarball" >"$BIN/SOURCE"
  touch "$BIN/.complete"
  log "built in $((SECONDS - started))s; binaries in $BIN"
  rm -rf "$W"   # the tree and the Go cache (~1.8 GB) are not needed any more
}

# ---- certificates ------------------------------------------------------------------------------
make_pki() {
  [[ -s $PKI/admin.kubeconfig ]] && return 0
  mkdir -p "$PKI"
  (
    cd "$PKI"
    umask 077
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj "/CN=gpuferry-k8s-ca" 2>/dev/null
    cat >apiserver.ext <<EXT
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.0.0.1
EXT
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver" 2>/dev/null
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 3650 -extfile apiserver.ext 2>/dev/null
    printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >client.ext
    openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=gpuferry-admin" 2>/dev/null
    openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out admin.crt -days 3650 -extfile client.ext 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    b64() { base64 -w0 <"$1"; }
    cat >admin.kubeconfig.tmp <<KC
apiVersion: v1
kind: Config
clusters:
- name: gpuferry
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $(b64 ca.crt)
users:
- name: gpuferry-admin
  user:
    client-certificate-data: $(b64 admin.crt)
    client-key-data: $(b64 admin.key)
contexts:
- name: gpuferry
  context: {cluster: gpuferry, user: gpuferry-admin, namespace: default}
current-context: gpuferry
KC
    mv admin.kubeconfig.tmp admin.kubeconfig
  )
}

# ---- processes -----------------------------------------------------------------------------------
api_ready() {
  curl -fsS --max-time 3 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz" 2>/dev/null | grep -q ok
}

kget() { "$BIN/kubectl" --kubeconfig "$PKI/admin.kubeconfig" --request-timeout=5s "$@"; }

node_ready() {  # registered, Ready and without the not-ready taint
  local out
  out=$(kget get node "$NODE" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status} {.spec.taints}') || return 1
  [[ $out == "True "* && $out != *not-ready* ]]
}

start_all() {
  start_bg etcd etcd /usr/bin/etcd --name gpuferry --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "gpuferry=http://127.0.0.1:$ETCD_PEER_PORT" --listen-metrics-urls "http://127.0.0.1:$ETCD_METRICS_PORT"
  wait_for 60 "$LOGS/etcd.log" "etcd healthy" etcdctl --endpoints "http://127.0.0.1:$ETCD_PORT" endpoint health

  start_bg kube-apiserver kube-apiserver "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" --insecure-port=0 \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" --client-ca-file="$PKI/ca.crt" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range=10.0.0.0/24 --authorization-mode=RBAC --allow-privileged=true \
    --enable-priority-and-fairness=false --endpoint-reconciler-type=none --profiling=false
  wait_for 120 "$LOGS/kube-apiserver.log" "kube-apiserver ready" api_ready

  # Node lifecycle stays ON: only it removes the not-ready taint admission puts on a new node.
  start_bg kube-controller-manager kube-controller "$BIN/kube-controller-manager" --kubeconfig="$PKI/admin.kubeconfig" \
    --authentication-kubeconfig="$PKI/admin.kubeconfig" --authorization-kubeconfig="$PKI/admin.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port=0 --port=0 --leader-elect=false --profiling=false \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key"
  start_bg kube-scheduler kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$PKI/admin.kubeconfig" \
    --authentication-kubeconfig="$PKI/admin.kubeconfig" --authorization-kubeconfig="$PKI/admin.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port=0 --port=0 --leader-elect=false --profiling=false
  wait_for 90 "$LOGS/kube-controller-manager.log" "the default ServiceAccount" kget get serviceaccount default

  # The kubelet stand-in runs pods with podman when the registry stack's API socket is there.
  # A stand-in started in the other mode (the registry stack came or went since) is restarted.
  local docker_host="" mode=fake
  if [[ -s $GPUFERRY_STACKS/registry/env ]]; then
    docker_host=$(sed -n 's/^DOCKER_HOST=//p' "$GPUFERRY_STACKS/registry/env" | head -n1)
  fi
  [[ -n $docker_host ]] && mode=podman
  if [[ $(cat "$RUN/kubelet/mode" 2>/dev/null) != "$mode" ]]; then
    stop_pid "$PIDS/kubelet-standin.pid" python
  fi
  echo "$mode" >"$RUN/kubelet/mode"
  start_bg kubelet-standin python env KUBELET_API_URL="https://127.0.0.1:$API_PORT" KUBELET_CA_FILE="$PKI/ca.crt" \
    KUBELET_CERT_FILE="$PKI/admin.crt" KUBELET_KEY_FILE="$PKI/admin.key" K8S_NODE="$NODE" K8S_VERSION="$K8S_VERSION" \
    K8S_NODE_GPUS="$NODE_GPUS" K8S_NODE_MIG_PROFILE="$NODE_MIG_PROFILE" K8S_NODE_MIG_COUNT="$NODE_MIG_COUNT" \
    KUBELET_DOCKER_HOST="$docker_host" KUBELET_REGISTRY_ENV="$GPUFERRY_STACKS/registry/env" KUBELET_STATE_DIR="$RUN/kubelet" PYTHONUNBUFFERED=1 \
    "$PYTHON" "$HERE/kubelet_standin.py"
  wait_for 90 "$LOGS/kubelet-standin.log" "node $NODE Ready and untainted" node_ready
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
K8S_KUBELET_MODE=$(<"$RUN/kubelet/mode")
ENV
  mv "$RUN/env.tmp" "$RUN/env"
}

up() {
  mkdir -p "$RUN" "$PIDS" "$LOGS" "$RUN/kubelet"
  build
  install_packages "$LOGS/apt.log" etcd-server etcd-client openssl curl
  [[ -x $PYTHON ]] || die "no Python at $PYTHON (run \`make venv\` first, or set GPUFERRY_PYTHON)"
  make_pki
  start_all
  write_env
  log "up: KUBECONFIG=$PKI/admin.kubeconfig ($K8S_VERSION, node $NODE); settings in $RUN/env"
}

down() {
  rm -f "$RUN/env"
  stop_pid "$PIDS/kubelet-standin.pid" python
  stop_pid "$PIDS/kube-scheduler.pid" kube-scheduler
  stop_pid "$PIDS/kube-controller-manager.pid" kube-controller
  stop_pid "$PIDS/kube-apiserver.pid" kube-apiserver
  stop_pid "$PIDS/etcd.pid" etcd
  rm -rf "$RUN/etcd"   # the next `up` starts from an empty cluster
}

case ${1:-} in
  up) up ;;
  down) down ;;
  build) build ;;
  *) echo "usage: $0 up|down|build" >&2; exit 2 ;;
esac
