#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The guard's SQLite transactional path vs the same write without idempotency (see
# sqlite_bench.cpp). Pinned to one CPU, like the other per-call benchmarks.
set -euo pipefail
BUILD="${IDEM_BENCH_BUILD:-$(dirname "$0")/../../build}"
exec taskset -c 0 "$BUILD/bench/sqlite/idem_bench_sqlite" "$@"
