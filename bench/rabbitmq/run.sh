#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# RabbitMQ consumer loops into PostgreSQL: idem's loop against a hand-written rabbitmq-c loop
# doing the same recipe, and the plain loop without de-duplication (see README.md). Run by
# scripts/bench.sh, which sets IDEM_BENCH_BUILD (Release build).
#
# A private RabbitMQ node and PostgreSQL are started here (ports from IDEM_FREE_PORT_BASE when
# set, else the servers.sh defaults + 1100), and the servers and the driver all run pinned to
# CPU 0 (taskset -c 0; the Erlang VM with one scheduler): on these VMs an idle CPU halts and
# waking it costs ~100 us, so unpinned ping-pong loops swing from round to round. Pinned, a loop
# costs what the broker, the database and the driver compute per message.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="${IDEM_BENCH_BUILD:-$ROOT/build}"
BIN="$BUILD/bench/rabbitmq/idem_bench_rabbitmq"
[ -x "$BIN" ] || { echo "bench/rabbitmq: $BIN not built" >&2; exit 1; }

export IDEM_SERVERS_DIR="$(mktemp -d /tmp/idem-bench-rabbitmq.XXXXXX)"
if [ -n "${IDEM_FREE_PORT_BASE:-}" ]; then
  base="$IDEM_FREE_PORT_BASE"
  export IDEM_PG_PORT=$((base + 10)) IDEM_REDIS_PORT=$((base + 11))
  export IDEM_RABBITMQ_PORT=$((base + 20)) IDEM_RABBITMQ_DIST_PORT=$((base + 21))
  export IDEM_EPMD_PORT=$((base + 40))
else
  export IDEM_PG_PORT=$(( ${IDEM_PG_PORT:-15432} + 1100 ))
  export IDEM_REDIS_PORT=$(( ${IDEM_REDIS_PORT:-16379} + 1100 ))
  export IDEM_RABBITMQ_PORT=$(( ${IDEM_RABBITMQ_PORT:-18672} + 1100 ))
  export IDEM_RABBITMQ_DIST_PORT=$(( ${IDEM_RABBITMQ_DIST_PORT:-18673} + 1100 ))
  export IDEM_EPMD_PORT=$(( ${IDEM_EPMD_PORT:-18369} + 1100 ))
fi
stop_private() {
  "$ROOT/scripts/servers.sh" stop >/dev/null 2>&1 || true
  rm -rf "$IDEM_SERVERS_DIR"
}
trap stop_private EXIT
taskset -c 0 "$ROOT/scripts/servers.sh" pg-start >/dev/null
IDEM_RABBITMQ_ERL_ARGS="+S 1:1 +sbt u" taskset -c 0 "$ROOT/scripts/servers.sh" rabbitmq-start >/dev/null
amqp="amqp://guest:guest@127.0.0.1:$IDEM_RABBITMQ_PORT/%2F"
pg="host=127.0.0.1 port=$IDEM_PG_PORT user=postgres dbname=idem_test"
echo "bench/rabbitmq: private RabbitMQ :$IDEM_RABBITMQ_PORT and PostgreSQL :$IDEM_PG_PORT, servers and driver on CPU 0"

# fsync and synchronous_commit on (every COMMIT waits for the WAL flush, as in production),
# then synchronous_commit=off (no flush wait: what the loops compute).
taskset -c 0 "$BIN" --amqp "$amqp" --postgres "$pg" --messages 2000 --rounds 9 "$@"
taskset -c 0 "$BIN" --amqp "$amqp" --postgres "$pg options='-c synchronous_commit=off'" \
  --messages 2000 --rounds 9 "$@"
