# Sourced by the stack scripts: the pid-file, stop and wait helpers they share. Each script defines
# its own log() and die() first.

# running PIDFILE PATTERN: the pid file names a live process whose command line contains PATTERN
# (not a recycled pid).
running() {
  local pidfile="$1" pattern="$2" pid
  [[ -f "$pidfile" ]] || return 1
  pid="$(cat "$pidfile")"
  [[ -n "$pid" && -r "/proc/$pid/cmdline" ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$pattern"
}

# stop_pidfile PIDFILE PATTERN: stop the process `running` finds (SIGINT, then SIGTERM, 10 s each,
# then SIGKILL to its process group: a server started with setsid takes its workers with it).
stop_pidfile() {
  local pidfile="$1" pattern="$2" pid sig
  if ! running "$pidfile" "$pattern"; then
    rm -f "$pidfile"
    return
  fi
  pid="$(cat "$pidfile")"
  for sig in INT TERM; do
    kill -s "$sig" "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
      running "$pidfile" "$pattern" || break 2
      sleep 0.2
    done
  done
  if running "$pidfile" "$pattern"; then
    kill -s KILL -- "-$pid" 2>/dev/null || kill -s KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

# pid_alive PIDFILE COMM: the pid file names a live (not zombie) process whose name starts with COMM.
pid_alive() {
  local pid stat
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  [[ -r /proc/$pid/comm ]] && [[ $(</proc/"$pid"/comm) == "$2"* ]] || return 1
  stat=$(</proc/"$pid"/stat) || return 1
  stat=${stat##*) }
  [[ ${stat:0:1} != Z ]]   # a zombie is dead
}

# stop_pid PIDFILE COMM: SIGTERM, 15 s, then SIGKILL.
stop_pid() {
  local pidfile=$1 comm=$2 pid i
  if pid_alive "$pidfile" "$comm"; then
    pid=$(<"$pidfile")
    kill "$pid" 2>/dev/null || true
    for i in $(seq 1 150); do pid_alive "$pidfile" "$comm" || break; sleep 0.1; done
    if pid_alive "$pidfile" "$comm"; then log "$comm ($pid) ignores SIGTERM; SIGKILL"; kill -9 "$pid" || true; fi
    log "stopped $comm ($pid)"
  fi
  rm -f "$pidfile"
}

# wait_for SECONDS LOGFILE DESCRIPTION COMMAND...: poll COMMAND until it succeeds; past the deadline,
# show LOGFILE's last lines and exit.
wait_for() {
  local seconds=$1 logfile=$2 what=$3 deadline
  shift 3
  deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      log "$what did not happen within ${seconds}s; last lines of $logfile:"
      tail -n 30 "$logfile" >&2 2>/dev/null || true
      exit 1
    fi
    sleep 0.2
  done
}
