# Sourced by the stack scripts that keep their state in the machine's PostgreSQL (mlflow, prefect).
# ensure_postgres HOST PORT USER: the server answers, or the machine's own cluster is started (it is
# a shared system service: started when down, never stopped by us), or a clear error.
ensure_postgres() {
  local host=$1 port=$2 user=$3
  command -v psql >/dev/null || apt-get -o DPkg::Lock::Timeout=900 install -y postgresql-client >/dev/null
  psql -h "$host" -p "$port" -U "$user" -d postgres -qtAc 'select 1' >/dev/null 2>&1 && return 0
  if command -v pg_lsclusters >/dev/null; then
    local version name
    while read -r version name _; do
      echo "starting the machine's PostgreSQL cluster $version/$name" >&2
      pg_ctlcluster --skip-systemctl-redirect "$version" "$name" start || true
    done < <(pg_lsclusters --no-header | awk '$4 == "down" {print $1, $2}')
    local i
    for i in $(seq 1 60); do
      psql -h "$host" -p "$port" -U "$user" -d postgres -qtAc 'select 1' >/dev/null 2>&1 && return 0
      sleep 0.5
    done
  fi
  echo "PostgreSQL does not answer at $host:$port as $user: start it (pg_ctlcluster <version> main start)" >&2
  return 1
}
