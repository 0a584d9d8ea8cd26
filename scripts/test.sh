#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs what is missing, builds in build/, starts throwaway redis-server, PostgreSQL, a Redis
# Cluster, MariaDB, a Redis Sentinel setup, the TLS servers and the reliability smoke's own
# Redis, PostgreSQL and MariaDB on loopback (during the build),
# runs every test (ctest), checks the package as users meet it (tests/package/check.sh:
# components alone, pkg-config, the API reference, a shared C++20 build, the .deb), and stops
# the servers. Exits non-zero on any failure.
#
#   scripts/test.sh                 everything
#   scripts/test.sh -L unit         only tests with a ctest label (passed to ctest)
#   scripts/test.sh --sanitize      also ASan+UBSan and TSan builds: unit tests, the
#                                   many-thread integration tests and the asynchronous Redis
#                                   and PostgreSQL stores' tests (tests/sanitizers/tsan.supp)
#   scripts/test.sh --sanitize-only only the sanitizer builds and their tests (the servers
#                                   still start; the regular build, ctest and package check
#                                   are skipped)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

sanitize=0
regular=1
ctest_args=()
for a in "$@"; do
  case "$a" in
    --sanitize) sanitize=1 ;;
    --sanitize-only) sanitize=1; regular=0 ;;
    *) ctest_args+=("$a") ;;
  esac
done

./scripts/bootstrap.sh
JOBS="${IDEM_JOBS:-$(nproc)}"
BUILD="${IDEM_BUILD_DIR:-build}"

export IDEM_SERVERS_DIR="${IDEM_SERVERS_DIR:-$(mktemp -d /tmp/idem-test.XXXXXX)}"
# The reliability smoke's own servers (tests/reliability/smoke.sh): it kills and restarts them,
# so they are not the ones the other tests share.
# Their ports: IDEM_REL_REDIS_PORT (16479), IDEM_REL_PG_PORT (15532), IDEM_REL_MYSQL_PORT (13406),
# so that runs side by side can keep apart. Only the regular run (the smoke is a ctest test)
# starts them.
rel_servers() {
  IDEM_SERVERS_DIR="$IDEM_SERVERS_DIR/reliability" IDEM_REDIS_PORT="${IDEM_REL_REDIS_PORT:-16479}" \
    IDEM_PG_PORT="${IDEM_REL_PG_PORT:-15532}" IDEM_MYSQL_PORT="${IDEM_REL_MYSQL_PORT:-13406}" \
    "$ROOT/scripts/servers.sh" "$@"
}
cleanup() {
  # A server still starting (the build failed early) would come up after the stop: wait first.
  if [ -n "${rabbitmq_pid:-}" ]; then wait "$rabbitmq_pid" 2>/dev/null || true; fi
  if [ -n "${rel_pid:-}" ]; then wait "$rel_pid" 2>/dev/null || true; fi
  # The package check (beside ctest) uses the servers and removes the .deb it installed.
  if [ -n "${package_pid:-}" ]; then
    touch "$IDEM_PACKAGE_SERVERS_FREE" 2>/dev/null || true
    wait "$package_pid" 2>/dev/null || true
  fi
  rel_servers stop || true
  "$ROOT/scripts/servers.sh" stop || true
}
trap cleanup EXIT
# The servers (one Redis, PostgreSQL, a 3+3 Redis Cluster, MariaDB, a Sentinel setup) start while the
# build runs; their variables are read once both are done.
mkdir -p "$IDEM_SERVERS_DIR"
chmod 0755 "$IDEM_SERVERS_DIR"  # PostgreSQL (user postgres) reaches its data dirs below it
servers_env="$IDEM_SERVERS_DIR/test-env.sh"
(./scripts/servers.sh start >/dev/null && ./scripts/servers.sh cluster >/dev/null &&
   ./scripts/servers.sh mysql >/dev/null &&
   ./scripts/servers.sh tls >/dev/null && ./scripts/servers.sh sentinel >"$servers_env") \
  >"$IDEM_SERVERS_DIR/servers-start.log" 2>&1 &
servers_pid=$!
# The RabbitMQ node starts alongside them (an Erlang VM: seconds of CPU); the time it took is
# printed once the build is done.
rabbitmq_env="$IDEM_SERVERS_DIR/test-env-rabbitmq.sh"
(t0=$(date +%s%N) && ./scripts/servers.sh rabbitmq-start >"$rabbitmq_env" &&
   t=$((($(date +%s%N) - t0) / 1000000)) &&
   echo "test.sh: RabbitMQ node up in $((t / 1000)).$((t % 1000 / 100)) s") \
  >"$IDEM_SERVERS_DIR/rabbitmq-start.log" 2>&1 &
rabbitmq_pid=$!

export IDEM_REL_SERVERS_ENV="$IDEM_SERVERS_DIR/test-env-reliability.sh"
if [ "$regular" -eq 1 ]; then
  (rel_servers start >"$IDEM_REL_SERVERS_ENV.part" && rel_servers mysql >>"$IDEM_REL_SERVERS_ENV.part" &&
     mv "$IDEM_REL_SERVERS_ENV.part" "$IDEM_REL_SERVERS_ENV") \
    >"$IDEM_SERVERS_DIR/reliability-start.log" 2>&1 &
  rel_pid=$!
fi

if [ "$regular" -eq 1 ]; then
  # The libraries at -O2 with line tables only (-g1): full -g costs ~45 % more CPU per library
  # source at -O2 (variable tracking), and nothing here reads more than file and line.
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DIDEM_WERROR=ON -DIDEM_HEADER_CHECK=ON >/dev/null
  cmake --build "$BUILD" -j "$JOBS"
fi

if ! wait "$servers_pid"; then
  cat "$IDEM_SERVERS_DIR/servers-start.log" >&2
  echo "test.sh: the servers did not start" >&2
  exit 1
fi
eval "$(cat "$servers_env")"
if ! wait "$rabbitmq_pid"; then
  cat "$IDEM_SERVERS_DIR/rabbitmq-start.log" >&2
  echo "test.sh: the RabbitMQ node did not start" >&2
  exit 1
fi
cat "$IDEM_SERVERS_DIR/rabbitmq-start.log"
eval "$(cat "$rabbitmq_env")"
if [ -n "${rel_pid:-}" ] && ! wait "$rel_pid"; then
  cat "$IDEM_SERVERS_DIR/reliability-start.log" >&2
  echo "test.sh: the reliability servers did not start" >&2
  exit 1
fi
export IDEM_REQUIRE_SERVERS=1

status=0
# The package as users meet it (each step prints its time): components, pkg-config, docs,
# shared libraries built as C++20, the .deb. It runs beside ctest: its builds use the CPU that
# tests waiting on servers, leases and restarts leave idle. Its output is printed after ctest's.
# Its tests that use the servers wait for ctest's end (IDEM_PACKAGE_SERVERS_FREE): ctest's serial
# tests kill, pause and restart them.
package_log="$IDEM_SERVERS_DIR/package-check.log"
export IDEM_PACKAGE_SERVERS_FREE="$IDEM_SERVERS_DIR/ctest-done"
rm -f "$IDEM_PACKAGE_SERVERS_FREE"
if [ "$regular" -eq 1 ] && [ "${#ctest_args[@]}" -eq 0 ]; then
  ./tests/package/check.sh "$BUILD" >"$package_log" 2>&1 &
  package_pid=$!
fi
ctest_failed=0
if [ "$regular" -eq 1 ]; then
  (cd "$BUILD" && ctest --output-on-failure -j "$JOBS" --timeout 600 "${ctest_args[@]}") || ctest_failed=1
  [ "$ctest_failed" -eq 0 ] || status=1
fi
touch "$IDEM_PACKAGE_SERVERS_FREE"
if [ -n "${package_pid:-}" ]; then
  package_status=0
  wait "$package_pid" || package_status=$?
  package_pid=""
  cat "$package_log"
  [ "$package_status" -eq 0 ] || { echo "test.sh: the package check failed" >&2; status=1; }
fi

if [ "$sanitize" -eq 1 ]; then
  for san in "address;undefined" "thread"; do
    dir="build-san-${san//;/-}"
    cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Debug -DIDEM_SANITIZE="$san" \
      -DIDEM_BUILD_EXAMPLES=ON -DIDEM_BUILD_BENCH=OFF -DIDEM_BUILD_TOOLS=OFF >/dev/null
    cmake --build "$dir" -j "$JOBS"
    # tests/sanitizers/tsan.supp: races TSan reports inside Debian's prebuilt (uninstrumented)
    # libcpp-httplib, documented there. Nothing of idem's own code is suppressed.
    # Unit tests, then the many-thread tests against the real servers (still up here), then
    # idem_async_redis_tests (the hiredis adapter's callbacks, stores destroyed from another
    # thread, the guard's suite on one loop; not its SERIAL fault tests, AsyncRedisFault.*), then
    # AsyncPostgresStore's and the libpq pipeline's (idem_async_pg_store_tests, its conformance and
    # guard suites, idem_async_pg_connection_tests; not AsyncPgStoreFault.*).
    for sel in "-L unit" "-L integration -R Storm|Concurrent|ThirtyTwoThreads|Race|OrderHttp|Overlapping|Batch|ChunkStore" \
               "-L async -R ^(AsyncRedis/|AsyncRedisStoreTest\\.|Redis\\..+RedisSqlite)" \
               "-L async -R ^(AsyncPostgres\\.|AsyncPostgresStoreTest\\.|PgConnectionTest\\.)"; do
      # shellcheck disable=SC2086
      (cd "$dir" &&
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" \
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
        TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$ROOT/tests/sanitizers/tsan.supp" \
        ctest --output-on-failure -j "$JOBS" $sel) || status=1
    done
  done
fi

# The failed tests' own output once more, last (CI logs are often read from the end, and the
# package check's output follows ctest's): the end of each failed test's output, five at most.
if [ "$ctest_failed" -eq 1 ] && [ -f "$BUILD/Testing/Temporary/LastTestsFailed.log" ]; then
  cut -d: -f2- "$BUILD/Testing/Temporary/LastTestsFailed.log" | head -n 5 | while IFS= read -r name; do
    echo "test.sh: the end of the output of the failed test $name:"
    awk -v t="$name" '$0 ~ /^[0-9]+\/[0-9]+ Test: / { sub(/^[0-9]+\/[0-9]+ Test: /, ""); on = ($0 == t); next }
                      on && /^Output:/ { out = 1; getline; next }
                      on && out && /^<end of output>/ { out = 0; on = 0; next }
                      on && out { print }' "$BUILD/Testing/Temporary/LastTest.log" | tail -n 40 | sed 's/^/  | /'
  done || true
fi
if [ "$status" -ne 0 ]; then
  echo "test.sh: FAILED" >&2
else
  echo "test.sh: all passed"
fi
exit "$status"
