#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# idem::grpc vs the same grpc++ unary method without idempotency, one channel, interleaved.
# Two runs:
#   - two processes (the ratios without a suffix): the servers pinned to CPU 0, the client to
#     CPU 1, over loopback TCP: a service and its caller on different machines, as deployed;
#   - one process pinned to CPU 0 (ratios ending in `_one_process`): client, servers and every
#     gRPC thread time-share one CPU, where the synchronous server's thread hand-offs weigh most.
set -euo pipefail
bin="${IDEM_BENCH_BUILD:?}/bench/grpc/idem_grpc_bench"
rounds="${IDEM_GRPC_BENCH_ROUNDS:-11}"
calls="${IDEM_GRPC_BENCH_CALLS:-1000}"
if [ "$(nproc)" -ge 2 ]; then
  IDEM_GRPC_BENCH_SPLIT=0,1 "$bin" "$rounds" "$calls"
else
  echo "grpc bench: one CPU only: the two-process run is skipped"
fi
taskset -c 0 "$bin" "$rounds" "$calls"
