#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Reliability suite (docs/reliability.md): faults under load against a payment service built on
# idem (RedisStore + PostgresStore, or MysqlStore), checked against the database's ground truth.
#
#   scripts/reliability.sh              every scenario, both modes (transactional, two-phase)
#   scripts/reliability.sh --smoke      the subset ctest runs inside scripts/test.sh (~2-3 min)
#   scripts/reliability.sh --full       every scenario with larger counts (400 keys x 4 sends)
#   scripts/reliability.sh --seed 7 --scenarios redis_kill,flushall --modes two-phase ...
#                                       (any further flags go to idem_rel_driver)
#   scripts/reliability.sh --backend mysql [--smoke|--full]
#                                       the same on MysqlStore (MariaDB): kill -9 of mysqld
#                                       (InnoDB crash recovery) replaces pg_restart
#
# Starts its own throwaway redis-server and PostgreSQL (scripts/servers.sh) and stops them at
# the end (and MariaDB with --backend mysql). Settings (environment): IDEM_REDIS_PORT (default
# 16389), IDEM_PG_PORT (15442), IDEM_MYSQL_PORT (13316),
# IDEM_SERVERS_DIR (a fresh /tmp/idem-rel.XXXXXX), IDEM_BUILD_DIR (build), IDEM_JOBS (2).
# Prints one row per scenario and a summary line; exits non-zero if any scenario found a
# duplicate effect, a lost acknowledged result, a divergent replay, a stuck key or an untyped
# error, or if a fault did not fire. Same --seed, same plan of keys and sends.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

./scripts/bootstrap.sh
BUILD="${IDEM_BUILD_DIR:-build}"
JOBS="${IDEM_JOBS:-2}"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DIDEM_WERROR=ON >/dev/null
fi
cmake --build "$BUILD" -j "$JOBS" --target idem_rel_driver idem_rel_service >/dev/null

export IDEM_REDIS_PORT="${IDEM_REDIS_PORT:-16389}"
export IDEM_PG_PORT="${IDEM_PG_PORT:-15442}"
export IDEM_MYSQL_PORT="${IDEM_MYSQL_PORT:-13316}"
backend=postgres
prev=""
for a in "$@"; do
  if [ "$prev" = "--backend" ]; then backend="$a"; fi
  prev="$a"
done
export IDEM_SERVERS_DIR="${IDEM_SERVERS_DIR:-$(mktemp -d /tmp/idem-rel.XXXXXX)}"
cleanup() { "$ROOT/scripts/servers.sh" stop || true; }
trap cleanup EXIT
eval "$(./scripts/servers.sh start)"
if [ "$backend" = "mysql" ]; then eval "$(./scripts/servers.sh mysql)"; fi

"$BUILD/tests/reliability/idem_rel_driver" --service "$BUILD/tests/reliability/idem_rel_service" "$@"
