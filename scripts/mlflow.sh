#!/usr/bin/env bash
# An MLflow tracking server for tests and for users who want a shared one: PostgreSQL backend store
# (this machine's cluster), artifacts in the S3 stack (scripts/s3.sh), one worker, no job runner,
# webhooks to loopback allowed (with a fixed secret-encryption key, so stored secrets survive restarts).
# The server requires a login (MLflow's basic auth, `mlflow server --app-name basic-auth`; only /health and
# the static files are open): its users live in basic_auth.db in the stack's directory, the `admin` user's
# password is generated once into admin-password (mode 600) and kept across restarts, and a user
# `gpuferry-tests` (an MLflow admin too: tests register webhooks, which MLflow allows admins only) has a
# password of its own in tests-password. Logged-in users who are not admins may read everything
# (default_permission READ) and manage what they create. `up` restarts a server an older `up` started
# without the login.
#
#   bash scripts/mlflow.sh up     # idempotent; starts the s3 stack first
#   bash scripts/mlflow.sh down   # stops the server `up` started; keeps the database and the s3 stack
#
# Settings (environment): GPUFERRY_MLFLOW_PORT (5075), GPUFERRY_MLFLOW_DB (gpuferry_mlflow),
# GPUFERRY_PG_HOST (127.0.0.1), GPUFERRY_PG_PORT (5432), GPUFERRY_PG_USER (postgres; trust auth on loopback),
# GPUFERRY_MLFLOW_BUCKET (mlflow-artifacts), GPUFERRY_MLFLOW_RUN (the stack's directory: $GPUFERRY_STACKS/mlflow;
# another one, with another port and database, runs a second server beside it).
# Writes $RUN/env (mode 600): MLFLOW_TRACKING_URI, MLFLOW_ARTIFACTS_DESTINATION,
# MLFLOW_DATABASE, and the tests user's login MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD (also in the
# file MLFLOW_PASSWORD_FILE names, for a stack file's {file: ...} reference).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPUFERRY_CACHE="${GPUFERRY_CACHE:-$HOME/.cache/gpuferry}"
GPUFERRY_STACKS="${GPUFERRY_STACKS:-$GPUFERRY_CACHE/stacks}"
export GPUFERRY_CACHE GPUFERRY_STACKS
RUN="${GPUFERRY_MLFLOW_RUN:-$GPUFERRY_STACKS/mlflow}"
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
# What the server runs with; a server started with something else (an older `up`: no login) starts again.
APP="basic-auth"
ADMIN_USER="admin"
TESTS_USER="gpuferry-tests"
# The PostgreSQL driver of the server, when the venv lacks it (see ensure_driver).
PYDEPS="$RUN/pydeps"
PSYCOPG2_REQ="psycopg2-binary>=2.9,<3"

log() { echo "[mlflow] $*"; }
die() { echo "[mlflow] ERROR: $*" >&2; exit 1; }

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

healthy() { [[ "$(curl -fsS -m 5 "$URL/health" 2>/dev/null)" == "OK" ]]; }

# A random secret generated once into $RUN/NAME (mode 600) and kept: `secret_file NAME COMMAND...`.
secret_file() {
  local name="$1"
  shift
  if [[ ! -s "$RUN/$name" ]]; then
    (umask 077 && "$@" >"$RUN/$name.tmp")
    mv "$RUN/$name.tmp" "$RUN/$name"
  fi
  chmod 600 "$RUN/$name"
}

random_password() { "$PY" -c "import secrets; print(secrets.token_urlsafe(24))"; }

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
# stored secrets unreadable after a restart. The login's secrets are made once as well: the admin's password
# (MLflow creates the admin with it when the auth database is new, so the two stay together in $RUN), the
# tests user's, and the key that signs the server's sessions and CSRF tokens.
ensure_secrets() {
  secret_file webhook-secret.key "$PY" -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"
  secret_file admin-password random_password
  secret_file tests-password random_password
  secret_file flask-secret.key "$PY" -c "import secrets; print(secrets.token_hex(32))"
  local tmp="$RUN/basic_auth.ini.tmp"
  (
    umask 077
    cat >"$tmp" <<EOF
[mlflow]
default_permission = READ
database_uri = sqlite:///$RUN/basic_auth.db
admin_username = $ADMIN_USER
admin_password = $(cat "$RUN/admin-password")
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
EOF
  )
  mv "$tmp" "$RUN/basic_auth.ini"
  # The users' password hashes: SQLite keeps the mode of the file the server opens.
  (umask 077 && touch "$RUN/basic_auth.db")
  chmod 600 "$RUN/basic_auth.db"
}

# The tests user, made (or its password reset to tests-password) with the admin's login; an MLflow admin.
# MLflow checks the password of every request (no session) against werkzeug's default hash, scrypt: 0.1-0.4 s
# of CPU per request on this machine, which every pipeline step would pay. The tests user's hash is stored
# as a cheap PBKDF2 instead: its password lies in the same 0600 directory, which a slow hash does not protect.
ensure_tests_user() {
  "$PY" - "$URL" "$ADMIN_USER" "$RUN/admin-password" "$TESTS_USER" "$RUN/tests-password" "$RUN/basic_auth.db" <<'EOF'
import sqlite3
import sys
from pathlib import Path

import httpx
from werkzeug.security import generate_password_hash

url, admin, admin_file, user, user_file, db = sys.argv[1:]
auth = (admin, Path(admin_file).read_text().strip())
password = Path(user_file).read_text().strip()
api = f"{url}/api/2.0/mlflow/users"
with httpx.Client(auth=auth, timeout=30) as http:
    if http.get(f"{url}/api/2.0/mlflow/experiments/search", params={"max_results": 1}).status_code == 401:
        sys.exit(f"the server refused the admin's login from {admin_file}: its auth database holds another "
                 "password (delete basic_auth.db in the stack's directory, after `down`, to make it anew)")
    found = http.get(f"{api}/get", params={"username": user})
    if found.status_code == 200:
        done = http.patch(f"{api}/update-password", json={"username": user, "password": password})
    else:
        done = http.post(f"{api}/create", json={"username": user, "password": password})
    done.raise_for_status()
    http.patch(f"{api}/update-admin", json={"username": user, "is_admin": True}).raise_for_status()
with sqlite3.connect(db) as users:
    users.execute("update users set password_hash = ? where username = ?",
                  (generate_password_hash(password, method="pbkdf2:sha256:1000"), user))
with httpx.Client(auth=(user, password), timeout=30) as http:
    http.get(f"{url}/api/2.0/mlflow/experiments/search", params={"max_results": 1}).raise_for_status()
EOF
}

start_server() {
  # The server holds the s3 stack's endpoint and keys from its start: when they changed, it starts again.
  local s3_identity="$S3_ENDPOINT_URL $AWS_ACCESS_KEY_ID"
  if running "$RUN/server.pid" "$PATTERN" && [[ "$(cat "$RUN/server.s3" 2>/dev/null)" != "$s3_identity" ]]; then
    log "the s3 stack's endpoint or keys changed since the server started: restarting it"
    stop_pidfile "$RUN/server.pid" "$PATTERN"
  fi
  if running "$RUN/server.pid" "$PATTERN" && [[ "$(cat "$RUN/server.app" 2>/dev/null)" != "$APP" ]]; then
    log "the server runs without a login (an older \`up\` started it): restarting it with --app-name $APP"
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
      MLFLOW_AUTH_CONFIG_PATH="$RUN/basic_auth.ini" \
      MLFLOW_FLASK_SERVER_SECRET_KEY="$(cat "$RUN/flask-secret.key")" \
      PYTHONPATH="${PYDEPS_PATH}" \
      setsid nohup "$MLFLOW" server --host 127.0.0.1 --port "$PORT" --app-name "$APP" --workers 1 \
      --backend-store-uri "postgresql+psycopg2://$PG_USER@$PG_HOST:$PG_PORT/$DB" \
      --artifacts-destination "s3://$BUCKET/" \
      >>"$RUN/server.log" 2>&1 </dev/null &
    echo $! >"$RUN/server.pid"
    echo "$s3_identity" >"$RUN/server.s3"
    echo "$APP" >"$RUN/server.app"
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
  (
    umask 077
    {
      echo "MLFLOW_TRACKING_URI=$URL"
      echo "MLFLOW_ARTIFACTS_DESTINATION=s3://$BUCKET/"
      echo "MLFLOW_DATABASE=$DB"
      echo "MLFLOW_TRACKING_USERNAME=$TESTS_USER"
      echo "MLFLOW_TRACKING_PASSWORD=$(cat "$RUN/tests-password")"
      echo "MLFLOW_PASSWORD_FILE=$RUN/tests-password"
    } >"$tmp"
  )
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
  ensure_secrets
  start_server
  ensure_tests_user
  write_env
  log "ready: MLFLOW_TRACKING_URI=$URL, login $TESTS_USER (env in $RUN/env)"
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
