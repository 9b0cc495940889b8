#!/usr/bin/env bash
# An MLflow tracking server for tests and for users who want a shared one: PostgreSQL backend store
# (this machine's cluster), artifacts in the S3 stack (scripts/s3.sh), one worker, no job runner,
# webhooks to loopback allowed (with a fixed secret-encryption key, so stored secrets survive restarts).
#
#   bash scripts/mlflow.sh up     # idempotent; starts the s3 stack first
#   bash scripts/mlflow.sh down   # stops the server `up` started; keeps the database and the s3 stack
#
# Settings (environment): GPUFERRY_MLFLOW_PORT (5075), GPUFERRY_MLFLOW_DB (gpuferry_mlflow),
# GPUFERRY_PG_HOST (127.0.0.1), GPUFERRY_PG_PORT (5432), GPUFERRY_PG_USER (postgres; trust auth on loopback),
# GPUFERRY_MLFLOW_BUCKET (mlflow-artifacts).
# Writes $GPUFERRY_STACKS/mlflow/env: MLFLOW_TRACKING_URI, MLFLOW_ARTIFACTS_DESTINATION, MLFLOW_DATABASE.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPUFERRY_CACHE="${GPUFERRY_CACHE:-$HOME/.cache/gpuferry}"
GPUFERRY_STACKS="${GPUFERRY_STACKS:-$GPUFERRY_CACHE/stacks}"
export GPUFERRY_CACHE GPUFERRY_STACKS
RUN="$GPUFERRY_STACKS/mlflow"
PORT="${GPUFERRY_MLFLOW_PORT:-5075}"
DB="${GPUFERRY_MLFLOW_DB:-gpuferry_mlflow}"
PG_HOST="${GPUFERRY_PG_HOST:-127.0.0.1}"
PG_PORT="${GPUFERRY_PG_PORT:-5432}"
PG_USER="${GPUFERRY_PG_USER:-postgres}"
BUCKET="${GPUFERRY_MLFLOW_BUCKET:-mlflow-artifacts}"
PY="$REPO/.venv/bin/python"
MLFLOW="$REPO/.venv/bin/mlflow"
URL="http://127.0.0.1:$PORT"
PATTERN="mlflow server --host 127.0.0.1 --port $PORT"
# The PostgreSQL driver of the server, when the venv lacks it (see ensure_driver).
PYDEPS="$RUN/pydeps"
PSYCOPG2_REQ="psycopg2-binary>=2.9,<3"

log() { echo "[mlflow] $*"; }
die() { echo "[mlflow] ERROR: $*" >&2; exit 1; }

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

healthy() { [[ "$(curl -fsS -m 5 "$URL/health" 2>/dev/null)" == "OK" ]]; }

# The s3 stack's settings (S3_ENDPOINT_URL, AWS_*), read as data, not sourced.
load_s3_env() {
  bash "$REPO/scripts/s3.sh" up
  local line
  while IFS= read -r line; do
    case "$line" in
      S3_ENDPOINT_URL=*) S3_ENDPOINT_URL="${line#*=}" ;;
      AWS_ACCESS_KEY_ID=*) export AWS_ACCESS_KEY_ID="${line#*=}" ;;
      AWS_SECRET_ACCESS_KEY=*) export AWS_SECRET_ACCESS_KEY="${line#*=}" ;;
      AWS_DEFAULT_REGION=*) export AWS_DEFAULT_REGION="${line#*=}" ;;
    esac
  done <"$GPUFERRY_STACKS/s3/env"
  [[ -n "${S3_ENDPOINT_URL:-}" ]] || die "$GPUFERRY_STACKS/s3/env has no S3_ENDPOINT_URL"
  export MLFLOW_S3_ENDPOINT_URL="$S3_ENDPOINT_URL"
}

ensure_bucket() {
  # The s3 stack may have been made anew (an empty store, new keys) since the bucket was created.
  "$PY" - "$S3_ENDPOINT_URL" "$BUCKET" <<'EOF'
import sys

import boto3

endpoint, bucket = sys.argv[1:]
s3 = boto3.client("s3", endpoint_url=endpoint)
if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
    s3.create_bucket(Bucket=bucket)
EOF
}

ensure_database() {
  # shellcheck source=scripts/lib-postgres.sh
  source "$(dirname "${BASH_SOURCE[0]}")/lib-postgres.sh"
  ensure_postgres "$PG_HOST" "$PG_PORT" "$PG_USER" || die "no PostgreSQL for the $DB database"
  local psql=(psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -v ON_ERROR_STOP=1 -qtA)
  if [[ "$("${psql[@]}" -c "select 1 from pg_database where datname = '$DB'")" != 1 ]]; then
    log "creating database $DB"
    "${psql[@]}" -c "create database \"$DB\"" >/dev/null
  fi
}

# MLflow's SQL store needs a PostgreSQL driver: the URI names psycopg2 (SQLAlchemy 2.1 maps a plain
# postgresql:// to psycopg 3). When the venv has none, install the wheel
# into the stack's own directory (not the venv) and give it to the server process only.
ensure_driver() {
  if "$PY" -c "import psycopg2" 2>/dev/null; then
    PYDEPS_PATH=""
    return
  fi
  if ! PYTHONPATH="$PYDEPS" "$PY" -c "import psycopg2" 2>/dev/null; then
    log "installing $PSYCOPG2_REQ into $PYDEPS (the venv has no PostgreSQL driver)"
    rm -rf "$PYDEPS"
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$PYDEPS" "$PSYCOPG2_REQ" \
      || die "could not install $PSYCOPG2_REQ; add it to the venv (pyproject.toml) and run \`make venv\`"
  fi
  PYDEPS_PATH="$PYDEPS"
}

# A Fernet key generated once: MLflow encrypts webhook secrets with it; a per-process key would make
# stored secrets unreadable after a restart.
ensure_webhook_key() {
  if [[ ! -s "$RUN/webhook-secret.key" ]]; then
    (umask 077 && "$PY" -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())" \
      >"$RUN/webhook-secret.key.tmp")
    mv "$RUN/webhook-secret.key.tmp" "$RUN/webhook-secret.key"
  fi
  chmod 600 "$RUN/webhook-secret.key"
}

start_server() {
  # The server holds the s3 stack's endpoint and keys from its start: when they changed, it starts again.
  local s3_identity="$S3_ENDPOINT_URL $AWS_ACCESS_KEY_ID"
  if running "$RUN/server.pid" "$PATTERN" && [[ "$(cat "$RUN/server.s3" 2>/dev/null)" != "$s3_identity" ]]; then
    log "the s3 stack's endpoint or keys changed since the server started: restarting it"
    stop_pidfile "$RUN/server.pid" "$PATTERN"
  fi
  if running "$RUN/server.pid" "$PATTERN" && healthy; then
    log "server already up at $URL"
    return
  fi
  if running "$RUN/server.pid" "$PATTERN"; then
    log "server process $(cat "$RUN/server.pid") is starting; waiting for it"
  else
    if curl -s -m 2 -o /dev/null "$URL/"; then
      die "something else already listens on 127.0.0.1:$PORT; choose another port with GPUFERRY_MLFLOW_PORT"
    fi
    log "starting the tracking server on 127.0.0.1:$PORT (database $DB, artifacts s3://$BUCKET/)"
    # MLflow caches the webhook list per event for MLFLOW_WEBHOOK_CACHE_TTL seconds (default 60): a webhook
    # registered just now is not called before that. Deliveries to known webhooks are not delayed by it.
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false \
      MLFLOW_WEBHOOK_CACHE_TTL="${MLFLOW_WEBHOOK_CACHE_TTL:-5}" \
      MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https \
      MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true \
      MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY="$(cat "$RUN/webhook-secret.key")" \
      PYTHONPATH="${PYDEPS_PATH}" \
      setsid nohup "$MLFLOW" server --host 127.0.0.1 --port "$PORT" --workers 1 \
      --backend-store-uri "postgresql+psycopg2://$PG_USER@$PG_HOST:$PG_PORT/$DB" \
      --artifacts-destination "s3://$BUCKET/" \
      >>"$RUN/server.log" 2>&1 </dev/null &
    echo $! >"$RUN/server.pid"
    echo "$s3_identity" >"$RUN/server.s3"
  fi
  local deadline=$((SECONDS + 240))
  until healthy; do
    running "$RUN/server.pid" "$PATTERN" \
      || die "the server exited; last lines of $RUN/server.log:
$(tail -n 30 "$RUN/server.log")"
    ((SECONDS < deadline)) || die "the server did not answer $URL/health within 240 s; last lines of $RUN/server.log:
$(tail -n 30 "$RUN/server.log")"
    sleep 1
  done
  log "server up at $URL (pid $(cat "$RUN/server.pid"))"
}

write_env() {
  local tmp="$RUN/env.tmp"
  {
    echo "MLFLOW_TRACKING_URI=$URL"
    echo "MLFLOW_ARTIFACTS_DESTINATION=s3://$BUCKET/"
    echo "MLFLOW_DATABASE=$DB"
  } >"$tmp"
  mv "$tmp" "$RUN/env"
}

up() {
  [[ -x "$MLFLOW" ]] || die "$MLFLOW missing: run \`make venv\` first"
  command -v curl >/dev/null || apt-get -o DPkg::Lock::Timeout=900 install -y curl >/dev/null
  mkdir -p "$RUN"
  load_s3_env
  ensure_bucket
  ensure_database
  ensure_driver
  ensure_webhook_key
  start_server
  write_env
  log "ready: MLFLOW_TRACKING_URI=$URL (env in $RUN/env)"
}

down() {
  rm -f "$RUN/env"
  stop_pidfile "$RUN/server.pid" "$PATTERN"
  log "stopped (database $DB and the s3 stack kept)"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
