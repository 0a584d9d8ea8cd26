#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Runs `node --test <files...>` for ctest. Without node: skipped (exit 77, ctest SKIP_RETURN_CODE),
# or a failure under IDEM_REQUIRE_SERVERS=1 (scripts/test.sh).
set -euo pipefail
if ! command -v node >/dev/null 2>&1; then
  if [ "${IDEM_REQUIRE_SERVERS:-}" = "1" ]; then
    echo "node_test.sh: node is not installed (scripts/bootstrap.sh installs it)" >&2
    exit 1
  fi
  echo "node_test.sh: node is not installed: skipped" >&2
  exit 77
fi
exec node --test --test-reporter=spec "$@"
