#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# tests/reliability/smoke.sh <idem_rel_driver> <args...>
# Runs the reliability smoke against servers of its own: the file IDEM_REL_SERVERS_ENV names
# (scripts/test.sh starts a Redis, a PostgreSQL and a MariaDB for it once per run, next to the
# shared ones), so the smoke's kills and restarts never disturb the tests running beside it.
# Without that file: skipped (exit 77), or a failure under IDEM_REQUIRE_SERVERS=1.
set -euo pipefail
driver="$1"; shift
if [ -z "${IDEM_REL_SERVERS_ENV:-}" ] || [ ! -s "$IDEM_REL_SERVERS_ENV" ]; then
  echo "reliability smoke: IDEM_REL_SERVERS_ENV names no servers' variables (scripts/test.sh" \
       "starts the reliability servers; by hand: scripts/reliability.sh)" >&2
  if [ "${IDEM_REQUIRE_SERVERS:-}" = "1" ]; then exit 1; fi
  exit 77
fi
# shellcheck disable=SC1090
source "$IDEM_REL_SERVERS_ENV"
exec "$driver" "$@"
