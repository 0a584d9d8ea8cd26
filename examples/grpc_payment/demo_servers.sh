#!/bin/sh
# SPDX-License-Identifier: MIT
# demo_servers.sh <grpc_payment> [flags...]: the demo against the test servers
# (IDEM_TEST_POSTGRES_DSN, IDEM_TEST_REDIS_URL, as scripts/servers.sh prints them). Without them
# it prints "skipped" (ctest: SKIP_REGULAR_EXPRESSION), or fails under IDEM_REQUIRE_SERVERS=1.
bin="$1"
shift
if [ -z "${IDEM_TEST_POSTGRES_DSN:-}" ] || [ -z "${IDEM_TEST_REDIS_URL:-}" ]; then
  if [ "${IDEM_REQUIRE_SERVERS:-}" = 1 ]; then
    echo "FAIL: IDEM_TEST_POSTGRES_DSN and IDEM_TEST_REDIS_URL are required"
    exit 1
  fi
  echo "skipped: IDEM_TEST_POSTGRES_DSN and IDEM_TEST_REDIS_URL not set"
  exit 0
fi
exec "$bin" --postgres "$IDEM_TEST_POSTGRES_DSN" --redis "$IDEM_TEST_REDIS_URL" "$@"
