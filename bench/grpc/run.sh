#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# idem::grpc vs the same grpc++ unary method without idempotency. Client and server share one
# process, one channel; pinned to one CPU so the per-call ratio is not dominated by CPU wake-ups.
set -euo pipefail
bin="${IDEM_BENCH_BUILD:?}/bench/grpc/idem_grpc_bench"
taskset -c 0 "$bin" "${IDEM_GRPC_BENCH_ROUNDS:-11}" "${IDEM_GRPC_BENCH_CALLS:-1000}"
