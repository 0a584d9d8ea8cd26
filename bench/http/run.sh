#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# idem::http vs the same cpp-httplib handler without idempotency. Client and server share one
# process; pinned to one CPU so the per-request ratio is not dominated by CPU wake-ups.
set -euo pipefail
bin="${IDEM_BENCH_BUILD:?}/bench/http/idem_http_bench"
taskset -c 0 "$bin" "${IDEM_HTTP_BENCH_ROUNDS:-11}" "${IDEM_HTTP_BENCH_REQUESTS:-1000}"
