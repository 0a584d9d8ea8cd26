#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds and runs the package consumers of tests/package against an installed idem.
#
#   tests/package/run.sh isolated   <prefix> <workdir>   each installed component alone, every
#                                                        dependency it does not need made
#                                                        unfindable; and a component whose
#                                                        dependency is missing must fail
#   tests/package/run.sh together   <prefix> <workdir>   all installed components in one project
#                                                        (<prefix> "" : the system, e.g. the .deb)
#   tests/package/run.sh pkg-config <prefix> <workdir>   each component with pkg-config and make
#
# Every installed component needs a consumer tests/package/<component>.cpp.
# IDEM_PACKAGE_COMPONENTS="a b" limits a run to those components (while working on one).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
mode="${1:?mode}" prefix="${2?prefix}" work="${3:?workdir}"
JOBS="${IDEM_JOBS:-$(nproc)}"

if [ -n "$prefix" ]; then
  cmake_dir="$(dirname "$(find "$prefix" -name idemConfig.cmake -print -quit)")"
else
  cmake_dir="$(dirname "$(find /usr/lib /usr/local/lib -path '*/cmake/idem/idemConfig.cmake' -print -quit)")"
fi
[ -f "$cmake_dir/idemConfig.cmake" ] || { echo "package: no idemConfig.cmake under '${prefix:-/usr}'" >&2; exit 1; }
components=()
for f in "$cmake_dir"/idem-*-targets.cmake; do
  c="$(basename "$f" -targets.cmake)"; c="${c#idem-}"
  case "$c" in *-*) continue ;; esac  # idem-<c>-targets-<config>.cmake
  components+=("$c")
done
if [ -n "${IDEM_PACKAGE_COMPONENTS:-}" ]; then read -r -a components <<<"$IDEM_PACKAGE_COMPONENTS"; fi
shared=OFF
grep -q 'set(idem_SHARED_LIBS ON)' "$cmake_dir/idemConfig.cmake" && shared=ON
for c in "${components[@]}"; do
  [ -f "$HERE/$c.cpp" ] || { echo "package: component '$c' has no consumer tests/package/$c.cpp" >&2; exit 1; }
done
rm -rf "$work"; mkdir -p "$work"
prefix_args=()
[ -n "$prefix" ] && prefix_args=(-DCMAKE_PREFIX_PATH="$prefix")

# consumer <name> <components (;-separated)> [cmake args...]: configure, build, run.
consumer() {
  local name="$1" comps="$2"; shift 2
  local dir="$work/$name"
  if ! cmake -S "$HERE" -B "$dir" "${prefix_args[@]}" -DIDEM_CONSUMER_COMPONENTS="$comps" "$@" \
       >"$dir.log" 2>&1; then
    cat "$dir.log" >&2; echo "package: $name: configure FAILED" >&2; return 1
  fi
  cmake --build "$dir" -j "$JOBS" >>"$dir.log" 2>&1 || { cat "$dir.log" >&2; echo "package: $name: build FAILED" >&2; return 1; }
  local c
  for c in ${comps//;/ }; do
    "$dir/consumer_$c" >>"$dir.log" 2>&1 || { cat "$dir.log" >&2; echo "package: $name: consumer_$c FAILED" >&2; return 1; }
  done
}

case "$mode" in
  isolated)
    pc_default="$(pkg-config --variable pc_path pkg-config)"
    for c in "${components[@]}"; do
      { read -r off; read -r hidden; } < <(cmake -DIDEM_CMAKE_DIR="$cmake_dir" -DCOMPONENT="$c" \
                                            -DSHARED="$shared" -P "$HERE/unneeded.cmake" 2>&1)
      args=()
      for p in $off; do args+=("-DCMAKE_DISABLE_FIND_PACKAGE_$p=ON"); done
      # pkg-config sees every module of the default search path but the hidden ones (one ln
      # for all: a process per module was ~600 forks and 3.6 s per component).
      pcdir="$work/$c-pkgconfig"; mkdir -p "$pcdir"
      links=()
      for d in ${pc_default//:/ }; do
        for f in "$d"/*.pc; do
          [ -e "$f" ] || continue
          m="${f##*/}"; m="${m%.pc}"
          [[ " $hidden " == *" $m "* ]] || links+=("$f")
        done
      done
      [ "${#links[@]}" -eq 0 ] || ln -sf "${links[@]}" "$pcdir/"
      PKG_CONFIG_LIBDIR="$pcdir" PKG_CONFIG_PATH="" consumer "$c" "$c" "${args[@]}"
      echo "package: COMPONENTS $c: built and ran; unfindable: ${off:-} (pkg-config: ${hidden:-})"
    done
    # A component whose dependency cannot be found fails, naming it (static builds: a shared
    # libidem_sqlite.so does not need SQLite's package to be linked).
    if [[ " ${components[*]} " == *" sqlite "* && "$shared" == OFF ]]; then
      dir="$work/sqlite-missing"
      if cmake -S "$HERE" -B "$dir" "${prefix_args[@]}" -DIDEM_CONSUMER_COMPONENTS=sqlite \
           -DCMAKE_DISABLE_FIND_PACKAGE_SQLite3=ON >"$dir.log" 2>&1; then
        echo "package: COMPONENTS sqlite configured without SQLite3" >&2; exit 1
      fi
      grep -q "sqlite: sqlite3 not found (apt-get install libsqlite3-dev)" "$dir.log" ||
        { cat "$dir.log" >&2; echo "package: the missing-SQLite message does not name it" >&2; exit 1; }
      echo "package: COMPONENTS sqlite without SQLite3: fails, naming libsqlite3-dev"
    fi
    ;;
  together)
    list="$(IFS=';'; echo "${components[*]}")"
    consumer all "$list"
    echo "package: COMPONENTS ${components[*]} from ${prefix:-the system}: built and ran"
    ;;
  pkg-config)
    export PKG_CONFIG_PATH="$(dirname "$(find "$prefix" -name idem-core.pc -print -quit)")"
    make -s -j "$JOBS" -f "$HERE/Makefile" OUT="$work" COMPONENTS="${components[*]}" >"$work/make.log" 2>&1 ||
      { cat "$work/make.log" >&2; echo "package: pkg-config consumers FAILED" >&2; exit 1; }
    echo "package: pkg-config + make: ${components[*]}: built and ran"
    ;;
  *) sed -n '3,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
