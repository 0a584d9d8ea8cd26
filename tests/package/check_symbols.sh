#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# tests/package/check_symbols.sh <dir with libidem_*.so>
# A shared build exports idem's public API only (include/idem/export.hpp). Every dynamic
# symbol a libidem_*.so defines must be
#   - in namespace idem, outside `detail`, `Impl` classes and anonymous namespaces (with its
#     typeinfo and vtable), or
#   - a weak instantiation of a standard-library template (std::vector<...>::_M_realloc_insert:
#     libstdc++ declares namespace std with default visibility, so those are merged, not API),
#     or of header-only Boost.Asio's (libidem_async_redis: merged with the application's own
#     Asio, as they must be: one io_context, one set of services), or
#   - one of the internals below, each exported for a stated reason.
# Anything else (a helper of src/, a hiredis or libpqxx symbol, an Impl method) fails the check.
set -euo pipefail
dir="${1:?directory with libidem_*.so}"
internal=(
  # libidem_async_redis runs on libidem_redis's URI parser, topology, hash slots, redirects and
  # error mapping.
  'idem::redis::detail::(Pool|Endpoint|parse_uri|server_gone|throw_error|TlsConnector|make_tls|parse_topology|key_slot|parse_redirect|Topology)'
  # called by the inline StateMachine driver of include/idem/postgres/state_machine.hpp
  'idem::postgres::detail::state_machine_(update|current)'
  # called by the inline SqlDriver of include/idem/mysql/sql_driver.hpp
  'idem::mysql::detail::helper_value'
  # called by the template Method<Durable> of include/idem/grpc/method.hpp (libidem_grpc.so is
  # checked when a build directory has one: the shared step builds it only at install)
  'idem::grpc::detail::MethodCore'
)
internal_re="$(IFS='|'; echo "${internal[*]}")"
status=0
shopt -s nullglob
libs=("$dir"/libidem_*.so)
[ "${#libs[@]}" -gt 0 ] || { echo "symbols: no libidem_*.so in $dir" >&2; exit 1; }
for lib in "${libs[@]}"; do
  bad="$(nm -D --defined-only -C "$lib" | cut -d' ' -f2- | while read -r type name; do
    if [[ "$type" =~ ^[WVuw]$ && "$name" =~ ^((typeinfo|typeinfo\ name|vtable|VTT|guard\ variable)\ for\ |[^\(]*\ )?(std|__gnu_cxx|boost):: ]]; then
      continue
    fi
    # Asio's one extern "C" helper (the thread entry point of its posix_thread), inline too.
    if [[ "$type" =~ ^[WVuw]$ && "$name" =~ ^boost_asio_detail_ ]]; then continue; fi
    # A thunk adjusts `this` for a base class of a public class (e.g. the destructor of an
    # exception with two bases): part of that class's API.
    name="${name#non-virtual thunk to }"
    name="${name#virtual thunk to }"
    if [[ "$name" =~ ^((typeinfo|typeinfo\ name|vtable|VTT|guard\ variable)\ for\ )?idem:: ]]; then
      qualified="${name%%(*}"
      if [[ ! "$qualified" =~ ::detail::|::Impl($|::)|anonymous ]]; then continue; fi
      if [[ "$qualified" =~ ^((typeinfo|typeinfo\ name|vtable)\ for\ )?($internal_re) ]]; then continue; fi
    fi
    echo "  $type $name"
  done)"
  public="$(nm -D --defined-only -C "$lib" | grep -c ' T idem::' || true)"
  if [ -n "$bad" ]; then
    echo "symbols: $(basename "$lib") exports what is not idem's public API:" >&2
    echo "$bad" | head -40 >&2
    status=1
  elif [ "$public" -eq 0 ]; then
    echo "symbols: $(basename "$lib") exports no idem function at all" >&2
    status=1
  else
    echo "symbols: $(basename "$lib"): $public public functions, nothing else of idem's"
  fi
done
exit "$status"
