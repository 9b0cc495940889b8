#!/usr/bin/env bash
# A Prefect server on this machine's PostgreSQL, the `gpuferry` process work pool, one worker for it
# (deployments/worker.py) and the automation that marks runs whose process died Crashed (deployments/crashed_runs.py).
#
#   bash scripts/prefect.sh up     # idempotent: a second `up` only checks that everything answers
#   bash scripts/prefect.sh down   # stops the worker and the server it started; keeps the database
#
# Settings (environment): GPUFERRY_PREFECT_PORT (4290), GPUFERRY_PREFECT_DB (gpuferry_prefect),
# GPUFERRY_PG_HOST (127.0.0.1), GPUFERRY_PG_PORT (5432), GPUFERRY_PG_USER (postgres; trust auth on loopback),
# GPUFERRY_PREFECT_POOL (gpuferry).
# Also installs Debian's chromium: tests/test_prefect_ui.py drives the UI in it (Playwright pointed at
# /usr/bin/chromium; the drivers' own browser downloads do not work here). GPUFERRY_SKIP_CHROMIUM=1 skips that.
# Writes $GPUFERRY_STACKS/prefect/env: PREFECT_API_URL, PREFECT_UI_URL, PREFECT_WORK_POOL, GPUFERRY_WORKER_HOME
# (the GPUFERRY_HOME of the flow runs the worker starts: the embedded backends' state), GPUFERRY_CODE_DIR.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPUFERRY_CACHE="${GPUFERRY_CACHE:-$HOME/.cache/gpuferry}"
GPUFERRY_STACKS="${GPUFERRY_STACKS:-$GPUFERRY_CACHE/stacks}"
RUN="$GPUFERRY_STACKS/prefect"
PORT="${GPUFERRY_PREFECT_PORT:-4290}"
DB="${GPUFERRY_PREFECT_DB:-gpuferry_prefect}"
PG_HOST="${GPUFERRY_PG_HOST:-127.0.0.1}"
PG_PORT="${GPUFERRY_PG_PORT:-5432}"
PG_USER="${GPUFERRY_PG_USER:-postgres}"
POOL="${GPUFERRY_PREFECT_POOL:-gpuferry}"
PREFECT="$REPO/.venv/bin/prefect"
API_URL="http://127.0.0.1:$PORT/api"
# The worker: deployments/worker.py (Prefect's process worker with a pre-started flow-run process); a
# worker started by an earlier version of this script (`prefect worker start`) counts as running too.
WORKER_PATTERN='deployments[.]worker\|prefect worker start'

log() { echo "[prefect] $*"; }
die() { echo "[prefect] ERROR: $*" >&2; exit 1; }

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

healthy() { curl -fsS -m 5 "$API_URL/health" >/dev/null 2>&1; }

# Common environment of every Prefect process this script starts.
prefect_env() {
  export PREFECT_HOME="$RUN/home"
  export PREFECT_API_URL="$API_URL"
  export PREFECT_SERVER_ANALYTICS_ENABLED=false
  export PREFECT_SERVER_DATABASE_CONNECTION_URL="postgresql+asyncpg://$PG_USER@$PG_HOST:$PG_PORT/$DB"
  export PREFECT_UI_API_URL="$API_URL"
  export PREFECT_CLI_PROMPT=false
  mkdir -p "$PREFECT_HOME"
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

start_server() {
  if running "$RUN/server.pid" "prefect server start" && healthy; then
    log "server already up at $API_URL"
    return
  fi
  if running "$RUN/server.pid" "prefect server start"; then
    log "server process $(cat "$RUN/server.pid") is starting; waiting for it"
  else
    log "starting the server on 127.0.0.1:$PORT (database $DB)"
    # A run that waits for a deployment's concurrency slot is offered again after this many seconds (default 30).
    PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS="${PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS:-2}" \
      setsid nohup "$PREFECT" server start --host 127.0.0.1 --port "$PORT" \
      >>"$RUN/server.log" 2>&1 </dev/null &
    echo $! >"$RUN/server.pid"
  fi
  local deadline=$((SECONDS + 240))
  until healthy; do
    running "$RUN/server.pid" "prefect server start" \
      || die "the server exited; last lines of $RUN/server.log:
$(tail -n 30 "$RUN/server.log")"
    ((SECONDS < deadline)) || die "the server did not answer $API_URL/health within 240 s; last lines of $RUN/server.log:
$(tail -n 30 "$RUN/server.log")"
    sleep 1
  done
  log "server up at $API_URL"
}

ensure_pool() {
  if "$PREFECT" work-pool inspect "$POOL" >/dev/null 2>&1; then
    return
  fi
  log "creating the process work pool $POOL"
  "$PREFECT" work-pool create "$POOL" --type process >/dev/null 2>&1 \
    || "$PREFECT" work-pool inspect "$POOL" >/dev/null \
    || die "could not create the work pool $POOL"
}

# A run whose process died with its worker stays Running unless something marks it: the heartbeat
# automation of deployments/crashed_runs.py crashes it (idempotent: updated in place when it exists).
ensure_crash_automation() {
  PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$REPO/.venv/bin/python" -m deployments.crashed_runs >/dev/null \
    || die "could not register the crashed-run automation (python -m deployments.crashed_runs)"
}

start_worker() {
  if running "$RUN/worker.pid" "$WORKER_PATTERN"; then
    log "worker already running (pid $(cat "$RUN/worker.pid"))"
    return
  fi
  mkdir -p "$RUN/gpuferry-home"
  log "starting a process worker for $POOL"
  # The flow runs it starts inherit this environment: GPUFERRY_CODE_DIR is what prefect.yaml's pull step
  # changes into, GPUFERRY_HOME where the embedded backends keep their state. The worker keeps one flow-run
  # process started ahead, with the project's flows imported (deployments/worker.py).
  GPUFERRY_CODE_DIR="$REPO" GPUFERRY_HOME="$RUN/gpuferry-home" \
    PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-1}" \
    PREFECT_WORKER_PREFETCH_SECONDS="${PREFECT_WORKER_PREFETCH_SECONDS:-5}" \
    PREFECT_RUNNER_POLL_FREQUENCY="${PREFECT_RUNNER_POLL_FREQUENCY:-1}" \
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" \
    setsid nohup "$REPO/.venv/bin/python" -m deployments.worker --pool "$POOL" --name "gpuferry-$(hostname -s)" \
    --code-dir "$REPO" \
    >>"$RUN/worker.log" 2>&1 </dev/null &
  echo $! >"$RUN/worker.pid"
  # Ready once the server lists it as a worker of the pool.
  local deadline=$((SECONDS + 120))
  until "$REPO/.venv/bin/python" - "$POOL" <<'EOF' 2>/dev/null
import sys
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as c:
    sys.exit(0 if c.read_workers_for_work_pool(sys.argv[1]) else 1)
EOF
  do
    running "$RUN/worker.pid" "$WORKER_PATTERN" \
      || die "the worker exited; last lines of $RUN/worker.log:
$(tail -n 30 "$RUN/worker.log")"
    ((SECONDS < deadline)) || die "the worker did not register within 120 s; last lines of $RUN/worker.log:
$(tail -n 30 "$RUN/worker.log")"
    sleep 1
  done
  log "worker up (pid $(cat "$RUN/worker.pid"))"
}

# Stop the process in $1 (and its session): SIGINT, then SIGTERM, then SIGKILL.
# The browser of the UI test (a test dependency of this stack).
ensure_chromium() {
  [[ "${GPUFERRY_SKIP_CHROMIUM:-0}" == 1 ]] && return
  [[ -x /usr/bin/chromium ]] && return
  log "installing Debian's chromium (the browser of the UI test)"
  apt-get -o DPkg::Lock::Timeout=900 install -y chromium >>"$RUN/apt.log" 2>&1 \
    || { apt-get -o DPkg::Lock::Timeout=900 update >>"$RUN/apt.log" 2>&1 \
         && apt-get -o DPkg::Lock::Timeout=900 install -y chromium >>"$RUN/apt.log" 2>&1; } \
    || die "could not install chromium; last lines of $RUN/apt.log:
$(tail -n 20 "$RUN/apt.log")"
}

write_env() {
  local tmp="$RUN/env.tmp"
  {
    echo "PREFECT_API_URL=$API_URL"
    echo "PREFECT_UI_URL=http://127.0.0.1:$PORT"
    echo "PREFECT_WORK_POOL=$POOL"
    echo "PREFECT_DATABASE=$DB"
    echo "GPUFERRY_WORKER_HOME=$RUN/gpuferry-home"
    echo "GPUFERRY_CODE_DIR=$REPO"
  } >"$tmp"
  mv "$tmp" "$RUN/env"
}

up() {
  [[ -x "$PREFECT" ]] || die "$PREFECT missing: run \`make venv\` first"
  command -v curl >/dev/null || apt-get -o DPkg::Lock::Timeout=900 install -y curl >/dev/null
  mkdir -p "$RUN"
  prefect_env
  ensure_database
  start_server
  ensure_pool
  ensure_crash_automation
  start_worker
  ensure_chromium
  write_env
  log "ready: PREFECT_API_URL=$API_URL, work pool $POOL (env in $RUN/env)"
}

down() {
  rm -f "$RUN/env"
  # The worker first (it would otherwise keep polling a server that is gone), then the server.
  stop_pidfile "$RUN/worker.pid" "$WORKER_PATTERN"
  stop_pidfile "$RUN/server.pid" "prefect server start"
  log "stopped (database $DB kept)"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
