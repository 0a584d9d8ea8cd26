#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Stream benchmarks, each pinned to one CPU: the consumer window (offsets/s) against a std::set;
# the durable row per chunk alone (us per chunk, no ratio);
# the SSE endpoint of examples/ai_chat with ProducerDedup + the chunk table against streaming
# straight from the generator (events/s); the browser module in node (admissions/s).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BUILD="${IDEM_BENCH_BUILD:-$HERE/../../build}"
taskset -c 0 "$BUILD/bench/stream/idem_bench_stream"
if [ -x "$BUILD/bench/stream/idem_bench_chunk_rows" ]; then
  echo
  taskset -c 0 "$BUILD/bench/stream/idem_bench_chunk_rows"
fi
if [ -x "$BUILD/bench/stream/idem_bench_sse" ]; then
  echo
  taskset -c 0 "$BUILD/bench/stream/idem_bench_sse" "${IDEM_SSE_BENCH_ROUNDS:-9}"
fi
if command -v node >/dev/null 2>&1; then
  echo
  taskset -c 0 node "$HERE/window_bench.mjs"
fi
