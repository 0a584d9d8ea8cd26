#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds in Release, starts throwaway servers, and runs every benchmark part: each bench/<part>/
# has a run.sh that prints its figures and one `ratio <name> = <value>` line per comparison.
#
#   scripts/bench.sh            all parts
#   scripts/bench.sh redis      only bench/redis
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
./scripts/bootstrap.sh
export IDEM_BENCH_BUILD="${IDEM_BENCH_BUILD:-$ROOT/build-bench}"
cmake -S . -B "$IDEM_BENCH_BUILD" -DCMAKE_BUILD_TYPE=Release -DIDEM_BUILD_TESTS=OFF >/dev/null
cmake --build "$IDEM_BENCH_BUILD" -j "$(nproc)" >/dev/null

export IDEM_SERVERS_DIR="${IDEM_SERVERS_DIR:-$(mktemp -d /tmp/idem-bench.XXXXXX)}"
trap '"$ROOT/scripts/servers.sh" stop || true' EXIT
./scripts/servers.sh start >/dev/null
eval "$(./scripts/servers.sh cluster)"  # bench/cluster: the 3-master cluster next to one Redis
eval "$(./scripts/servers.sh mysql)"    # bench/mysql: MariaDB

echo "idem benchmarks, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(uname -r)"
status=0
for run in bench/*/run.sh; do
  part="$(basename "$(dirname "$run")")"
  if [ "$#" -gt 0 ] && [[ ! " $* " == *" $part "* ]]; then continue; fi
  echo
  echo "== $part =="
  bash "$run" || { echo "bench $part FAILED" >&2; status=1; }
done
exit "$status"
