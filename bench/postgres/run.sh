#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# PostgreSQL benchmark: guard vs hand-written libpqxx (and, with IDEM_TEST_REDIS_URL, Redis +
# PostgreSQL vs hand-written hiredis + libpqxx), interleaved in one process, medians.
# Called by scripts/bench.sh (servers started, IDEM_BENCH_BUILD and IDEM_TEST_POSTGRES_DSN set).
# Per-call cost ratios: the PostgreSQL server and the driver are pinned to CPU 0 (see
# unpinned single-connection ping-pong swings several-fold from run to run).
set -euo pipefail
: "${IDEM_BENCH_BUILD:?set by scripts/bench.sh}"
: "${IDEM_TEST_POSTGRES_DSN:?set by scripts/bench.sh}"
BIN="$IDEM_BENCH_BUILD/bench/postgres/idem_postgres_bench"
[ -x "$BIN" ] || { echo "postgres bench not built (IDEM_WITH_POSTGRES=OFF?)"; exit 0; }

pin=()
if command -v taskset >/dev/null 2>&1 && [ "${IDEM_BENCH_PIN:-1}" = "1" ]; then
  pidfile="${IDEM_SERVERS_DIR:-/tmp/idem-servers}/pgdata/postmaster.pid"
  if [ -r "$pidfile" ]; then
    pm="$(head -1 "$pidfile")"
    # The postmaster and its current children (new backends inherit the postmaster's mask).
    for p in "$pm" $(pgrep -P "$pm" || true); do taskset -cp 0 "$p" >/dev/null 2>&1 || true; done
    echo "pinned: PostgreSQL (postmaster $pm and children) and the driver to CPU 0"
  fi
  rpid="${IDEM_SERVERS_DIR:-/tmp/idem-servers}/redis.pid"
  if [ -n "${IDEM_TEST_REDIS_URL:-}" ] && [ -r "$rpid" ]; then
    taskset -cp 0 "$(cat "$rpid")" >/dev/null 2>&1 && echo "pinned: Redis to CPU 0"
  fi
  pin=(taskset -c 0)
fi
"${pin[@]}" "$BIN"
echo "-- the same first execution with synchronous_commit=off (no WAL flush wait: overhead only)"
IDEM_BENCH_ASYNC_COMMIT=1 "${pin[@]}" "$BIN" | grep -E "^(first execution|  guard|  hand-written|  per call|ratio)"
