#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Redis Cluster (3 masters + 3 replicas) vs one Redis, and the cluster path's routing overhead.
# Run by scripts/bench.sh, which sets IDEM_BENCH_BUILD (Release build), IDEM_TEST_REDIS_URL and
# IDEM_TEST_REDIS_CLUSTER_URL (its throwaway servers).
#
# Throughput (2 and 8 threads, unpinned): guarded calls on the cluster vs on one redis-server,
# interleaved. Routing (1 thread): the cluster path against the same store talking to the node
# directly, and against a raw hiredis loop on that node, with the bench and every cluster master
# pinned to CPU 0 (taskset: an idle CPU halts and waking it costs ~100 us, so per-call ratios are pinned); the
# masters' affinity is restored afterwards.
set -euo pipefail
BUILD="${IDEM_BENCH_BUILD:?IDEM_BENCH_BUILD is not set (scripts/bench.sh sets it)}"
URL="${IDEM_TEST_REDIS_URL:?IDEM_TEST_REDIS_URL is not set (scripts/bench.sh sets it)}"
CLUSTER="${IDEM_TEST_REDIS_CLUSTER_URL:?IDEM_TEST_REDIS_CLUSTER_URL is not set (scripts/bench.sh starts the cluster)}"
BIN="$BUILD/bench/cluster/idem_cluster_bench"
[ -x "$BIN" ] || { echo "bench/cluster: $BIN not built (IDEM_WITH_REDIS=OFF?)" >&2; exit 1; }

echo "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'); cluster $CLUSTER; single $URL"
"$BIN" --cluster "$CLUSTER" --single "$URL" --mode throughput --threads 2 --ops 1000 --rounds 11
"$BIN" --cluster "$CLUSTER" --single "$URL" --mode throughput --threads 8 --ops 500 --rounds 11

# Pin the masters (their pids: the nodes answering ROLE master) to CPU 0 for the per-call runs.
masters=()
for hp in $(echo "${CLUSTER#redis-cluster://}" | tr ',' ' '); do
  host="${hp%:*}" port="${hp##*:}"
  if [ "$(redis-cli -h "$host" -p "$port" ROLE 2>/dev/null | head -1)" = "master" ]; then
    masters+=("$(redis-cli -h "$host" -p "$port" INFO server | tr -d '\r' | sed -n 's/^process_id://p')")
  fi
done
all_cpus="0-$(( $(nproc) - 1 ))"
restore() { for pid in "${masters[@]}"; do taskset -a -p -c "$all_cpus" "$pid" >/dev/null 2>&1 || true; done; }
trap restore EXIT
for pid in "${masters[@]}"; do taskset -a -p -c 0 "$pid" >/dev/null; done
taskset -c 0 "$BIN" --cluster "$CLUSTER" --mode routing --threads 1 --ops 2000 --rounds 21
