#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# What a user of the package meets, after scripts/test.sh built and tested <build> (the servers
# still up, their variables exported). Each step prints its time; any failure fails the script.
#
#   tests/package/check.sh <build> [step...]     steps (default: all, in this order):
#     install      cmake --install (with the libraries deleted first: it builds them), then
#                  every component's consumer alone with the dependencies
#                  it does not need unfindable (run.sh isolated), and pkg-config + make
#     docs         the Doxygen reference, no warning (when doxygen is installed)
#     deb          cpack -G DEB, apt-get install ./idem-*.deb, the consumers against /usr, removed
#                  again (root or sudo)
#     shared       BUILD_SHARED_LIBS=ON and -std=c++20 in <build>-shared: every library and
#                  every public header compile as C++20 (the headers one source per component;
#                  the main build compiles each alone, as C++17), only
#                  the public API exported (check_symbols.sh), tests over the shared
#                  libraries, the installed consumers
#
# IDEM_PACKAGE_SERVERS_FREE=<file>: the shared step's tests, the only part that talks to the
# servers, wait until <file> exists (scripts/test.sh runs this check beside ctest, whose serial
# tests kill, pause and restart those servers, and creates the file when ctest is done).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$(pwd)"
BUILD="${1:?build directory}"; shift
steps=("$@")
[ "${#steps[@]}" -gt 0 ] || steps=(install docs deb shared)
JOBS="${IDEM_JOBS:-$(nproc)}"
RUN="$ROOT/tests/package/run.sh"
status=0
work="$(mktemp -d /tmp/idem-package.XXXXXX)"
cleanup_debs=()
cleanup() {
  if [ "${#cleanup_debs[@]}" -gt 0 ]; then
    as_root dpkg --purge "${cleanup_debs[@]}" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

step_install() {
  # As after demo.sh, which builds one target: a library is missing, and the install builds
  # what is missing instead of failing (one library stands for all: the install's check is
  # the same for each, and rebuilding every one cost a minute of this run).
  # The rebuilt library gets the time of the one removed, so nothing that links it is out of
  # date afterwards (the .deb step's build would relink every test program, while scripts/test.sh
  # runs them beside this check).
  touch -r "$BUILD"/libidem_sqlite.a "$work/libidem_sqlite.stamp"
  rm -f "$BUILD"/libidem_sqlite.a
  cmake --install "$BUILD" --prefix "$work/prefix" >"$work/install.log" 2>&1 || { cat "$work/install.log" >&2; return 1; }
  grep -q "not built yet" "$work/install.log" || { cat "$work/install.log" >&2; echo "install: did not build the missing libraries" >&2; return 1; }
  ls "$BUILD"/libidem_sqlite.a >/dev/null || return 1
  touch -r "$work/libidem_sqlite.stamp" "$BUILD"/libidem_sqlite.a
  "$RUN" isolated "$work/prefix" "$work/isolated" || return 1
  "$RUN" pkg-config "$work/prefix" "$work/pkg-config" || return 1
}

step_docs() {
  if ! command -v doxygen >/dev/null; then
    echo "docs: doxygen is not installed (scripts/bootstrap.sh installs it): not checked"
    return 0
  fi
  cmake --build "$BUILD" --target docs >"$work/docs.log" 2>&1 || { cat "$work/docs.log" >&2; return 1; }
  grep -h "^-- docs:" "$work/docs.log" | sed 's/^-- //'
  [ -s "$BUILD/docs/html/index.html" ] || return 1
}

# Tests that use the public API only (the others reach into src/ internals, which a shared
# build hides), run against the shared libraries.
shared_tests=(idem_core_tests idem_sqlite_tests idem_redis_tls_tests idemctl_tests
              idemctl_server_tests idem_mq_integration_tests)
step_shared() {
  local dir="$BUILD-shared"
  # -O1 without debug information: the libraries are checked for what they export and run
  # under the tests below, never debugged (the main build keeps -O2 -g1). C++20: one build
  # checks both the shared libraries and the second standard (the libraries, every public
  # header and the tests below compile as C++20; the main build covers C++17, and each header
  # alone there: here one source per component holds all of its headers, a third of the CPU).
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -DNDEBUG" \
    -DIDEM_WERROR=ON -DBUILD_SHARED_LIBS=ON -DCMAKE_CXX_STANDARD=20 -DCMAKE_CXX_EXTENSIONS=OFF \
    -DIDEM_HEADER_CHECK=ON -DIDEM_HEADER_CHECK_STANDARD=20 -DIDEM_HEADER_CHECK_MODE=component \
    -DIDEM_BUILD_TESTS=ON -DIDEM_BUILD_TOOLS=ON -DIDEM_BUILD_EXAMPLES=OFF -DIDEM_BUILD_BENCH=OFF \
    >"$work/shared.log" 2>&1 ||
    { cat "$work/shared.log" >&2; return 1; }
  grep -h "header check" "$work/shared.log" | sed 's/^-- /shared: /'
  # Every library (the install below would build the missing ones anyway), the header check
  # and the tests.
  cmake --build "$dir" -j "$JOBS" --target idem_libraries idem_header_check idem_libcrypto_check \
    idem_libcrypto_check_openssl_first idemctl "${shared_tests[@]}" >>"$work/shared.log" 2>&1 ||
    { tail -50 "$work/shared.log" >&2; return 1; }
  "$ROOT/tests/package/check_symbols.sh" "$dir" || return 1
  # The installed consumers need no server: they build and run (in the background) while the
  # tests below wait for the servers.
  (cmake --install "$dir" --prefix "$work/shared-prefix" >/dev/null &&
     "$RUN" together "$work/shared-prefix" "$work/shared-consumers" &&
     IDEM_PACKAGE_COMPONENTS="redis mq" "$RUN" isolated "$work/shared-prefix" \
       "$work/shared-isolated") >"$work/shared-consumers.log" 2>&1 &
  local consumers_pid=$!
  # Each test binary built above, run whole against the shared libraries, once the servers are
  # no longer someone else's to restart (at most an hour), two at a time: after ctest this is
  # what is left of scripts/test.sh, and one binary at a time left a core idle.
  local t bin waited=0 failed=0 lane
  if [ -n "${IDEM_PACKAGE_SERVERS_FREE:-}" ]; then
    while [ ! -e "$IDEM_PACKAGE_SERVERS_FREE" ]; do
      [ "$waited" -lt 3600 ] || { echo "shared: $IDEM_PACKAGE_SERVERS_FREE never appeared" >&2; wait "$consumers_pid"; return 1; }
      sleep 1; waited=$((waited + 1))
    done
    echo "shared: waited ${waited} s for the servers"
  fi
  for t in "${shared_tests[@]}"; do
    [ -n "$(find "$dir" -type f -name "$t" -perm -u+x | head -1)" ] ||
      { echo "shared: $t not built" >&2; wait "$consumers_pid"; return 1; }
  done
  local lane_pids=()
  for lane in 0 1; do
    (i=0
     for t in "${shared_tests[@]}"; do
       if [ $((i % 2)) -eq "$lane" ]; then
         bin="$(find "$dir" -type f -name "$t" -perm -u+x | head -1)"
         "$bin" --gtest_brief=1 >"$work/shared-$t.log" 2>&1 || echo failed >"$work/shared-$t.failed"
       fi
       i=$((i + 1))
     done) &
    lane_pids+=($!)
  done
  wait "${lane_pids[@]}"
  for t in "${shared_tests[@]}"; do
    if [ -e "$work/shared-$t.failed" ]; then
      cat "$work/shared-$t.log" >&2; echo "shared: $t FAILED" >&2; failed=1
    else
      echo "shared: $t: $(grep -m1 -o '[0-9]* tests\? from [0-9]* test suites\? ran' "$work/shared-$t.log" || echo ran), passed"
    fi
  done
  if ! wait "$consumers_pid"; then
    cat "$work/shared-consumers.log" >&2; echo "shared: the installed consumers FAILED" >&2; return 1
  fi
  cat "$work/shared-consumers.log"
  [ "$failed" -eq 0 ]
}

step_deb() {
  if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
    echo "deb: needs root or sudo to install the packages: not checked"
    return 0
  fi
  (cd "$BUILD" && cpack -G DEB -B "$work/deb" >"$work/cpack.log" 2>&1) || { cat "$work/cpack.log" >&2; return 1; }
  local debs=("$work"/deb/idem-*.deb) names=() f
  for f in "${debs[@]}"; do
    names+=("$(dpkg-deb -f "$f" Package)")
    echo "deb: $(basename "$f"): Depends: $(dpkg-deb -f "$f" Depends)"
  done
  for f in "${names[@]}"; do
    if dpkg-query -W -f='${Status}' "$f" 2>/dev/null | grep -q "install ok installed"; then
      echo "deb: $f is installed already (not by this run): not touched" >&2; return 1
    fi
  done
  cleanup_debs=("${names[@]}")
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
    "${debs[@]}" >"$work/apt.log" 2>&1 || { cat "$work/apt.log" >&2; return 1; }
  "$RUN" together "" "$work/deb-consumers" || return 1
  local rc=0
  /usr/bin/idemctl >/dev/null 2>&1 || rc=$?
  [ "$rc" -eq 2 ] || { echo "deb: /usr/bin/idemctl without arguments exited $rc, not 2 (usage)" >&2; return 1; }
  as_root dpkg --purge "${names[@]}" >/dev/null || return 1
  cleanup_debs=()
  [ ! -e /usr/lib/cmake/idem/idemConfig.cmake ] || { echo "deb: files left after removal" >&2; return 1; }
}

# A step runs as the condition of an `if`, where `set -e` does not apply: each command whose
# failure fails the step says so (`|| return 1`).
for s in "${steps[@]}"; do
  t0=$SECONDS
  if "step_$s"; then
    echo "package: $s: ok ($((SECONDS - t0)) s)"
  else
    echo "package: $s: FAILED ($((SECONDS - t0)) s)" >&2
    status=1
  fi
done
exit "$status"
