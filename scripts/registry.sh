#!/usr/bin/env bash
# The image stack: podman serving the Docker API on a unix socket, Debian's docker-registry on
# 127.0.0.1 with htpasswd auth (plain HTTP, marked insecure for podman), and the base images the
# tests build on (nothing can be pulled here).
#
#   bash scripts/registry.sh up     # idempotent; a second `up` only checks that everything answers
#   bash scripts/registry.sh down   # stops what `up` started; storage, registry data and the base image stay
#
# Podman reads its configuration from private files under the run dir, selected with environment
# variables (nothing under /etc/containers is changed):
#   CONTAINERS_CONF             containers.conf: runc (crun fails on this host's hybrid cgroups) and
#                               capped default ulimits (podman's defaults need CAP_SYS_RESOURCE)
#   CONTAINERS_REGISTRIES_CONF  registries.conf: the local registry is insecure (HTTP); no short names
#   CONTAINERS_STORAGE_CONF     storage.conf: native overlay, graph root under the run dir
# The Docker-API service is started with these variables, so every API call (docker SDK, docker CLI)
# gets them. To use the podman CLI on the same storage: `set -a; . $GPUFERRY_STACKS/registry/env; set +a`.
# Podman still uses a few machine-wide paths whatever the config: /run/libpod, /run/containers/networks
# (netavark's lock and IP allocations), /var/tmp (build scratch), /var/lib/containers/cache (blob-info cache).
#
# Base images (cached outside the repo, built once per machine):
#   BASE_IMAGE       Debian bookworm (debootstrap minbase) + python3 + a venv at /opt/venv holding torch
#                    (CPU), runtime/requirements.txt (gpuferry's model server) and every bundled example's
#                    requirements.txt, installed from wheels the host downloads: an example's `pip install`
#                    then finds everything satisfied and needs no network.
#                    Saved as $GPUFERRY_CACHE/images/gpuferry-base-<key>.oci.tar; the key hashes the
#                    recipe version and the requirements, so editing requirements.txt builds a new one.
#   TINY_BASE_IMAGE  busybox (static) from scratch: a shell for small test builds, 2 MB.
#
# Settings (environment): GPUFERRY_REGISTRY_PORT (5090), GPUFERRY_REGISTRY_USER (gpuferry),
# GPUFERRY_DEBIAN_MIRROR (default: the first Debian URI of this machine's apt sources).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GPUFERRY_CACHE=${GPUFERRY_CACHE:-$HOME/.cache/gpuferry}
GPUFERRY_STACKS=${GPUFERRY_STACKS:-$GPUFERRY_CACHE/stacks}
RUN=$GPUFERRY_STACKS/registry
PORT=${GPUFERRY_REGISTRY_PORT:-5090}
REGISTRY_USER=${GPUFERRY_REGISTRY_USER:-gpuferry}
SOCKET=$RUN/podman.sock
IMAGES=$GPUFERRY_CACHE/images
# Bump when the base image recipe below changes.
BASE_RECIPE=3
TINY_BASE_IMAGE=localhost/gpuferry-tiny:busybox-1

export CONTAINERS_CONF=$RUN/containers.conf
export CONTAINERS_REGISTRIES_CONF=$RUN/registries.conf
export CONTAINERS_STORAGE_CONF=$RUN/storage.conf

log() { echo "registry.sh: $*" >&2; }
die() { echo "registry.sh: error: $*" >&2; exit 1; }

apt_install() {
  if ! apt-get -o DPkg::Lock::Timeout=900 install -y --no-install-recommends "$@"; then
    apt-get -o DPkg::Lock::Timeout=900 update
    apt-get -o DPkg::Lock::Timeout=900 install -y --no-install-recommends "$@"
  fi
}

install_packages() {
  local missing=() pair
  # command:package
  for pair in podman:podman runc:runc conmon:conmon /usr/lib/podman/netavark:netavark \
              /usr/lib/podman/aardvark-dns:aardvark-dns slirp4netns:slirp4netns newuidmap:uidmap \
              docker-registry:docker-registry debootstrap:debootstrap htpasswd:apache2-utils \
              /bin/busybox:busybox-static curl:curl iptables:iptables; do
    local cmd=${pair%%:*} pkg=${pair#*:}
    if [[ $cmd == /* ]]; then [[ -x $cmd ]] || missing+=("$pkg"); else command -v "$cmd" >/dev/null || missing+=("$pkg"); fi
  done
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt_install "${missing[@]}"
  fi
}

write_configs() {
  mkdir -p "$RUN" "$RUN/data" "$RUN/storage" "$RUN/runroot"
  chmod 700 "$RUN"
  cat >"$RUN/containers.conf" <<EOF
[containers]
# podman's default (1048576) needs CAP_SYS_RESOURCE, which this machine lacks
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[network]
# explicit: with no setting podman 4.3 may pick CNI, whose plugins are not installed
network_backend = "netavark"

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
# crun fails here: "cgroups in hybrid mode not supported"
runtime = "runc"
EOF
  cat >"$RUN/storage.conf" <<EOF
[storage]
driver = "overlay"
runroot = "$RUN/runroot"
graphroot = "$RUN/storage"
EOF
  cat >"$RUN/registries.conf" <<EOF
unqualified-search-registries = []
short-name-mode = "permissive"

[[registry]]
location = "127.0.0.1:$PORT"
insecure = true

[[registry]]
location = "localhost:$PORT"
insecure = true
EOF
  if [[ ! -s $RUN/password ]]; then
    (umask 077; od -An -tx1 -N16 /dev/urandom | tr -d ' \n' >"$RUN/password")
  fi
  chmod 600 "$RUN/password"
  if [[ ! -s $RUN/htpasswd || $(cut -d: -f1 "$RUN/htpasswd") != "$REGISTRY_USER" ]] \
     || ! htpasswd -vi "$RUN/htpasswd" "$REGISTRY_USER" <"$RUN/password" >/dev/null 2>&1; then
    (umask 077; htpasswd -iBn "$REGISTRY_USER" <"$RUN/password" >"$RUN/htpasswd")
  fi
  if [[ ! -s $RUN/http-secret ]]; then
    (umask 077; od -An -tx1 -N16 /dev/urandom | tr -d ' \n' >"$RUN/http-secret")
  fi
  cat >"$RUN/registry.yml" <<EOF
version: 0.1
log:
  level: info
  fields:
    service: registry
storage:
  cache:
    blobdescriptor: inmemory
  filesystem:
    rootdirectory: $RUN/data
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$PORT
  secret: $(cat "$RUN/http-secret")
  headers:
    X-Content-Type-Options: [nosniff]
auth:
  htpasswd:
    realm: gpuferry-registry
    path: $RUN/htpasswd
EOF
  chmod 600 "$RUN/registry.yml"
}

# alive NAME BINARY: the pid in $RUN/NAME.pid runs BINARY
alive() {
  local pidfile=$RUN/$1.pid pid
  [[ -s $pidfile ]] || return 1
  pid=$(cat "$pidfile")
  [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$2"
}

# wait_for WHAT SECONDS LOG COMMAND...: poll COMMAND until it succeeds or the deadline passes
wait_for() {
  local what=$1 seconds=$2 logfile=$3; shift 3
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      echo "--- last lines of $logfile ---" >&2; tail -n 30 "$logfile" >&2 || true
      die "$what did not answer within ${seconds}s"
    fi
    sleep 0.2
  done
}

registry_answers() {
  # 401 = up and asking for credentials
  [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$PORT/v2/") == 401 ]]
}

podman_answers() {
  [[ $(curl -s --max-time 2 --unix-socket "$SOCKET" http://d/_ping) == OK ]]
}

start_registry() {
  if alive registry "docker-registry serve $RUN/registry.yml" && registry_answers; then
    return
  fi
  if curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/v2/"; then
    die "port $PORT already answers but not as this stack's registry: set GPUFERRY_REGISTRY_PORT to a free port"
  fi
  log "starting docker-registry on 127.0.0.1:$PORT"
  (cd "$RUN" && exec setsid nohup docker-registry serve "$RUN/registry.yml" >"$RUN/registry.log" 2>&1 </dev/null) &
  echo $! >"$RUN/registry.pid"
  wait_for "docker-registry" 30 "$RUN/registry.log" registry_answers
}

start_podman() {
  if alive podman "system service" && podman_answers; then
    return
  fi
  log "starting podman system service on $SOCKET"
  rm -f "$SOCKET"
  # Started from its run directory: the conmon of a container the kernel killed for memory writes a file named
  # "oom" into its working directory, which would otherwise be the checkout's.
  (cd "$RUN" && exec setsid nohup podman system service --time=0 "unix://$SOCKET" >"$RUN/podman.log" 2>&1 </dev/null) &
  echo $! >"$RUN/podman.pid"
  wait_for "podman system service" 60 "$RUN/podman.log" podman_answers
}

debian_mirror() {
  if [[ -n ${GPUFERRY_DEBIAN_MIRROR:-} ]]; then echo "$GPUFERRY_DEBIAN_MIRROR"; return; fi
  local uri
  uri=$(grep -hoE '^URIs:[[:space:]]*[^[:space:]]+/debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | head -n1 | awk '{print $2}' || true)
  if [[ -z $uri ]]; then
    uri=$(grep -hoE '^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?[^[:space:]]+/debian/?[[:space:]]' \
          /etc/apt/sources.list 2>/dev/null | head -n1 | awk '{print $NF}' || true)
  fi
  [[ -n $uri ]] || die "no Debian mirror in /etc/apt/sources*: set GPUFERRY_DEBIAN_MIRROR"
  echo "$uri"
}

image_exists() { podman image exists "$1"; }

# What the base image installs (torch aside): gpuferry's model server and the bundled examples.
base_requirements() {
  cat "$ROOT/runtime/requirements.txt" "$ROOT"/examples/*/requirements.txt \
    | grep -vE '^[[:space:]]*(#|$)' | grep -vE '^[[:space:]]*torch([^a-zA-Z0-9_.-]|$)' | sort -u
}

base_key() {
  local torch_wheel=$1
  { echo "recipe $BASE_RECIPE"; base_requirements; basename "${torch_wheel:-torch}"; } \
    | sha256sum | cut -c1-12
}

# The local CPU torch wheel, when this machine has one (the CUDA build from the index is ~2.5 GB).
torch_wheel() {
  local w
  for w in /opt/wheels/torch-*+cpu-cp311-cp311-*x86_64.whl; do [[ -f $w ]] && { echo "$w"; return; }; done
  echo ""
}

build_base() {
  local tag=$1 archive=$2 wheel=$3
  mkdir -p "$GPUFERRY_CACHE"
  local work; work=$(mktemp -d "$GPUFERRY_CACHE/base-build.XXXXXX")
  local rootfs=$work/rootfs
  # shellcheck disable=SC2064
  trap "umount -l '$rootfs/proc' 2>/dev/null || true; rm -rf '$work'" EXIT
  local started=$SECONDS mirror; mirror=$(debian_mirror)
  log "building the base image $tag (debootstrap bookworm from $mirror, ~7 min on 2 cores, once per machine)"
  mkdir -p "$GPUFERRY_CACHE/debcache"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    --cache-dir="$GPUFERRY_CACHE/debcache" bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  log "debootstrap done ($((SECONDS - started))s)"
  mount -t proc proc "$rootfs/proc"
  # the host's pip settings (find-links, extra indexes) mean nothing inside the image
  local in_root=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 chroot "$rootfs")
  "${in_root[@]}" /usr/bin/python3 -m venv /opt/venv
  # Wheels come from the host's pip (it reaches the package index and the local CPU torch wheel);
  # the image's own pip installs them offline.
  base_requirements >"$rootfs/tmp/requirements.txt"
  echo "${wheel:-torch}" | sed 's|^/opt/wheels/|/tmp/wheels/|' >>"$rootfs/tmp/requirements.txt"
  mkdir -p "$rootfs/tmp/wheels"
  local pip=("$ROOT/.venv/bin/python" -m pip)
  [[ -x $ROOT/.venv/bin/python ]] || pip=(python3 -m pip)
  "${pip[@]}" download --only-binary=:all: -q -d "$rootfs/tmp/wheels" \
    -r <(base_requirements) ${wheel:+"$wheel"}
  log "wheels downloaded ($((SECONDS - started))s)"
  "${in_root[@]}" /opt/venv/bin/pip install -q --no-index --no-cache-dir --disable-pip-version-check \
    --find-links /tmp/wheels -r /tmp/requirements.txt
  "${in_root[@]}" /opt/venv/bin/python -c "import torch, numpy, pandas, sklearn, uvicorn, boto3, mlflow.pyfunc"
  umount -l "$rootfs/proc"
  rm -rf "$rootfs/tmp/"* "$rootfs/var/lib/apt/lists/"* "$rootfs/var/cache/apt/"*.bin \
         "$rootfs/var/cache/apt/archives/"*.deb "$rootfs"/usr/share/{doc,man,locale,info}/*
  tar --numeric-owner -C "$rootfs" -cf "$work/rootfs.tar" .
  log "venv installed ($((SECONDS - started))s)"
  podman import -q \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python"]' \
    "$work/rootfs.tar" "$tag" >/dev/null
  mkdir -p "$IMAGES"
  podman save -q --format oci-archive -o "$archive.tmp" "$tag"
  mv "$archive.tmp" "$archive"
  rm -rf "$work"; trap - EXIT
  log "base image $tag built in $((SECONDS - started))s, cached as $archive"
  # Earlier recipes' archives and images are dead weight (an image still used by a container stays).
  local stale
  for stale in "$IMAGES"/gpuferry-base-bookworm-py3-*.oci.tar; do
    [[ $stale == "$archive" || ! -e $stale ]] || rm -f "$stale"
  done
  podman images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/gpuferry-base:' | grep -vxF "$tag" \
    | while read -r stale; do podman rmi "$stale" >/dev/null 2>&1 || true; done || true
}

ensure_base() {
  local wheel key tag archive
  wheel=$(torch_wheel)
  key=$(base_key "$wheel")
  tag=localhost/gpuferry-base:bookworm-py3-$key
  archive=$IMAGES/gpuferry-base-bookworm-py3-$key.oci.tar
  if ! image_exists "$tag"; then
    if [[ -s $archive ]]; then
      log "loading the cached base image $archive"
      podman load -q -i "$archive" >/dev/null
      # an oci-archive carries its reference as an annotation; tag explicitly in case it was dropped
      image_exists "$tag" || podman tag "$(podman images -q --sort created | head -n1)" "$tag"
    else
      build_base "$tag" "$archive" "$wheel"
    fi
  fi
  BASE_IMAGE=$tag
}

ensure_tiny() {
  image_exists "$TINY_BASE_IMAGE" && return
  local ctx; ctx=$(mktemp -d)
  cp /bin/busybox "$ctx/busybox"
  printf 'FROM scratch\nCOPY busybox /bin/busybox\nRUN ["/bin/busybox", "--install", "-s", "/bin"]\nCMD ["/bin/sh"]\n' >"$ctx/Dockerfile"
  podman build -q --pull=never -t "$TINY_BASE_IMAGE" "$ctx" >/dev/null
  rm -rf "$ctx"
}

write_env() {
  cat >"$RUN/env.tmp" <<EOF
DOCKER_HOST=unix://$SOCKET
REGISTRY_URL=127.0.0.1:$PORT
REGISTRY_USER=$REGISTRY_USER
REGISTRY_PASSWORD_FILE=$RUN/password
BASE_IMAGE=$BASE_IMAGE
TINY_BASE_IMAGE=$TINY_BASE_IMAGE
CONTAINERS_CONF=$CONTAINERS_CONF
CONTAINERS_REGISTRIES_CONF=$CONTAINERS_REGISTRIES_CONF
CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF
EOF
  mv "$RUN/env.tmp" "$RUN/env"
}

up() {
  [[ $(id -u) == 0 ]] || die "needs root (rootful podman, debootstrap)"
  install_packages
  write_configs
  start_registry
  start_podman
  ensure_tiny
  ensure_base
  write_env
  log "up: DOCKER_HOST=unix://$SOCKET registry 127.0.0.1:$PORT base $BASE_IMAGE"
}

stop() {
  local name=$1 match=$2 pid
  if alive "$name" "$match"; then
    pid=$(cat "$RUN/$name.pid")
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    log "stopped $name ($pid)"
  fi
  rm -f "$RUN/$name.pid"
}

down() {
  rm -f "$RUN/env"
  stop podman "system service"
  stop registry "docker-registry serve"
  rm -f "$SOCKET"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
