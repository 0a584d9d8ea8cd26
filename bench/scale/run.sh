#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Cost as the record table grows (see README.md): SQLite, then PostgreSQL (when
# IDEM_TEST_POSTGRES_DSN is set, as scripts/bench.sh sets it). Sizes 10^4, 10^5, 10^6 by default
# (a few minutes); IDEM_BENCH_SCALE_LARGE=1 (or --large) adds 10^7 (tens of minutes, ~3 GB of
# disk). The per-size figures are measured pinned to CPU 0 (PostgreSQL too), like the other
# per-call benchmarks; the purge runs unpinned (the purge and the concurrent writer are two
# threads, as in a service).
#
#   bench/scale/run.sh [--large]
set -euo pipefail
: "${IDEM_BENCH_BUILD:?set by scripts/bench.sh}"
BIN="$IDEM_BENCH_BUILD/bench/scale/idem_bench_scale"
[ -x "$BIN" ] || { echo "bench/scale: $BIN not built (IDEM_WITH_SQLITE=OFF?)"; exit 0; }
sizes=1e4,1e5,1e6
if [ "${IDEM_BENCH_SCALE_LARGE:-0}" = "1" ] || [ "${1:-}" = "--large" ]; then sizes+=,1e7; fi
purge="${IDEM_BENCH_SCALE_PURGE:-1e6}"
calls="${IDEM_BENCH_SCALE_CALLS:-5000}"

dir="$(mktemp -d /tmp/idem-bench-scale.XXXXXX)"
cleanup() { rm -rf "$dir"; }
trap cleanup EXIT

echo "bench/scale: sizes $sizes, $calls calls per size, purge of $purge expired records"
taskset -c 0 "$BIN" --backend sqlite --phase sizes --db "$dir/scale.db" --sizes "$sizes" \
  --calls "$calls"
"$BIN" --backend sqlite --phase purge --db "$dir/scale.db" --purge "$purge"
rm -f "$dir"/scale.db*

if [ -z "${IDEM_TEST_POSTGRES_DSN:-}" ]; then
  echo "bench/scale: IDEM_TEST_POSTGRES_DSN not set, PostgreSQL skipped"
  exit 0
fi
schema="idem_scale_$$"
pg_pids() {
  local pidfile="${IDEM_SERVERS_DIR:-/tmp/idem-servers}/pgdata/postmaster.pid"
  [ -r "$pidfile" ] || return 0
  local pm
  pm="$(head -1 "$pidfile")"
  echo "$pm" $(pgrep -P "$pm" || true)
}
pin_pg() { for p in $(pg_pids); do taskset -a -p -c "$1" "$p" >/dev/null 2>&1 || true; done; }
drop_schema() { psql "$IDEM_TEST_POSTGRES_DSN" -X -q -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true; }
trap 'pin_pg "0-$(( $(nproc) - 1 ))"; drop_schema; cleanup' EXIT
# synchronous_commit=off: the per-size figures show what the table's size costs, not the WAL
# flush of this VM's shared disk (which is the same at every size).
dsn="$IDEM_TEST_POSTGRES_DSN options='-c synchronous_commit=off'"
pin_pg 0
taskset -c 0 "$BIN" --backend postgres --phase sizes --dsn "$dsn" --schema "$schema" \
  --sizes "$sizes" --calls "$calls"
pin_pg "0-$(( $(nproc) - 1 ))"
"$BIN" --backend postgres --phase purge --dsn "$dsn" --schema "$schema" --purge "$purge"
