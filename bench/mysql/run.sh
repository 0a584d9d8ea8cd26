#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# MySQL benchmark: guard vs hand-written libmariadb (and, with IDEM_TEST_REDIS_URL, Redis +
# MySQL vs hand-written hiredis + libmariadb), interleaved in one process, medians.
# Called by scripts/bench.sh (servers started, IDEM_BENCH_BUILD and IDEM_TEST_MYSQL_URI set).
# Per-call cost ratios: mariadbd (every thread), Redis and the driver are pinned to CPU 0
# (IDEM_BENCH_PIN=0 to disable): an unpinned single-connection ping-pong swings several-fold
# from run to run on these VMs.
set -euo pipefail
: "${IDEM_BENCH_BUILD:?set by scripts/bench.sh}"
: "${IDEM_TEST_MYSQL_URI:?set by scripts/bench.sh}"
BIN="$IDEM_BENCH_BUILD/bench/mysql/idem_mysql_bench"
[ -x "$BIN" ] || { echo "mysql bench not built (IDEM_WITH_MYSQL=OFF?)"; exit 0; }

pin=()
# The server's CPU time per call (read from /proc) is printed when its pid is known.
pidfile="${IDEM_SERVERS_DIR:-/tmp/idem-servers}/mysql/mariadb.pid"
[ -r "$pidfile" ] && export IDEM_BENCH_SERVER_PID="$(cat "$pidfile")"
if command -v taskset >/dev/null 2>&1 && [ "${IDEM_BENCH_PIN:-1}" = "1" ]; then
  if [ -r "$pidfile" ]; then
    # -a: every thread of mariadbd (one per connection; new ones inherit the mask).
    taskset -a -cp 0 "$(cat "$pidfile")" >/dev/null 2>&1 &&
      echo "pinned: mariadbd (all threads) and the driver to CPU 0"
  fi
  rpid="${IDEM_SERVERS_DIR:-/tmp/idem-servers}/redis.pid"
  if [ -n "${IDEM_TEST_REDIS_URL:-}" ] && [ -r "$rpid" ]; then
    taskset -cp 0 "$(cat "$rpid")" >/dev/null 2>&1 && echo "pinned: Redis to CPU 0"
  fi
  pin=(taskset -c 0)
fi
"${pin[@]}" "$BIN"
