#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Redis fast store vs raw hiredis loops (see README.md). Run by scripts/bench.sh, which sets
# IDEM_BENCH_BUILD (Release build) and IDEM_TEST_REDIS_URL (its throwaway redis-server).
#
# Ratios run against a private redis-server started here, with the server and the client both
# pinned to CPU 0 (taskset -c 0): on these VMs an idle CPU halts and waking
# it costs ~100 us, so an unpinned single-connection ping-pong swings 4-10x from run to run
# (idle-CPU wake-ups). Pinned, each call costs what the client and the server
# actually compute, which is what a per-call ratio should compare. The 8-thread runs are made
# pinned too, then unpinned against scripts/bench.sh's server for reference (`_unpinned`).
set -euo pipefail
BUILD="${IDEM_BENCH_BUILD:?IDEM_BENCH_BUILD is not set (scripts/bench.sh sets it)}"
URL="${IDEM_TEST_REDIS_URL:?IDEM_TEST_REDIS_URL is not set (scripts/bench.sh sets it)}"
BIN="$BUILD/bench/redis/idem_redis_bench"
[ -x "$BIN" ] || { echo "bench/redis: $BIN not built (IDEM_WITH_REDIS=OFF?)" >&2; exit 1; }

port=$(( ${IDEM_REDIS_PORT:-16379} + 1000 ))
dir="$(mktemp -d /tmp/idem-bench-redis.XXXXXX)"
if [ -n "$(redis-cli -h 127.0.0.1 -p "$port" PING 2>/dev/null || true)" ]; then
  echo "bench/redis: port $port (IDEM_REDIS_PORT + 1000) is in use; set IDEM_REDIS_PORT" >&2
  exit 1
fi
stop_private() {
  redis-cli -h 127.0.0.1 -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap stop_private EXIT
taskset -c 0 redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save '' \
  --appendonly no --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
for _ in $(seq 1 100); do
  [ "$(redis-cli -h 127.0.0.1 -p "$port" PING 2>/dev/null || true)" = "PONG" ] && break
  sleep 0.1
done
pinned="redis://127.0.0.1:$port"
echo "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'); 1-thread runs: private server $pinned, server and client on CPU 0; 8-thread runs: $URL, unpinned"

# 1 thread, pinned: per-call cost.
taskset -c 0 "$BIN" --url "$pinned" --threads 1 --ops 2000 --rounds 31 --only token
taskset -c 0 "$BIN" --url "$pinned" --threads 1 --ops 2000 --rounds 31 --only replay
taskset -c 0 "$BIN" --url "$pinned" --threads 1 --ops 2000 --rounds 31 --only first
# For reference: the Lua claim (used on Redis < 7.0) instead of SET NX PX GET.
taskset -c 0 "$BIN" --url "$pinned" --threads 1 --ops 2000 --rounds 31 --only replay --claim-script 1
taskset -c 0 "$BIN" --url "$pinned" --threads 1 --only memory
# 8 threads, pinned like the 1-thread runs: 8 pooled connections vs 8 raw connections, all
# threads and the server on CPU 0 (per-op cost with 8 connections in flight).
taskset -c 0 "$BIN" --url "$pinned" --threads 8 --ops 500 --rounds 21 --only replay
taskset -c 0 "$BIN" --url "$pinned" --threads 8 --ops 500 --rounds 21 --only first
# 64 threads, pinned: auto-pipelining (the threads' calls share one connection, written in
# batches) vs 64 raw connections, one command per round trip each; then the lone caller's
# price of it (the same replay with auto_pipeline on and off, interleaved).
taskset -c 0 "$BIN" --url "$pinned" --threads 64 --ops 200 --rounds 21 --only replay --autopipeline-names 1
taskset -c 0 "$BIN" --url "$pinned" --threads 64 --ops 200 --rounds 21 --only first --autopipeline-names 1
taskset -c 0 "$BIN" --url "$pinned" --threads 1 --ops 2000 --rounds 31 --only pipeline
# For reference: the same unpinned, against scripts/bench.sh's server (per-round ratios swing
# 0.6-1.5 on 2 vCPUs, so their medians move by +-0.05 from run to run).
"$BIN" --url "$URL" --threads 8 --ops 2000 --rounds 21 --only replay --name-suffix _unpinned
"$BIN" --url "$URL" --threads 8 --ops 2000 --rounds 21 --only first --name-suffix _unpinned
