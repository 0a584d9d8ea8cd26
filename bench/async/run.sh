#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# idem::async on ONE loop thread vs the synchronous guard on 8 threads, same Redis (see
# README.md). Run by scripts/bench.sh, which sets IDEM_BENCH_BUILD (Release build) and
# IDEM_TEST_REDIS_URL (its throwaway redis-server).
#
# The ratios are throughput over the same server: they run unpinned (a one-thread loop against
# eight threads spread over both CPUs, the server where the kernel puts it), against
# scripts/bench.sh's server, rounds interleaved (A B B A ...), medians. For reference they are
# repeated with the synchronous store's auto_pipeline on (`_autopipeline`) and with a private
# redis-server and the whole driver pinned to CPU 0 (`_pinned`: per-call CPU cost, the eight
# threads then share one CPU with the server as the loop does). Last, the loop's timer lateness
# under durable work (no ratio).
set -euo pipefail
BUILD="${IDEM_BENCH_BUILD:?IDEM_BENCH_BUILD is not set (scripts/bench.sh sets it)}"
URL="${IDEM_TEST_REDIS_URL:?IDEM_TEST_REDIS_URL is not set (scripts/bench.sh sets it)}"
BIN="$BUILD/bench/async/idem_async_bench"
[ -x "$BIN" ] || { echo "bench/async: $BIN not built (IDEM_WITH_ASYNC=OFF?)" >&2; exit 1; }

port=$(( ${IDEM_REDIS_PORT:-16379} + 1100 ))
dir="$(mktemp -d /tmp/idem-bench-async.XXXXXX)"
if [ -n "$(redis-cli -h 127.0.0.1 -p "$port" PING 2>/dev/null || true)" ]; then
  echo "bench/async: port $port (IDEM_REDIS_PORT + 1100) is in use; set IDEM_REDIS_PORT" >&2
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
echo "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'); ratios: $URL, unpinned; _pinned: private server $pinned, server and driver on CPU 0; load: $(cut -d' ' -f1-3 /proc/loadavg)"

# The ratios: one loop thread (256 calls in flight) vs 8 threads, default options both sides.
"$BIN" --url "$URL" --threads 8 --ops 16000 --rounds 11 --only replay
"$BIN" --url "$URL" --threads 8 --ops 16000 --rounds 11 --only first
# For reference: the synchronous store with auto_pipeline on (off by default).
"$BIN" --url "$URL" --threads 8 --ops 16000 --rounds 11 --only replay --auto-pipeline 1
"$BIN" --url "$URL" --threads 8 --ops 16000 --rounds 11 --only first --auto-pipeline 1
# For reference: everything on CPU 0 (per-call CPU cost).
taskset -c 0 "$BIN" --url "$pinned" --threads 8 --ops 16000 --rounds 11 --only replay --name-suffix _pinned
taskset -c 0 "$BIN" --url "$pinned" --threads 8 --ops 16000 --rounds 11 --only first --name-suffix _pinned
# The loop's lateness while durable work runs on the pool (the figure of the loop-stall test).
"$BIN" --url "$URL" --only durable --rounds 5
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
