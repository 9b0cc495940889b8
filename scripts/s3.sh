#!/usr/bin/env bash
# S3-compatible object storage on loopback for tests and local use: moto's server (moto[server]) as its
# own process. Users point the S3 checkpoint store at real S3, MinIO or Ceph instead; nothing here is
# needed for that.
#
#   bash scripts/s3.sh up     # idempotent: a second `up` only checks that the server answers
#   bash scripts/s3.sh down   # stops the server `up` started (its data is in memory: it is gone)
#
# Settings (environment): GPUFERRY_S3_PORT (5070).
# Writes $GPUFERRY_STACKS/s3/env: S3_ENDPOINT_URL (also as AWS_ENDPOINT_URL), AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPUFERRY_CACHE="${GPUFERRY_CACHE:-$HOME/.cache/gpuferry}"
GPUFERRY_STACKS="${GPUFERRY_STACKS:-$GPUFERRY_CACHE/stacks}"
RUN="$GPUFERRY_STACKS/s3"
PORT="${GPUFERRY_S3_PORT:-5070}"
ENDPOINT="http://127.0.0.1:$PORT"
MOTO="$REPO/.venv/bin/moto_server"
PATTERN="moto_server -H 127.0.0.1 -p $PORT"

log() { echo "[s3] $*"; }
die() { echo "[s3] ERROR: $*" >&2; exit 1; }

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# moto answers ListBuckets on GET / (an S3 XML document).
healthy() { curl -fsS -m 5 "$ENDPOINT/" 2>/dev/null | grep -q "ListAllMyBucketsResult"; }

start_server() {
  if running "$RUN/moto.pid" "$PATTERN" && healthy; then
    log "moto server already up at $ENDPOINT"
    return
  fi
  if ! running "$RUN/moto.pid" "$PATTERN"; then
    if curl -s -m 2 -o /dev/null "$ENDPOINT/"; then
      die "something else already listens on 127.0.0.1:$PORT; choose another port with GPUFERRY_S3_PORT"
    fi
    log "starting moto's S3 server on 127.0.0.1:$PORT"
    # Large objects spill to temporary files; keep them in the stack's directory.
    mkdir -p "$RUN/tmp"
    TMPDIR="$RUN/tmp" setsid nohup "$MOTO" -H 127.0.0.1 -p "$PORT" >>"$RUN/moto.log" 2>&1 </dev/null &
    echo $! >"$RUN/moto.pid"
  fi
  local deadline=$((SECONDS + 60))
  until healthy; do
    running "$RUN/moto.pid" "$PATTERN" \
      || die "the moto server exited; last lines of $RUN/moto.log:
$(tail -n 30 "$RUN/moto.log")"
    ((SECONDS < deadline)) || die "the moto server did not answer $ENDPOINT within 60 s; last lines of $RUN/moto.log:
$(tail -n 30 "$RUN/moto.log")"
    sleep 0.2
  done
  log "moto server up at $ENDPOINT (pid $(cat "$RUN/moto.pid"))"
}

write_env() {
  local tmp="$RUN/env.tmp"
  {
    echo "S3_ENDPOINT_URL=$ENDPOINT"
    # boto3 (>= 1.28) reads this itself, e.g. in workload/serve.py.
    echo "AWS_ENDPOINT_URL=$ENDPOINT"
    # moto accepts any credentials; these are placeholders, not secrets.
    echo "AWS_ACCESS_KEY_ID=testing"
    echo "AWS_SECRET_ACCESS_KEY=testing"
    echo "AWS_DEFAULT_REGION=us-east-1"
  } >"$tmp"
  mv "$tmp" "$RUN/env"
}

up() {
  [[ -x "$MOTO" ]] || die "$MOTO missing: run \`make venv\` first (moto[server] is in the test extra)"
  command -v curl >/dev/null || apt-get -o DPkg::Lock::Timeout=900 install -y curl >/dev/null
  mkdir -p "$RUN"
  start_server
  write_env
  log "ready: S3_ENDPOINT_URL=$ENDPOINT (env in $RUN/env)"
}

down() {
  rm -f "$RUN/env"
  stop_pidfile "$RUN/moto.pid" "$PATTERN"
  rm -rf "$RUN/tmp"
  log "stopped"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
