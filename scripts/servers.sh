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
#   scripts/servers.sh cluster    Redis Cluster: 3 masters + 3 replicas (ports IDEM_CLUSTER_PORT..+5)
#   scripts/servers.sh cluster-node-kill PORT | cluster-node-start PORT   (kill -9 one node;
#                                 restart it with its nodes.conf: it rejoins, as a replica if it
#                                 was failed over)
#   scripts/servers.sh sentinel   1 master, 1 replica, 3 sentinels (IDEM_SENTINEL_PORT..: +0 master,
#                                 +1 replica, +10..+12 sentinels), service name idem-master
#   scripts/servers.sh mysql      MariaDB (IDEM_MYSQL_PORT, default 13306), database idem_test,
#                                 user idem / password idem over TCP (IDEM_TEST_MYSQL_URI),
#                                 TLS offered with the test-made certificates (IDEM_TEST_MYSQL_TLS_DIR)
#   scripts/servers.sh mysql-start | mysql-stop | mysql-kill | mysql-restart [kill]
#                                 (mysql-kill: kill -9; mysql-restart kill: kill -9, then start,
#                                 which runs InnoDB crash recovery)
#   scripts/servers.sh rabbitmq-start | rabbitmq-stop | rabbitmq-restart
#                                 a RabbitMQ node (AMQP on IDEM_RABBITMQ_PORT, AMQPS with the
#                                 test-made certificates on IDEM_RABBITMQ_TLS_PORT, default one
#                                 below, its own epmd on IDEM_EPMD_PORT); restart keeps its
#                                 queues and messages
#   scripts/servers.sh rabbitmq-eval EXPR
#                                 rabbitmqctl eval on that node (tests change its settings)
#   scripts/servers.sh tls        a CA and certificates made now (openssl, in IDEM_SERVERS_DIR/tls),
#                                 redis-server with TLS only on IDEM_TLS_PORT (client certificates
#                                 optional, verified when sent) and a PostgreSQL with ssl=on on
#                                 IDEM_PG_TLS_PORT (TLS required; role idem_pw with a password)
#   scripts/servers.sh tls-certs  only the certificates (prints their directory)
#
# Settings (environment): IDEM_SERVERS_DIR (default /tmp/idem-servers), IDEM_REDIS_PORT
# (16379), IDEM_PG_PORT (15432), IDEM_CLUSTER_PORT (17000), IDEM_SENTINEL_PORT (17100),
# IDEM_TLS_PORT (16380), IDEM_PG_TLS_PORT (IDEM_TLS_PORT + 1), IDEM_MYSQL_PORT (13306),
# IDEM_RABBITMQ_PORT (18672), IDEM_RABBITMQ_DIST_PORT (18673; its CLI tools take the 10 ports
# above it), IDEM_EPMD_PORT (18369), IDEM_RABBITMQ_ERL_ARGS (extra Erlang VM flags, e.g. +S 1:1).
# PostgreSQL refuses to run as root, so it runs as the `postgres` user (created if missing);
# its data lives under IDEM_SERVERS_DIR, which must be reachable by that user (hence /tmp, not
# the checkout).
set -euo pipefail

DIR="${IDEM_SERVERS_DIR:-/tmp/idem-servers}"
REDIS_PORT="${IDEM_REDIS_PORT:-16379}"
PG_PORT="${IDEM_PG_PORT:-15432}"
PG_BIN="${IDEM_PG_BIN:-/usr/lib/postgresql/15/bin}"
PG_DB="idem_test"
CLUSTER_PORT="${IDEM_CLUSTER_PORT:-17000}"
SENTINEL_PORT="${IDEM_SENTINEL_PORT:-17100}"
MYSQL_PORT="${IDEM_MYSQL_PORT:-13306}"
MYSQL_DB="idem_test"
RABBITMQ_PORT="${IDEM_RABBITMQ_PORT:-18672}"
RABBITMQ_DIST_PORT="${IDEM_RABBITMQ_DIST_PORT:-18673}"
EPMD_PORT="${IDEM_EPMD_PORT:-18369}"
RABBITMQ_TLS_PORT="${IDEM_RABBITMQ_TLS_PORT:-$((RABBITMQ_PORT - 1))}"
RABBITMQ_BIN="${IDEM_RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}"
TLS_PORT="${IDEM_TLS_PORT:-16380}"
PG_TLS_PORT="${IDEM_PG_TLS_PORT:-$((TLS_PORT + 1))}"

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

# A redis-server on loopback: start_node <name> <port> [extra args...]
start_node() {
  local name="$1" port="$2"; shift 2
  mkdir -p "$DIR/$name"
  if [ "$(redis-cli -h 127.0.0.1 -p "$port" PING 2>/dev/null || true)" = "PONG" ]; then return 0; fi
  redis-server --port "$port" --bind 127.0.0.1 --dir "$DIR/$name" --save '' --appendonly no \
    --daemonize yes --pidfile "$DIR/$name.pid" --logfile "$DIR/$name.log" "$@"
  for _ in $(seq 1 100); do
    [ "$(redis-cli -h 127.0.0.1 -p "$port" PING 2>/dev/null || true)" = "PONG" ] && return 0
    sleep 0.1
  done
  log "redis node $name did not start on port $port"; tail -20 "$DIR/$name.log" >&2 || true
  return 1
}

cluster_alive() {
  redis-cli -h 127.0.0.1 -p "$CLUSTER_PORT" CLUSTER INFO 2>/dev/null | grep -q 'cluster_state:ok'
}

cluster_node_start() {
  local port="$1"
  start_node "cluster-$port" "$port" --cluster-enabled yes \
    --cluster-config-file "nodes-$port.conf" --cluster-node-timeout 2000
}

cluster_node_kill() {
  local port="$1" pidfile="$DIR/cluster-$1.pid"
  [ -s "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
  rm -f "$pidfile"
  for _ in $(seq 1 50); do
    [ "$(redis-cli -h 127.0.0.1 -p "$port" PING 2>/dev/null || true)" = "PONG" ] || return 0
    sleep 0.1
  done
  log "cluster node $port did not die"; return 1
}

cluster_start() {
  ensure_dir
  if cluster_alive; then return 0; fi
  local nodes=()
  for i in 0 1 2 3 4 5; do
    local port=$((CLUSTER_PORT + i))
    cluster_node_start "$port"
    nodes+=("127.0.0.1:$port")
  done
  redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$DIR/cluster-create.log" 2>&1 \
    || { cat "$DIR/cluster-create.log" >&2; return 1; }
  for _ in $(seq 1 200); do
    local ok=1
    for i in 0 1 2 3 4 5; do
      redis-cli -h 127.0.0.1 -p $((CLUSTER_PORT + i)) CLUSTER INFO 2>/dev/null | grep -q 'cluster_state:ok' || ok=0
    done
    [ "$ok" -eq 1 ] && return 0
    sleep 0.1
  done
  log "cluster did not reach cluster_state:ok"; return 1
}

sentinel_alive() {
  [ "$(redis-cli -h 127.0.0.1 -p $((SENTINEL_PORT + 10)) PING 2>/dev/null || true)" = "PONG" ]
}

sentinel_start() {
  ensure_dir
  if sentinel_alive; then return 0; fi
  local master=$SENTINEL_PORT replica=$((SENTINEL_PORT + 1))
  start_node "sentinel-master-$master" "$master"
  start_node "sentinel-replica-$replica" "$replica" --replicaof 127.0.0.1 "$master"
  for i in 10 11 12; do
    local port=$((SENTINEL_PORT + i)) conf="$DIR/sentinel-$((SENTINEL_PORT + i)).conf"
    cat >"$conf" <<CONF
port $port
bind 127.0.0.1
daemonize yes
pidfile $DIR/sentinel-$port.pid
logfile $DIR/sentinel-$port.log
dir $DIR
sentinel monitor idem-master 127.0.0.1 $master 2
sentinel down-after-milliseconds idem-master 1000
sentinel failover-timeout idem-master 5000
sentinel parallel-syncs idem-master 1
CONF
    redis-server "$conf" --sentinel
  done
  for _ in $(seq 1 100); do
    if sentinel_alive && redis-cli -h 127.0.0.1 -p "$replica" INFO replication 2>/dev/null | grep -q 'master_link_status:up'; then
      return 0
    fi
    sleep 0.1
  done
  log "sentinel setup did not become ready"; return 1
}

# --- TLS: certificates made now, Redis with --tls-port, PostgreSQL with ssl=on -------------------
# $DIR/tls: ca.pem (the CA tests trust), server.pem/-key.pem (names localhost and 127.0.0.1),
# client.pem/-key.pem (signed by the CA), other-ca.pem and other-client.pem/-key.pem (a CA
# nobody trusts, and a client certificate it signed).
# Made once per directory, under a lock: servers started in parallel (scripts/test.sh starts
# RabbitMQ beside MariaDB and the TLS servers) would otherwise both make a CA, and one server
# would present a certificate the ca.pem left on disk did not sign.
tls_certs() {
  mkdir -p "$DIR"
  ( flock 9; tls_certs_locked ) 9>"$DIR/tls.lock"
}

tls_certs_locked() {
  local t="$DIR/tls"
  [ -s "$t/other-client.pem" ] && return 0
  mkdir -p "$t"; chmod 0755 "$t"
  local ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
  for ca in ca other-ca; do
    openssl req -x509 -new "${ec[@]}" -keyout "$t/$ca-key.pem" -out "$t/$ca.pem" -days 3 \
      -subj "/CN=idem test $ca" 2>/dev/null
  done
  sign() {  # sign <name> <ca> <subject> <extensions>
    openssl req -new "${ec[@]}" -keyout "$t/$1-key.pem" -out "$t/$1.csr" -subj "$3" 2>/dev/null
    printf '%s\n' "$4" >"$t/$1.ext"
    openssl x509 -req -in "$t/$1.csr" -CA "$t/$2.pem" -CAkey "$t/$2-key.pem" -CAcreateserial \
      -out "$t/$1.pem" -days 3 -extfile "$t/$1.ext" 2>/dev/null
  }
  sign server ca "/CN=localhost" "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
  sign client ca "/CN=idem-client" "extendedKeyUsage=clientAuth"
  sign other-client other-ca "/CN=idem-client" "extendedKeyUsage=clientAuth"
  chmod 0644 "$t"/*.pem
}

redis_tls_alive() {
  [ "$(redis-cli --tls --cacert "$DIR/tls/ca.pem" -h 127.0.0.1 -p "$TLS_PORT" PING 2>/dev/null || true)" = "PONG" ]
}

redis_tls_start() {
  ensure_dir; tls_certs
  if redis_tls_alive; then return 0; fi
  mkdir -p "$DIR/redis-tls"
  redis-server --port 0 --tls-port "$TLS_PORT" --bind 127.0.0.1 --dir "$DIR/redis-tls" --save '' \
    --appendonly no --daemonize yes --pidfile "$DIR/redis-tls.pid" --logfile "$DIR/redis-tls.log" \
    --tls-cert-file "$DIR/tls/server.pem" --tls-key-file "$DIR/tls/server-key.pem" \
    --tls-ca-cert-file "$DIR/tls/ca.pem" --tls-auth-clients optional
  for _ in $(seq 1 100); do
    if redis_tls_alive; then return 0; fi
    sleep 0.1
  done
  log "redis-server (TLS) did not answer PING on port $TLS_PORT"; tail -20 "$DIR/redis-tls.log" >&2 || true
  return 1
}

pg_tls_alive() { "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_TLS_PORT" -U postgres 2>/dev/null; }

# A second PostgreSQL (the test instance stays without TLS, so its clients keep their cost):
# ssl=on with the test-made certificate, TLS required by pg_hba.conf, trust for postgres and a
# password (SCRAM) for role idem_pw, whose password is in $DIR/tls/pg-password.
pg_tls_start() {
  ensure_dir; tls_certs
  if pg_tls_alive; then return 0; fi
  local data="$DIR/pgdata-tls"
  if [ ! -s "$data/PG_VERSION" ]; then
    rm -rf "$data"
    install -d -o postgres -m 0700 "$data"
    as_postgres "$PG_BIN/initdb" -D "$data" -U postgres --no-locale -E UTF8 -A trust >"$DIR/initdb-tls.log" 2>&1 \
      || { cat "$DIR/initdb-tls.log" >&2; return 1; }
    install -o postgres -m 0600 "$DIR/tls/server.pem" "$data/server.crt"
    install -o postgres -m 0600 "$DIR/tls/server-key.pem" "$data/server.key"
    cat >>"$data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PG_TLS_PORT
unix_socket_directories = ''
max_connections = 50
ssl = on
ssl_cert_file = 'server.crt'
ssl_key_file = 'server.key'
password_encryption = 'scram-sha-256'
logging_collector = off
CONF
    cat >"$data/pg_hba.conf" <<HBA
hostssl all postgres 127.0.0.1/32 trust
hostssl all idem_pw 127.0.0.1/32 scram-sha-256
hostnossl all all 127.0.0.1/32 reject
HBA
    chown postgres "$data/pg_hba.conf"
  fi
  touch "$DIR/postgres-tls.log"; chown postgres "$DIR/postgres-tls.log"
  as_postgres "$PG_BIN/pg_ctl" -D "$data" -l "$DIR/postgres-tls.log" -w -t 60 start >/dev/null \
    || { tail -30 "$DIR/postgres-tls.log" >&2; return 1; }
  for _ in $(seq 1 100); do pg_tls_alive && break; sleep 0.1; done
  pg_tls_alive || { log "PostgreSQL (TLS) did not become ready"; return 1; }
  local pw="$DIR/tls/pg-password"
  [ -s "$pw" ] || openssl rand -hex 16 >"$pw"
  PGSSLMODE=require psql -q -h 127.0.0.1 -p "$PG_TLS_PORT" -U postgres -v pw="$(cat "$pw")" <<'SQL' >/dev/null
SELECT 'CREATE DATABASE idem_test' WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'idem_test')\gexec
DO $$BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'idem_pw') THEN CREATE ROLE idem_pw LOGIN; END IF; END$$;
ALTER ROLE idem_pw PASSWORD :'pw';
GRANT ALL ON DATABASE idem_test TO idem_pw;
SQL
  PGSSLMODE=require psql -q -h 127.0.0.1 -p "$PG_TLS_PORT" -U postgres -d idem_test \
    -c "GRANT ALL ON SCHEMA public TO idem_pw" \
    -c "ALTER DEFAULT PRIVILEGES FOR ROLE postgres IN SCHEMA public GRANT ALL ON TABLES TO idem_pw" \
    -c "GRANT ALL ON ALL TABLES IN SCHEMA public TO idem_pw" >/dev/null
}

pg_tls_stop() {
  if [ -s "$DIR/pgdata-tls/PG_VERSION" ] && pg_tls_alive; then
    as_postgres "$PG_BIN/pg_ctl" -D "$DIR/pgdata-tls" -m fast -w -t 60 stop >/dev/null 2>&1 || true
  fi
}

stop_all_redis_in_dir() {
  for pidfile in "$DIR"/*.pid; do
    [ -e "$pidfile" ] || continue
    kill -9 "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
  done
}

# --- MariaDB ---------------------------------------------------------------------------------
# Runs as root with --user=root (mariadbd refuses root otherwise); TCP on 127.0.0.1 only, its
# socket and data under $DIR/mysql. `mariadb-admin ping` answers even "Access denied", so
# readiness is a real query over TCP with the test user.
mysql_cli() {
  mariadb --no-defaults --protocol=tcp -h127.0.0.1 -P"$MYSQL_PORT" "$@"
}

mysql_alive() { mysql_cli -uidem -pidem -e 'SELECT 1' >/dev/null 2>&1; }

mysql_pid() { cat "$DIR/mysql/mariadb.pid" 2>/dev/null || true; }

mysql_port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$MYSQL_PORT") 2>/dev/null; }

mysql_start() {
  ensure_dir
  if mysql_alive; then
    # Ours (started from this directory) is reused; another server on the port is not: its
    # tables and faults would be some other run's.
    [ -s "$DIR/mysql/mariadb.pid" ] && return 0
    log "port $MYSQL_PORT answers, but not a MariaDB this script started in $DIR (set IDEM_MYSQL_PORT)"
    return 1
  fi
  local d="$DIR/mysql"
  mkdir -p "$d"
  tls_certs
  # Its temporary tables live in its own directory, not /tmp: the bootstrap's temporary tables
  # once vanished from a shared /tmp while another instance bootstrapped beside it ("Unknown
  # table 'mysql.tmp_proxies_priv'"), and a second attempt starts from an empty data directory.
  mkdir -p "$d/tmp"
  local attempt
  for attempt in 1 2; do
    [ -d "$d/data/mysql" ] && break
    rm -rf "$d/data" "$d/tmp"/*
    if mariadb-install-db --no-defaults --datadir="$d/data" --tmpdir="$d/tmp" --user="$(id -un)" \
      --auth-root-authentication-method=normal --skip-test-db --innodb-log-file-size=8M \
      >"$d/install.log" 2>&1; then
      break
    fi
    cat "$d/install.log" >&2
    rm -rf "$d/data"
    [ "$attempt" -eq 2 ] && return 1
    log "MariaDB system tables: attempt $attempt failed, trying again"
  done
  rm -f "$d/mariadb.pid"
  # Server defaults are kept where idem must not depend on them (latin1 character set,
  # REPEATABLE READ, SYSTEM time zone); commits are flushed to disk (durable against kill -9).
  mariadbd --no-defaults --user="$(id -un)" --datadir="$d/data" --tmpdir="$d/tmp" \
    --socket="$d/mariadb.sock" --pid-file="$d/mariadb.pid" --port="$MYSQL_PORT" \
    --bind-address=127.0.0.1 --log-error="$d/mariadb.log" --skip-name-resolve --innodb-log-file-size=8M \
    --innodb-buffer-pool-size=64M --innodb-flush-log-at-trx-commit=1 --max-connections=400 \
    --skip-log-bin --ssl-ca="$DIR/tls/ca.pem" --ssl-cert="$DIR/tls/server.pem" \
    --ssl-key="$DIR/tls/server-key.pem" >/dev/null 2>&1 &
  for _ in $(seq 1 300); do
    if [ -S "$d/mariadb.sock" ] &&
       mariadb --no-defaults -S "$d/mariadb.sock" -uroot -e 'SELECT 1' >/dev/null 2>&1; then
      break
    fi
    sleep 0.1
  done
  # The TCP test user and database (idempotent: also after a restart).
  mariadb --no-defaults -S "$d/mariadb.sock" -uroot -e "
    CREATE USER IF NOT EXISTS 'idem'@'127.0.0.1' IDENTIFIED BY 'idem';
    GRANT ALL PRIVILEGES ON *.* TO 'idem'@'127.0.0.1' WITH GRANT OPTION;
    CREATE DATABASE IF NOT EXISTS $MYSQL_DB CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;" \
    >>"$d/install.log" 2>&1 || true
  for _ in $(seq 1 100); do
    if mysql_alive; then return 0; fi
    sleep 0.1
  done
  log "MariaDB did not answer a query on port $MYSQL_PORT"; tail -30 "$d/mariadb.log" >&2 || true
  return 1
}

# Waits until the server process has exited (a zombie counts as gone: pid 1 reaps it late) and
# its port is closed, so a start right after finds the data directory unlocked.
mysql_wait_down() {
  local pid="${1:-}"
  for _ in $(seq 1 600); do
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
       [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || echo Z)" != "Z" ]; then
      sleep 0.05; continue
    fi
    mysql_port_open || return 0
    sleep 0.05
  done
  log "MariaDB did not stop (port $MYSQL_PORT)"; return 1
}

mysql_stop() {
  # A directory that never held a MariaDB has none to stop: the port may be another tree's.
  [ -d "$DIR/mysql" ] || return 0
  local pid; pid="$(mysql_pid)"
  if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; fi
  if [ -n "$pid" ] || mysql_port_open; then mysql_wait_down "$pid" || return 1; fi
  rm -f "$DIR/mysql/mariadb.pid"
}

mysql_kill() {
  local pid; pid="$(mysql_pid)"
  if [ -n "$pid" ]; then kill -9 "$pid" 2>/dev/null || true; fi
  mysql_wait_down "$pid"
  rm -f "$DIR/mysql/mariadb.pid"
}

mysql_restart() {
  if [ "${1:-}" = "kill" ]; then mysql_kill; else mysql_stop; fi
  mysql_start
}

# --- RabbitMQ ----------------------------------------------------------------------------------
# One throwaway node, everything under $DIR/rabbitmq: HOME (with the Erlang cookie), config,
# mnesia, logs, pid file. It runs as root through /usr/lib/rabbitmq/bin (the /usr/sbin wrappers
# switch to the rabbitmq user and its cookie). Its epmd is our own, on EPMD_PORT and loopback
# only, started with -relaxed_command_check so that `epmd -kill` stops it whatever is
# registered; nodes of other trees register with their own epmd on their own port.
RABBITMQ_DIR="$DIR/rabbitmq"
RABBITMQ_NODE="idem$RABBITMQ_PORT@localhost"

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Runs a RabbitMQ or Erlang command with this node's environment (in place of the shell).
rabbitmq_exec() {
  exec env HOME="$RABBITMQ_DIR" \
    RABBITMQ_NODENAME="$RABBITMQ_NODE" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="$RABBITMQ_PORT" RABBITMQ_DIST_PORT="$RABBITMQ_DIST_PORT" \
    RABBITMQ_CTL_DIST_PORT_MIN=$((RABBITMQ_DIST_PORT + 1)) \
    RABBITMQ_CTL_DIST_PORT_MAX=$((RABBITMQ_DIST_PORT + 10)) \
    ERL_EPMD_PORT="$EPMD_PORT" ERL_EPMD_ADDRESS=127.0.0.1 \
    RABBITMQ_MNESIA_BASE="$RABBITMQ_DIR/mnesia" RABBITMQ_LOG_BASE="$RABBITMQ_DIR/log" \
    RABBITMQ_LOGS=- RABBITMQ_CONFIG_FILE="$RABBITMQ_DIR/rabbitmq.conf" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$RABBITMQ_DIR/enabled_plugins" \
    RABBITMQ_PID_FILE="$RABBITMQ_DIR/rabbitmq.pid" \
    RABBITMQ_CONF_ENV_FILE="$RABBITMQ_DIR/rabbitmq-env.conf" \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} ${IDEM_RABBITMQ_ERL_ARGS:-}" \
    "$@"
}
rabbitmq_env() { (rabbitmq_exec "$@"); }

rabbitmq_alive() { port_open "$RABBITMQ_PORT"; }

# True while process $1 runs (a zombie waiting for pid 1 to reap it does not count).
pid_running() { [ -n "${1:-}" ] && ps -o stat= -p "$1" 2>/dev/null | grep -qv '^Z'; }

# The node's Erlang VM (its command line names our HOME); the pid file is not always one pid.
rabbitmq_pid() { pgrep -f -- "beam.smp .* -home $RABBITMQ_DIR( |$)" | head -1; }

rabbitmq_start() {
  ensure_dir
  if rabbitmq_alive; then return 0; fi
  mkdir -p "$RABBITMQ_DIR/mnesia" "$RABBITMQ_DIR/log"
  tls_certs
  if [ ! -s "$RABBITMQ_DIR/.erlang.cookie" ]; then
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$RABBITMQ_DIR/.erlang.cookie"
    chmod 0400 "$RABBITMQ_DIR/.erlang.cookie"
  fi
  : >"$RABBITMQ_DIR/rabbitmq-env.conf"
  echo '[].' >"$RABBITMQ_DIR/enabled_plugins"
  cat >"$RABBITMQ_DIR/rabbitmq.conf" <<CONF
loopback_users = none
log.console = true
log.console.level = warning
log.file = false
disk_free_limit.absolute = 50MB
listeners.ssl.1 = 127.0.0.1:$RABBITMQ_TLS_PORT
ssl_options.cacertfile = $DIR/tls/ca.pem
ssl_options.certfile = $DIR/tls/server.pem
ssl_options.keyfile = $DIR/tls/server-key.pem
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
CONF
  if ! port_open "$EPMD_PORT"; then
    rabbitmq_env epmd -port "$EPMD_PORT" -address 127.0.0.1 -daemon -relaxed_command_check
    echo "$EPMD_PORT" >"$RABBITMQ_DIR/epmd.port"  # ours: stop kills it
  fi
  rm -f "$RABBITMQ_DIR/rabbitmq.pid"
  # A session of its own, and no descriptor of ours: a test that restarts the node must not
  # leave it holding the test's output pipe.
  rabbitmq_exec setsid "$RABBITMQ_BIN/rabbitmq-server" </dev/null >>"$RABBITMQ_DIR/rabbitmq.log" 2>&1 &
  for _ in $(seq 1 300); do
    if rabbitmq_alive; then return 0; fi
    sleep 0.1
  done
  log "RabbitMQ did not open port $RABBITMQ_PORT"; tail -30 "$RABBITMQ_DIR/rabbitmq.log" >&2 || true
  return 1
}

# Stops the node of this servers directory, and the epmd it started; nothing else (a node or an
# epmd on these ports that another directory started is left alone).
rabbitmq_stop() {
  [ -d "$RABBITMQ_DIR" ] || return 0
  local pid; pid="$(rabbitmq_pid || true)"
  if [ -n "$pid" ] || { rabbitmq_alive && [ -s "$RABBITMQ_DIR/.erlang.cookie" ]; }; then
    rabbitmq_env timeout 60 "$RABBITMQ_BIN/rabbitmqctl" -q stop >/dev/null 2>&1 || true
    for _ in $(seq 1 100); do
      if ! rabbitmq_alive && ! pid_running "$pid"; then break; fi
      sleep 0.1
    done
    if pid_running "$pid"; then
      kill -9 "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do pid_running "$pid" || break; sleep 0.1; done
    fi
    rm -f "$RABBITMQ_DIR/rabbitmq.pid"
  fi
  if [ -s "$RABBITMQ_DIR/epmd.port" ] && port_open "$EPMD_PORT"; then
    rabbitmq_env epmd -port "$EPMD_PORT" -kill >/dev/null 2>&1 || true
    for _ in $(seq 1 50); do port_open "$EPMD_PORT" || break; sleep 0.1; done
  fi
  rm -f "$RABBITMQ_DIR/epmd.port"
}

print_rabbitmq_env() {
  echo "export IDEM_TEST_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:$RABBITMQ_PORT/%2F IDEM_RABBITMQ_PORT=$RABBITMQ_PORT IDEM_RABBITMQ_DIST_PORT=$RABBITMQ_DIST_PORT IDEM_EPMD_PORT=$EPMD_PORT"
  echo "export IDEM_TEST_RABBITMQ_TLS_URL=amqps://guest:guest@localhost:$RABBITMQ_TLS_PORT/%2F IDEM_TEST_RABBITMQ_TLS_DIR=$DIR/tls IDEM_RABBITMQ_TLS_PORT=$RABBITMQ_TLS_PORT"
}

print_env() {
  echo "export IDEM_TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT"
  echo "export IDEM_TEST_POSTGRES_DSN=\"host=127.0.0.1 port=$PG_PORT user=postgres dbname=$PG_DB\""
  echo "export IDEM_SERVERS_SCRIPT=$(cd "$(dirname "$0")" && pwd)/servers.sh"
  echo "export IDEM_SERVERS_DIR=$DIR IDEM_REDIS_PORT=$REDIS_PORT IDEM_PG_PORT=$PG_PORT"
  if cluster_alive; then
    local seeds=""
    for i in 0 1 2 3 4 5; do seeds="$seeds${seeds:+,}127.0.0.1:$((CLUSTER_PORT + i))"; done
    echo "export IDEM_TEST_REDIS_CLUSTER_URL=redis-cluster://$seeds IDEM_CLUSTER_PORT=$CLUSTER_PORT"
  fi
  if mysql_alive; then
    echo "export IDEM_TEST_MYSQL_URI=mysql://idem:idem@127.0.0.1:$MYSQL_PORT/$MYSQL_DB IDEM_MYSQL_PORT=$MYSQL_PORT IDEM_TEST_MYSQL_TLS_DIR=$DIR/tls"
  fi
  if redis_tls_alive; then
    echo "export IDEM_TEST_REDIS_TLS_URL=rediss://localhost:$TLS_PORT IDEM_TEST_TLS_DIR=$DIR/tls IDEM_TLS_PORT=$TLS_PORT"
  fi
  if pg_tls_alive; then
    echo "export IDEM_TEST_POSTGRES_TLS_DSN=\"host=localhost port=$PG_TLS_PORT dbname=$PG_DB sslmode=verify-full sslrootcert=$DIR/tls/ca.pem\" IDEM_TEST_POSTGRES_TLS_PASSWORD=$(cat "$DIR/tls/pg-password") IDEM_PG_TLS_PORT=$PG_TLS_PORT"
  fi
  if sentinel_alive; then
    echo "export IDEM_TEST_REDIS_SENTINEL_URL=redis-sentinel://127.0.0.1:$((SENTINEL_PORT + 10)),127.0.0.1:$((SENTINEL_PORT + 11)),127.0.0.1:$((SENTINEL_PORT + 12))/idem-master IDEM_SENTINEL_PORT=$SENTINEL_PORT"
  fi
  if rabbitmq_alive; then print_rabbitmq_env; fi
}

cmd="${1:-}"
case "$cmd" in
  start) redis_start; pg_start; print_env ;;
  stop)
    # Every step runs even when one fails (a port held by a server of another tree made
    # mysql_stop fail, and the cluster and RabbitMQ of this directory were left running); the
    # directory is kept then, so a later stop can still find what runs from it.
    failed=0
    for step in redis_stop pg_stop pg_tls_stop mysql_stop rabbitmq_stop stop_all_redis_in_dir; do
      "$step" || failed=1
    done
    if [ "$failed" -eq 0 ]; then rm -rf "$DIR"; fi
    exit "$failed" ;;
  cluster) cluster_start; print_env ;;
  mysql) mysql_start; print_env ;;
  sentinel) sentinel_start; print_env ;;
  tls) redis_tls_start; pg_tls_start; print_env ;;
  tls-certs) ensure_dir; tls_certs; echo "$DIR/tls" ;;
  cluster-node-kill) cluster_node_kill "${2:?port}" ;;
  cluster-node-start) cluster_node_start "${2:?port}" ;;
  env) print_env ;;
  status)
    redis_alive && echo "redis: up on 127.0.0.1:$REDIS_PORT" || echo "redis: down"
    pg_alive && echo "postgres: up on 127.0.0.1:$PG_PORT" || echo "postgres: down"
    cluster_alive && echo "cluster: up on 127.0.0.1:$CLUSTER_PORT..$((CLUSTER_PORT + 5))" || echo "cluster: down"
    sentinel_alive && echo "sentinel: up on 127.0.0.1:$((SENTINEL_PORT + 10))" || echo "sentinel: down"
    mysql_alive && echo "mysql: up on 127.0.0.1:$MYSQL_PORT" || echo "mysql: down"
    redis_tls_alive && echo "redis (TLS): up on 127.0.0.1:$TLS_PORT" || echo "redis (TLS): down"
    pg_tls_alive && echo "postgres (TLS): up on 127.0.0.1:$PG_TLS_PORT" || echo "postgres (TLS): down"
    rabbitmq_alive && echo "rabbitmq: up on 127.0.0.1:$RABBITMQ_PORT" || echo "rabbitmq: down" ;;
  redis-start) redis_start ;;
  redis-stop) redis_stop ;;
  redis-kill) redis_kill ;;
  pg-start) pg_start ;;
  pg-stop) pg_stop ;;
  pg-restart) pg_restart "${2:-fast}" ;;
  mysql-start) mysql_start ;;
  mysql-stop) mysql_stop ;;
  mysql-kill) mysql_kill ;;
  mysql-restart) mysql_restart "${2:-}" ;;
  rabbitmq-start) rabbitmq_start; print_rabbitmq_env ;;
  rabbitmq-stop) rabbitmq_stop ;;
  rabbitmq-restart) rabbitmq_stop; rabbitmq_start ;;
  rabbitmq-eval) rabbitmq_env timeout 60 "$RABBITMQ_BIN/rabbitmqctl" -q eval "${2:?an Erlang expression}" ;;
  *) sed -n '3,35p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
