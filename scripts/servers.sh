#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Throwaway redis-server and PostgreSQL 15 on loopback, for tests and benchmarks.
#
#   scripts/servers.sh start      start both (idempotent), print the variables to export
#   scripts/servers.sh stop       stop both and delete their data
#   scripts/servers.sh env        print the variables to export
#   scripts/servers.sh status     say what runs
#   scripts/servers.sh redis-start | redis-stop | redis-kill     (fault tests: kill -9, restart)
#   scripts/servers.sh pg-start | pg-stop | pg-restart [fast|immediate]
#
# Settings (environment): IDEM_SERVERS_DIR (default /tmp/idem-servers), IDEM_REDIS_PORT
# (16379), IDEM_PG_PORT (15432). PostgreSQL refuses to run as root, so it runs as the
# `postgres` user (created if missing); its data lives under IDEM_SERVERS_DIR, which must be
# reachable by that user (hence /tmp, not the checkout).
set -euo pipefail

DIR="${IDEM_SERVERS_DIR:-/tmp/idem-servers}"
REDIS_PORT="${IDEM_REDIS_PORT:-16379}"
PG_PORT="${IDEM_PG_PORT:-15432}"
PG_BIN="${IDEM_PG_BIN:-/usr/lib/postgresql/15/bin}"
PG_DB="idem_test"

log() { echo "servers: $*" >&2; }

as_postgres() {
  if [ "$(id -un)" = "postgres" ]; then
    "$@"
  elif [ "$(id -u)" -eq 0 ]; then
    runuser -u postgres -- "$@"
  else
    sudo -u postgres -- "$@"
  fi
}

ensure_dir() {
  mkdir -p "$DIR"
  chmod 0755 "$DIR"
}

redis_alive() {
  [ "$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" PING 2>/dev/null || true)" = "PONG" ]
}

redis_start() {
  ensure_dir
  if redis_alive; then return 0; fi
  mkdir -p "$DIR/redis"
  rm -f "$DIR/redis.pid"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$DIR/redis" --save '' \
    --appendonly no --daemonize yes --pidfile "$DIR/redis.pid" \
    --logfile "$DIR/redis.log" --protected-mode yes
  for _ in $(seq 1 100); do
    if redis_alive; then return 0; fi
    sleep 0.1
  done
  log "redis-server did not answer PING on port $REDIS_PORT"; tail -20 "$DIR/redis.log" >&2 || true
  return 1
}

redis_pid() { cat "$DIR/redis.pid" 2>/dev/null || pgrep -f "redis-server 127.0.0.1:$REDIS_PORT" | head -1; }

redis_stop() {
  if redis_alive; then redis-cli -h 127.0.0.1 -p "$REDIS_PORT" SHUTDOWN NOSAVE >/dev/null 2>&1 || true; fi
  local pid; pid="$(redis_pid || true)"
  if [ -n "${pid:-}" ]; then kill -9 "$pid" 2>/dev/null || true; fi
  rm -f "$DIR/redis.pid"
  for _ in $(seq 1 50); do redis_alive || return 0; sleep 0.1; done
}

redis_kill() {
  local pid; pid="$(redis_pid || true)"
  [ -n "${pid:-}" ] && kill -9 "$pid" 2>/dev/null || true
  rm -f "$DIR/redis.pid"
  for _ in $(seq 1 50); do redis_alive || return 0; sleep 0.1; done
}

pg_alive() { "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -U postgres 2>/dev/null; }

pg_start() {
  ensure_dir
  if pg_alive; then return 0; fi
  if ! id postgres >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then useradd --system --home-dir /var/lib/postgresql --shell /bin/sh postgres; fi
  fi
  if [ ! -s "$DIR/pgdata/PG_VERSION" ]; then
    rm -rf "$DIR/pgdata"
    install -d -o postgres -m 0700 "$DIR/pgdata"
    as_postgres "$PG_BIN/initdb" -D "$DIR/pgdata" -U postgres --no-locale -E UTF8 -A trust >"$DIR/initdb.log" 2>&1 \
      || { cat "$DIR/initdb.log" >&2; return 1; }
    cat >>"$DIR/pgdata/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = ''
max_connections = 200
shared_buffers = 128MB
fsync = on
synchronous_commit = on
logging_collector = off
CONF
  fi
  touch "$DIR/postgres.log"; chown postgres "$DIR/postgres.log"
  as_postgres "$PG_BIN/pg_ctl" -D "$DIR/pgdata" -l "$DIR/postgres.log" -w -t 60 start >/dev/null \
    || { tail -30 "$DIR/postgres.log" >&2; return 1; }
  for _ in $(seq 1 100); do pg_alive && break; sleep 0.1; done
  pg_alive || { log "PostgreSQL did not become ready"; return 1; }
  if ! psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='$PG_DB'" | grep -q 1; then
    psql -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -c "CREATE DATABASE $PG_DB" >/dev/null
  fi
}

pg_stop() {
  if [ -s "$DIR/pgdata/PG_VERSION" ] && pg_alive; then
    as_postgres "$PG_BIN/pg_ctl" -D "$DIR/pgdata" -m fast -w -t 60 stop >/dev/null 2>&1 || true
  fi
}

pg_restart() {
  local mode="${1:-fast}"
  as_postgres "$PG_BIN/pg_ctl" -D "$DIR/pgdata" -m "$mode" -w -t 60 stop >/dev/null 2>&1 || true
  pg_start
}

print_env() {
  echo "export IDEM_TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT"
  echo "export IDEM_TEST_POSTGRES_DSN=\"host=127.0.0.1 port=$PG_PORT user=postgres dbname=$PG_DB\""
  echo "export IDEM_SERVERS_SCRIPT=$(cd "$(dirname "$0")" && pwd)/servers.sh"
  echo "export IDEM_SERVERS_DIR=$DIR IDEM_REDIS_PORT=$REDIS_PORT IDEM_PG_PORT=$PG_PORT"
}

cmd="${1:-}"
case "$cmd" in
  start) redis_start; pg_start; print_env ;;
  stop) redis_stop; pg_stop; rm -rf "$DIR" ;;
  env) print_env ;;
  status)
    redis_alive && echo "redis: up on 127.0.0.1:$REDIS_PORT" || echo "redis: down"
    pg_alive && echo "postgres: up on 127.0.0.1:$PG_PORT" || echo "postgres: down" ;;
  redis-start) redis_start ;;
  redis-stop) redis_stop ;;
  redis-kill) redis_kill ;;
  pg-start) pg_start ;;
  pg-stop) pg_stop ;;
  pg-restart) pg_restart "${2:-fast}" ;;
  *) sed -n '3,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
