// SPDX-License-Identifier: MIT
// The Lua scripts of the Redis store, and the record encoding they share with record.hpp.
//
// A record is one Redis string:
//
//   "I1" <status P|C> <created_ms> ":" <#fingerprint> ":" <#owner> ":" <fingerprint> <owner>
//   <response bytes ...>
//
// e.g. "I1C1700000000000:64:32:<64 hex><32 hex>pay_1". Lengths are decimal byte counts, so any
// bytes may appear in the fingerprint, owner and response. While in progress (P) the key's PX
// TTL is the lease; once completed (C) it is the retention. Anything else under an idem key
// (another type, a string without this header, a truncated one) is answered as {9, reason}
// and becomes idem::CorruptRecord: a script never raises on foreign data.
#pragma once

namespace idem::redis::detail {

// Shared prelude: rec(v) -> status, created, fingerprint start, owner start, response start.
#define IDEM_REDIS_LUA_PRELUDE                                                         \
  "local function rec(v)\n"                                                            \
  "  local st, c, fl, ol, p = string.match(v, '^I1([PC])(%d+):(%d+):(%d+):()')\n"      \
  "  if not st then return nil end\n"                                                  \
  "  fl = tonumber(fl)\n"                                                              \
  "  ol = tonumber(ol)\n"                                                              \
  "  if p + fl + ol - 1 > #v then return nil end\n"                                    \
  "  return st, c, p, p + fl, p + fl + ol\n"                                           \
  "end\n"                                                                              \
  "local v = redis.pcall('GET', KEYS[1])\n"                                            \
  "if type(v) == 'table' then return {9, tostring(v.err)} end\n"

/// claim: ARGV fingerprint, owner, lease_ms, now_ms.
/// -> 0 claimed | {1, holder, created} busy | {2, holder, created, response} done |
///    {3, holder, created} mismatch | {9, reason} corrupt.
inline constexpr const char* kClaimScript =
    IDEM_REDIS_LUA_PRELUDE
    "if not v then\n"
    "  redis.call('SET', KEYS[1], 'I1P' .. ARGV[4] .. ':' .. #ARGV[1] .. ':' .. #ARGV[2] ..\n"
    "             ':' .. ARGV[1] .. ARGV[2], 'PX', ARGV[3])\n"
    "  return 0\n"
    "end\n"
    "local st, c, f, o, r = rec(v)\n"
    "if not st then return {9, 'not an idem record'} end\n"
    "local owner = string.sub(v, o, r - 1)\n"
    "if string.sub(v, f, o - 1) ~= ARGV[1] then return {3, owner, c} end\n"
    "if st == 'C' then return {2, owner, c, string.sub(v, r)} end\n"
    "return {1, owner, c}\n";

/// complete: ARGV owner, response, retention_ms. -> 1 | 0 (lease lost) | {9, reason}.
inline constexpr const char* kCompleteScript =
    IDEM_REDIS_LUA_PRELUDE
    "if not v then return 0 end\n"
    "local st, c, f, o, r = rec(v)\n"
    "if not st then return {9, 'not an idem record'} end\n"
    "if st ~= 'P' or string.sub(v, o, r - 1) ~= ARGV[1] then return 0 end\n"
    "redis.call('SET', KEYS[1], 'I1C' .. string.sub(v, 4, r - 1) .. ARGV[2], 'PX', ARGV[3])\n"
    "return 1\n";

/// release: ARGV owner. -> 1 | 0 (not held) | {9, reason}.
inline constexpr const char* kReleaseScript =
    IDEM_REDIS_LUA_PRELUDE
    "if not v then return 0 end\n"
    "local st, c, f, o, r = rec(v)\n"
    "if not st then return {9, 'not an idem record'} end\n"
    "if st ~= 'P' or string.sub(v, o, r - 1) ~= ARGV[1] then return 0 end\n"
    "redis.call('DEL', KEYS[1])\n"
    "return 1\n";

/// lookup: no ARGV. -> 0 absent | {value, pttl} | {9, reason} (decoded in C++).
inline constexpr const char* kLookupScript =
    IDEM_REDIS_LUA_PRELUDE
    "if not v then return 0 end\n"
    "return {v, redis.call('PTTL', KEYS[1])}\n";

#undef IDEM_REDIS_LUA_PRELUDE

}  // namespace idem::redis::detail
