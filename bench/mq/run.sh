#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Redis Streams consumer loops with idempotent consumption vs the same loops without it (see
# README.md). Run by scripts/bench.sh, which sets IDEM_BENCH_BUILD (Release build).
#
# The loops run against a private redis-server and PostgreSQL started here, with the servers
# and the driver all pinned to CPU 0 (taskset -c 0): on these VMs an idle CPU halts and waking
# it costs ~100 us, so unpinned ping-pong loops swing 2-3x from round to round (one side can
# land on a warm CPU, the other on a halted one). Pinned, a loop costs what the driver and the
# servers compute per message, which is what the ratios compare. The last pass measures
# throughput instead: servers and driver unpinned, 2 and 8 consumer threads of one group
# draining one stream.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="${IDEM_BENCH_BUILD:-$ROOT/build}"
BIN="$BUILD/bench/mq/idem_bench_mq"
[ -x "$BIN" ] || { echo "bench/mq: $BIN not built" >&2; exit 1; }

export IDEM_SERVERS_DIR="$(mktemp -d /tmp/idem-bench-mq.XXXXXX)"
export IDEM_REDIS_PORT=$(( ${IDEM_REDIS_PORT:-16379} + 1100 ))
export IDEM_PG_PORT=$(( ${IDEM_PG_PORT:-15432} + 1100 ))
stop_private() {
  "$ROOT/scripts/servers.sh" stop >/dev/null 2>&1 || true
  rm -rf "$IDEM_SERVERS_DIR"
}
trap stop_private EXIT
taskset -c 0 "$ROOT/scripts/servers.sh" start >/dev/null
eval "$("$ROOT/scripts/servers.sh" env)"
echo "bench/mq: private redis-server :$IDEM_REDIS_PORT and PostgreSQL :$IDEM_PG_PORT, servers and driver on CPU 0"

# SQLite loops, then the PostgreSQL loops (fsync and synchronous_commit on: every COMMIT waits
# for the WAL flush, as in production), then the PostgreSQL loops again with
# synchronous_commit=off (no flush wait at COMMIT: idem's overhead alone), then with injected
# network latency.
# (The hand-written record recipe and idem's consumer on the durable store alone, next to them.)
pg_loops=plain_pg,dedup_pg,plain_pg_batch,dedup_pg_batch,dedup_pg_batch_memory
pg_loops+=,handwritten_pg,dedup_pg_durable,handwritten_pg_batch,dedup_pg_batch_durable
# (9 rounds: with 5, the SQLite batch ratios swung by 0.08 between two runs of one build.)
taskset -c 0 "$BIN" --redis "$IDEM_TEST_REDIS_URL" --rounds 9 \
  --only plain,dedup_redis,dedup_memory,plain_batch,dedup_batch_redis,dedup_batch_memory,handwritten,dedup_durable,handwritten_batch,dedup_batch_durable "$@"
taskset -c 0 "$BIN" --redis "$IDEM_TEST_REDIS_URL" --postgres "$IDEM_TEST_POSTGRES_DSN" \
  --only "$pg_loops" --rounds 9 --pg-messages 1280 "$@"
taskset -c 0 "$BIN" --redis "$IDEM_TEST_REDIS_URL" \
  --postgres "$IDEM_TEST_POSTGRES_DSN options='-c synchronous_commit=off'" \
  --only "$pg_loops" --rounds 9 --pg-messages 1280 "$@"
# The PostgreSQL loops once more with the servers "on another host": every connection through
# a delay line (100 us each way, on CPU 1; see bench/common/latency_proxy.hpp). Round trips,
# not server CPU, bound the loops then, as in a deployment.
taskset -c 0 "$BIN" --redis "$IDEM_TEST_REDIS_URL" --postgres "$IDEM_TEST_POSTGRES_DSN" \
  --only "$pg_loops" --rounds 7 --pg-messages 320 --latency-us 100 "$@"
# What one consume record costs PostgreSQL to write next to the effect row, by layout (executor
# only, in one transaction; record_row.sql), still pinned.
taskset -c 0 psql "$IDEM_TEST_POSTGRES_DSN" -X -q -At -v ON_ERROR_STOP=1 -f "$ROOT/bench/mq/record_row.sql"
# Throughput with several consumers of one group (each its own connections; the dedup loops
# share one IdempotentConsumer, RedisStore and PostgresStore, as the threads of one service
# would): the servers and the driver unpinned, on both CPUs.
all_cpus="0-$(( $(nproc) - 1 ))"
taskset -a -p -c "$all_cpus" "$(cat "$IDEM_SERVERS_DIR/redis.pid")" >/dev/null
postmaster="$(head -n 1 "$IDEM_SERVERS_DIR/pgdata/postmaster.pid")"
for pid in "$postmaster" $(pgrep -P "$postmaster"); do taskset -a -p -c "$all_cpus" "$pid" >/dev/null; done
for threads in 2 8; do
  "$BIN" --redis "$IDEM_TEST_REDIS_URL" --postgres "$IDEM_TEST_POSTGRES_DSN" \
    --only plain_pg_batch,dedup_pg_batch,dedup_pg_batch_memory,handwritten_pg_batch,dedup_pg_batch_durable \
    --rounds 9 --pg-messages 2560 \
    --threads "$threads" "$@"
done
