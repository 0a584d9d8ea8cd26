#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Redis Streams consumer loop with idempotent consumption vs the same loop without it.
# Needs IDEM_TEST_REDIS_URL (scripts/bench.sh starts the servers).
set -euo pipefail
BUILD="${IDEM_BENCH_BUILD:-$(dirname "$0")/../../build}"
: "${IDEM_TEST_REDIS_URL:?start the servers (scripts/servers.sh) first}"
exec "$BUILD/bench/mq/idem_bench_mq" --redis "$IDEM_TEST_REDIS_URL" "$@"
