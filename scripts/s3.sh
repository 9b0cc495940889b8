#!/usr/bin/env bash
# S3 object storage on loopback for tests and local use: Ceph's RADOS Gateway (Debian's radosgw 16.2),
# a one-node cluster (1 mon, 1 bluestore OSD on a sparse file, no mgr, auth none inside the cluster),
# with an S3 user of its own and its own keys, on http and on https with a CA this stack makes.
# Users point the S3 checkpoint store at AWS S3, MinIO or their own Ceph instead; nothing here is needed
# for that.
#
#   bash scripts/s3.sh up     # idempotent: installs the packages, starts what is not running
#   bash scripts/s3.sh down   # stops the daemons `up` started; the data, the user and the CA stay
#   bash scripts/s3.sh gateway NAME PORT
#                             # one more radosgw (client.rgw.NAME, http on 127.0.0.1:PORT) on the same
#                             # cluster, in the foreground (exec): tests stop and start it at will
#
# All state lives under $GPUFERRY_STACKS/s3 (nothing under /etc/ceph or /var/lib/ceph): ceph/ holds the
# cluster (ceph.conf, mon store, the OSD's block file, logs, pid files), tls/ the CA and the server's
# certificate. Every daemon listens on 127.0.0.1 only. `up` after `down` (or after the daemons died)
# starts the same cluster again: buckets, objects and keys survive. Delete $GPUFERRY_STACKS/s3/ceph
# (after `down`) for an empty store with new keys.
#
# Settings (environment):
#   GPUFERRY_S3_PORT (5070)            S3 over http
#   GPUFERRY_S3_HTTPS_PORT (port + 1)  S3 over https (certificate for 127.0.0.1 and localhost)
#   GPUFERRY_S3_MON_PORT (port + 2)    the monitor (msgr2); fixed once the cluster exists
#   GPUFERRY_S3_OSD_PORTS (port + 10 - port + 19)  the range the OSD binds in
#   GPUFERRY_S3_SIZE_GIB (16)          the OSD's block file (sparse: it takes the disk it holds)
# Writes $GPUFERRY_STACKS/s3/env (mode 600): S3_ENDPOINT_URL (also as AWS_ENDPOINT_URL),
# S3_HTTPS_ENDPOINT_URL, S3_CA_BUNDLE (the CA's certificate, PEM), AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION.
set -euo pipefail

GPUFERRY_CACHE="${GPUFERRY_CACHE:-$HOME/.cache/gpuferry}"
GPUFERRY_STACKS="${GPUFERRY_STACKS:-$GPUFERRY_CACHE/stacks}"
RUN="$GPUFERRY_STACKS/s3"
STATE="$RUN/ceph"
TLS="$RUN/tls"
CONF="$STATE/ceph.conf"
PORT="${GPUFERRY_S3_PORT:-5070}"
HTTPS_PORT="${GPUFERRY_S3_HTTPS_PORT:-$((PORT + 1))}"
MON_PORT="${GPUFERRY_S3_MON_PORT:-$((PORT + 2))}"
OSD_PORTS="${GPUFERRY_S3_OSD_PORTS:-$((PORT + 10))-$((PORT + 19))}"
SIZE_GIB="${GPUFERRY_S3_SIZE_GIB:-16}"
ENDPOINT="http://127.0.0.1:$PORT"
HTTPS_ENDPOINT="https://127.0.0.1:$HTTPS_PORT"
S3_UID="gpuferry"
# RGW creates these pools on first use, each waiting for a monitor round; made up front in one go.
POOLS=".rgw.root default.rgw.control default.rgw.meta default.rgw.log default.rgw.buckets.index
default.rgw.buckets.data default.rgw.buckets.non-ec"

log() { echo "[s3] $*"; }
die() { echo "[s3] ERROR: $*" >&2; exit 1; }

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# A Ceph command on this cluster; daemons it starts do not inherit the lock `up` holds (fd 9).
ceph_cmd() { timeout 60 "$@" -c "$CONF" 9>&-; }

install_packages() {
  local missing=() cmd
  for cmd in radosgw radosgw-admin ceph-mon ceph-osd monmaptool curl openssl flock; do
    command -v "$cmd" >/dev/null || missing+=("$cmd")
  done
  ((${#missing[@]})) || return 0
  log "installing radosgw, ceph-mon, ceph-osd (missing: ${missing[*]})"
  local pkgs=(radosgw ceph-mon ceph-osd python3-rados curl openssl util-linux)
  apt-get -o DPkg::Lock::Timeout=900 install -y --no-install-recommends "${pkgs[@]}" >/dev/null \
    || { apt-get -o DPkg::Lock::Timeout=900 update >/dev/null \
         && apt-get -o DPkg::Lock::Timeout=900 install -y --no-install-recommends "${pkgs[@]}" >/dev/null; } \
    || die "could not install ${pkgs[*]} with apt-get"
}

# ---- the CA and the server's certificate (kept across down/up, so the trust stays) ---------------

ensure_tls() {
  mkdir -p "$TLS"
  if [[ ! -s "$TLS/ca.crt" || ! -s "$TLS/ca.key" ]]; then
    log "making the stack's CA ($TLS/ca.crt)"
    (umask 077 && openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -keyout "$TLS/ca.key" \
      -out "$TLS/ca.crt" -subj "/CN=gpuferry s3 stack CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -addext "subjectKeyIdentifier=hash" 2>/dev/null) || die "openssl could not make the CA"
    rm -f "$TLS/server.crt"
  fi
  # A certificate that expires within 30 days, or that another CA signed, is made again.
  if [[ -s "$TLS/server.crt" ]] && openssl x509 -checkend 2592000 -noout -in "$TLS/server.crt" >/dev/null \
     && openssl verify -CAfile "$TLS/ca.crt" "$TLS/server.crt" >/dev/null 2>&1; then
    return
  fi
  log "making the server certificate for 127.0.0.1 and localhost"
  (umask 077 && openssl req -newkey rsa:2048 -nodes -sha256 -keyout "$TLS/server.key" -out "$TLS/server.csr" \
    -subj "/CN=127.0.0.1" 2>/dev/null) || die "openssl could not make the server key"
  printf '%s\n' "subjectAltName=IP:127.0.0.1,DNS:localhost" "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth" \
    "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid,issuer" >"$TLS/server.ext"
  openssl x509 -req -sha256 -days 825 -in "$TLS/server.csr" -CA "$TLS/ca.crt" -CAkey "$TLS/ca.key" \
    -CAcreateserial -extfile "$TLS/server.ext" -out "$TLS/server.crt" 2>/dev/null \
    || die "openssl could not sign the server certificate"
  rm -f "$TLS/server.csr" "$TLS/server.ext"
}

# ---- the cluster ----------------------------------------------------------------------------

write_conf() {
  local fsid=$1 tmp="$CONF.tmp"
  cat >"$tmp" <<EOF
# Written by scripts/s3.sh on every \`up\`; the monitor's address is fixed when the cluster is made.
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$MON_PORT
mon initial members = a
ms bind msgr1 = false
ms bind port min = ${OSD_PORTS%-*}
ms bind port max = ${OSD_PORTS#*-}
public addr = 127.0.0.1
cluster addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
client mount timeout = 30
run dir = $STATE/run
admin socket = $STATE/run/\$name.asok
pid file = $STATE/run/\$name.pid
log file = $STATE/log/\$name.log
crash dir = $STATE/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
paxos propose interval = 0.05
[mon]
mon data = $STATE/mon/\$name
mon data avail warn = 1
mon data avail crit = 0
[osd]
osd data = $STATE/osd/\$name
osd objectstore = bluestore
bluestore block path = $STATE/osd/\$name/block.file
bluestore block create = true
bluestore block size = $((SIZE_GIB << 30))
bluestore fsck on mkfs = false
bluestore fsck on mount = false
osd memory target = 1073741824
# A killed gateway's watches (RGW's metadata-cache notifications) hold every notify until they time out:
# 10 s instead of 30.
osd client watch timeout = 10
[client]
# Required with auth none: radosgw's built-in default is 'secure', which needs cephx (it hangs 300 s).
ms mon client mode = crc
rgw data = $STATE/rgw/\$name
# Deleted objects' space is freed after 15 s, not RGW's default 2 h.
rgw gc obj min wait = 15
rgw gc processor period = 15
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$PORT ssl_endpoint=127.0.0.1:$HTTPS_PORT ssl_certificate=$TLS/server.crt ssl_private_key=$TLS/server.key
EOF
  mv "$tmp" "$CONF"
}

mon_alive() { running "$STATE/run/mon.a.pid" "$CONF"; }
osd_alive() { running "$STATE/run/osd.0.pid" "$CONF"; }
rgw_alive() { running "$STATE/run/client.rgw.a.pid" "$CONF"; }
http_ok() { curl -fsS -m 5 "$ENDPOINT/" 2>/dev/null | grep -q ListAllMyBucketsResult; }
https_ok() { curl -fsS -m 5 --cacert "$TLS/ca.crt" "$HTTPS_ENDPOINT/" 2>/dev/null | grep -q ListAllMyBucketsResult; }
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The monitor, and in one librados session the OSD's id and RGW's pools (each pool otherwise waits a round).
make_cluster() {
  log "making a new cluster under $STATE"
  rm -rf "$STATE"
  mkdir -p "$STATE"/{run,log,crash,mon,osd,rgw}
  local fsid osd_uuid osd_id
  fsid=$(cat /proc/sys/kernel/random/uuid)
  osd_uuid=$(cat /proc/sys/kernel/random/uuid)
  write_conf "$fsid"
  echo "$MON_PORT" >"$STATE/mon-port"
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$MON_PORT]" "$STATE/monmap" >/dev/null
  ceph_cmd ceph-mon --mkfs -i a --monmap "$STATE/monmap" >>"$STATE/log/mkfs.log" 2>&1 \
    || die "ceph-mon --mkfs failed; see $STATE/log/mkfs.log"
  start_mon
  osd_id=$(CEPH_CONF="$CONF" timeout 120 /usr/bin/python3 - "$osd_uuid" $POOLS <<'EOF'
import json, sys

import rados

osd_uuid, pools = sys.argv[1], sys.argv[2:]
cluster = rados.Rados(conffile="")  # CEPH_CONF
cluster.connect(timeout=60)

def command(**cmd):
    ret, out, err = cluster.mon_command(json.dumps({**cmd, "format": "json"}), b"")
    if ret != 0:
        raise SystemExit(f"{cmd['prefix']}: {err}")
    return out

osd = json.loads(command(prefix="osd new", uuid=osd_uuid))["osdid"]
for pool in pools:
    command(prefix="osd pool create", pool=pool, pg_num=8, pgp_num=8)
    command(prefix="osd pool application enable", pool=pool, app="rgw")
cluster.shutdown()
print(osd)
EOF
) || die "could not register the OSD and RGW's pools with the monitor; see $STATE/log/mon.a.log"
  [[ "$osd_id" == 0 ]] || die "the monitor gave the OSD id $osd_id, expected 0"
  mkdir -p "$STATE/osd/osd.0"
  ceph_cmd ceph-osd -i 0 --mkfs --osd-uuid "$osd_uuid" >>"$STATE/log/mkfs.log" 2>&1 \
    || die "ceph-osd --mkfs failed; see $STATE/log/mkfs.log"
}

start_mon() {
  mon_alive && return
  ! port_taken "$MON_PORT" || die "something else listens on 127.0.0.1:$MON_PORT; choose another port with GPUFERRY_S3_MON_PORT"
  ceph_cmd ceph-mon -i a >>"$STATE/log/daemons.log" 2>&1 || die "ceph-mon did not start; see $STATE/log/mon.a.log"
  wait_for 60 "$STATE/log/mon.a.log" "the monitor's start" mon_alive
}

start_osd() {
  osd_alive && return
  ceph_cmd ceph-osd -i 0 >>"$STATE/log/daemons.log" 2>&1 || die "ceph-osd did not start; see $STATE/log/osd.0.log"
  wait_for 60 "$STATE/log/osd.0.log" "the OSD's start" osd_alive
}

start_rgw() {
  rgw_alive && return
  ceph_cmd radosgw -n client.rgw.a >>"$STATE/log/daemons.log" 2>&1 \
    || die "radosgw did not start; see $STATE/log/client.rgw.a.log"
  # The gateway answers once the OSD has booted and its placement groups are active.
  local deadline=$((SECONDS + 180))
  until http_ok; do
    rgw_alive || die "radosgw exited; last lines of $STATE/log/client.rgw.a.log:
$(tail -n 30 "$STATE/log/client.rgw.a.log" 2>/dev/null)"
    ((SECONDS < deadline)) || die "radosgw did not answer $ENDPOINT within 180 s; last lines of its log:
$(tail -n 30 "$STATE/log/client.rgw.a.log" 2>/dev/null)"
    sleep 0.2
  done
  wait_for 30 "$STATE/log/client.rgw.a.log" "https on $HTTPS_ENDPOINT" https_ok
}

# The S3 user; radosgw-admin generates its keys (no secret on a command line) and the stack keeps them.
ensure_user() {
  if [[ ! -s "$STATE/user.json" ]]; then
    (umask 077 && ceph_cmd radosgw-admin user info --uid="$S3_UID" >"$STATE/user.json.tmp" 2>/dev/null) \
      || (umask 077 && ceph_cmd radosgw-admin user create --uid="$S3_UID" --display-name="gpuferry tests" \
            >"$STATE/user.json.tmp" 2>>"$STATE/log/admin.log") \
      || die "radosgw-admin could not create the S3 user; see $STATE/log/admin.log"
    mv "$STATE/user.json.tmp" "$STATE/user.json"
  fi
  read -r ACCESS_KEY SECRET_KEY < <(/usr/bin/python3 -c '
import json, sys
key = json.load(open(sys.argv[1]))["keys"][0]
print(key["access_key"], key["secret_key"])' "$STATE/user.json") || die "no keys in $STATE/user.json"
}

start_cluster() {
  if [[ -s "$STATE/mon-port" && -d "$STATE/mon/mon.a" && -d "$STATE/osd/osd.0" ]]; then
    local made_for
    made_for=$(<"$STATE/mon-port")
    [[ "$made_for" == "$MON_PORT" ]] || die "the cluster under $STATE was made with its monitor on port \
$made_for: set GPUFERRY_S3_MON_PORT=$made_for, or run \`bash scripts/s3.sh down\` and remove $STATE"
    if ! { mon_alive && osd_alive && rgw_alive && http_ok; }; then
      write_conf "$(sed -n 's/^fsid = //p' "$CONF")"
    fi
  else
    stop_daemons
    make_cluster
  fi
  if ! rgw_alive; then
    for p in "$PORT" "$HTTPS_PORT"; do
      ! port_taken "$p" || die "something else listens on 127.0.0.1:$p; choose other ports with GPUFERRY_S3_PORT"
    done
  fi
  start_mon
  start_osd
  start_rgw
}

# moto's server, which this stack ran before it ran RGW, on the same port.
stop_earlier_moto() {
  if [[ -f "$RUN/moto.pid" ]]; then
    log "stopping the moto server an earlier version of this stack started"
    stop_pidfile "$RUN/moto.pid" "moto_server -H 127.0.0.1 -p $PORT"
    rm -rf "$RUN/tmp" "$RUN/moto.log"
  fi
}

write_env() {
  local tmp="$RUN/env.tmp"
  (
    umask 077
    {
      echo "S3_ENDPOINT_URL=$ENDPOINT"
      # boto3 (>= 1.28) reads this itself, e.g. in workload/serve.py.
      echo "AWS_ENDPOINT_URL=$ENDPOINT"
      echo "S3_HTTPS_ENDPOINT_URL=$HTTPS_ENDPOINT"
      echo "S3_CA_BUNDLE=$TLS/ca.crt"
      echo "AWS_ACCESS_KEY_ID=$ACCESS_KEY"
      echo "AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
      echo "AWS_DEFAULT_REGION=us-east-1"
    } >"$tmp"
  )
  mv "$tmp" "$RUN/env"
}

up() {
  [[ "$RUN" != *[[:space:]]* ]] || die "$RUN contains whitespace, which Ceph's settings cannot hold: set GPUFERRY_STACKS"
  install_packages
  mkdir -p "$RUN"
  exec 9>"$RUN/.lock"
  flock 9  # one `up` at a time (the mlflow stack runs this one too)
  stop_earlier_moto
  ensure_tls
  start_cluster
  ensure_user
  write_env
  log "ready: S3_ENDPOINT_URL=$ENDPOINT, S3_HTTPS_ENDPOINT_URL=$HTTPS_ENDPOINT (CA $TLS/ca.crt; env in $RUN/env)"
}

# SIGKILL for radosgw (SIGTERM takes it > 10 s; it holds no state), SIGTERM for the OSD, then the monitor.
stop_daemons() {
  local pidfile
  for pidfile in "$STATE"/run/client.rgw.*.pid; do
    [[ -e "$pidfile" ]] || continue
    if running "$pidfile" "$CONF"; then kill -KILL "$(cat "$pidfile")" 2>/dev/null || true; fi
    rm -f "$pidfile"
  done
  stop_pidfile "$STATE/run/osd.0.pid" "$CONF"
  stop_pidfile "$STATE/run/mon.a.pid" "$CONF"
}

down() {
  rm -f "$RUN/env"
  stop_earlier_moto
  [[ -d "$STATE" ]] && stop_daemons
  log "stopped (data, user and CA kept under $RUN)"
}

# One more gateway on the same cluster, in the foreground: its pid is this process's.
gateway() {
  local name=${1:?usage: $0 gateway NAME PORT} port=${2:?usage: $0 gateway NAME PORT}
  [[ "$name" =~ ^[a-z0-9-]+$ && "$name" != a ]] || die "gateway NAME must be lowercase letters, digits and '-', not 'a'"
  [[ "$port" =~ ^[0-9]+$ ]] || die "gateway PORT must be a number"
  mon_alive && osd_alive || die "the s3 stack is not up: run \`make s3-up\`"
  # Without a metadata cache it registers no watches: killing it does not stall the other gateways' notifies.
  exec radosgw -f -c "$CONF" -n "client.rgw.$name" --rgw-frontends="beast endpoint=127.0.0.1:$port" \
    --rgw-cache-enabled=false
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  gateway) shift; gateway "$@" ;;
  *) echo "usage: $0 up|down|gateway NAME PORT" >&2; exit 2 ;;
esac
