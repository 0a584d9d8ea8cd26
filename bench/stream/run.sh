#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Stream window throughput (offsets/s on one core) against a std::set baseline.
set -euo pipefail
BUILD="${IDEM_BENCH_BUILD:-$(dirname "$0")/../../build}"
exec taskset -c 0 "$BUILD/bench/stream/idem_bench_stream" "$@"
