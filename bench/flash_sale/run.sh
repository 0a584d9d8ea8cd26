#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Run by scripts/bench.sh (servers started, IDEM_BENCH_BUILD set).
set -euo pipefail
"$IDEM_BENCH_BUILD/bench/flash_sale/idem_bench_business_keys" "${IDEM_BENCH_ROUNDS:-7}" "${IDEM_BENCH_OPS:-400}"
