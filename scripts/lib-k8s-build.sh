# Sourced by scripts/k8s.sh: building the stack's binaries ONCE per machine from Debian bookworm's
# `kubernetes` source package (1.20, whose orig tarball carries vendor/) with Debian's golang-go in
# GOPATH mode. No registry ships kube-apiserver or a kubelet for this machine. The deb-src entries are
# derived from this machine's own apt sources into a private apt config (the system's is not touched).
#
# Cached under $K8S (= $GPUFERRY_CACHE/k8s): bin-<version>/ holds the control plane, kubectl, the
# kubelet, kube-proxy and the pod-sandbox `pause` (from the tree's build/pause/linux/pause.c);
# fake-gpu-plugin-<hash of its source>/ holds the device plugin of scripts/fake-gpu-plugin (built in the
# same tree, against its vendored gRPC and device-plugin API). A cache that lacks some binaries (an
# older version of this script built the control plane alone) gets only those, in one run.
# Needs: K8S, SRC, BIN, K8S_VERSION, HERE, log, die, install_packages.

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

CONTROL_PLANE_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
NODE_BINS=(kubelet kube-proxy)
PLUGIN_SRC=$HERE/fake-gpu-plugin/main.go
PLUGIN_BIN=$K8S/fake-gpu-plugin-$(sha256sum "$PLUGIN_SRC" | cut -c1-12)/fake-gpu-plugin

missing_bins() {
  local c
  for c in "${CONTROL_PLANE_BINS[@]}" "${NODE_BINS[@]}" pause; do [[ -x $BIN/$c ]] || echo "$c"; done
  [[ -x $PLUGIN_BIN ]] || echo fake-gpu-plugin
}

build() {
  if [[ -z $(missing_bins) ]]; then return 0; fi
  mkdir -p "$K8S"
  # One build per machine at a time; the lock's fd is not inherited by the daemons `up` starts.
  ( log "taking the build lock ($K8S/build.lock)"; flock 9; build_locked ) 9>"$K8S/build.lock"
}

build_locked() {
  local missing
  missing=$(missing_bins)
  if [[ -z $missing ]]; then return 0; fi
  local started=$SECONDS
  install_packages "$K8S/build.log" golang-go make gcc libc6-dev etcd-server etcd-client openssl
  fetch_source
  local tarball W tree
  tarball=$(ls "$SRC"/kubernetes_*.orig.tar.gz | head -n1)
  W=$K8S/build
  rm -rf "$W/gopath" "$W"/kubernetes-*
  mkdir -p "$W/gopath/src/k8s.io" "$W/home" "$BIN"
  log "building $(echo $missing) ($K8S_VERSION) from $(basename "$tarball") (8-15 min on 2 cores; log: $K8S/build.log)"
  tar xzf "$tarball" -C "$W"
  tree=$(ls -d "$W"/kubernetes-*/ | head -n1)
  ln -sfn "${tree%/}" "$W/gopath/src/k8s.io/kubernetes"
  (
    # Kubernetes 1.20 builds in GOPATH mode (hack/lib/init.sh sets GO111MODULE=off).
    export GOCACHE=$W/gocache GOPATH=$W/gopath GOFLAGS= CGO_ENABLED=0 GOPROXY=off GO111MODULE=off HOME=$W/home
    cd "$W/gopath/src/k8s.io/kubernetes"
    if grep -qx 'kube-apiserver\|kube-controller-manager\|kube-scheduler' <<<"$missing"; then
      make gen_openapi   # pkg/generated/openapi is not in the tarball
    fi
    ld="-s -w"
    for p in k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
      ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=20 -X $p.gitTreeState=clean"
      ld+=" -X $p.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    done
    for c in $missing; do
      t0=$SECONDS
      case $c in
        pause)  # the pod sandbox's process, as upstream builds it (build/pause/Makefile)
          gcc -Os -Wall -Werror -static -DVERSION=v3.4 -o "$BIN/pause.tmp" build/pause/linux/pause.c
          mv "$BIN/pause.tmp" "$BIN/pause" ;;
        fake-gpu-plugin)  # inside the tree, so that its vendored packages apply
          mkdir -p cmd/gpuferry-fake-gpu-plugin "$(dirname "$PLUGIN_BIN")"
          cp "$PLUGIN_SRC" cmd/gpuferry-fake-gpu-plugin/main.go
          go build -trimpath -ldflags "-s -w" -o "$PLUGIN_BIN.tmp" k8s.io/kubernetes/cmd/gpuferry-fake-gpu-plugin
          mv "$PLUGIN_BIN.tmp" "$PLUGIN_BIN" ;;
        *)
          go build -trimpath -ldflags "$ld" -o "$BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c"
          mv "$BIN/$c.tmp" "$BIN/$c" ;;
      esac
      echo "built $c in $((SECONDS - t0))s"
    done
  ) >>"$K8S/build.log" 2>&1 || { tail -n 40 "$K8S/build.log" >&2; die "building Kubernetes failed (log: $K8S/build.log)"; }
  basename "$tarball" >"$BIN/SOURCE"
  touch "$BIN/.complete"
  log "built in $((SECONDS - started))s; binaries in $BIN"
  rm -rf "$W"   # the tree and the Go cache (~1.8 GB) are not needed any more
  # Plugins built from other versions of its source: another checkout on this machine may still run one
  # (and would build it again), so only those built over 30 days ago go.
  find "$K8S" -maxdepth 1 -name 'fake-gpu-plugin-*' ! -path "$(dirname "$PLUGIN_BIN")" -mtime +30 -exec rm -rf {} +
}
