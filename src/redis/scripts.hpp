// SPDX-License-Identifier: MIT
// The record encoding of the Redis store, and the Lua scripts that need server-side atomicity.
//
// A record is one Redis string:
//
//   "I1" <status P|C> <#owner> ":" <owner> <created_ms> ":" <#fingerprint> ":" <fingerprint>
//   <response bytes ...>
//
// e.g. "I1C32:<32 hex>1700000000000:64:<64 hex>pay_1". Lengths are decimal byte counts, so any
// bytes may appear in the owner, fingerprint and response. An in-progress record (P) has no
// response bytes; its PX TTL is the lease. A completed one (C) has the response; its TTL is the
// retention. Anything else under an idem key (another type, a string without this header, a
// truncated one) is a foreign value: idem::CorruptRecord, and a script never raises on it.
//
// The owner comes first so that "is this still my claim?" is one prefix comparison against
// "I1P<#owner>:<owner>" (the length prefix makes it exact), and completing is
// "I1C" .. rest-of-the-claim .. response: no parsing on the server.
//
// claim is not a script on Redis >= 7.0: `SET key <in-progress record> NX PX <lease> GET` claims
// an absent key, or changes nothing and returns the existing record, in one command; the client
// decodes it (busy / done / mismatch). kClaimScript does the same for older servers, which
// reject NX together with GET.
#pragma once

namespace idem::redis::detail {

// valid(v): true when v is a well-formed record (only called on the rare paths that must tell a
// lost lease from a foreign value).
#define IDEM_REDIS_LUA_VALID                                                       \
  "local function valid(v)\n"                                                     \
  "  local st, ol, p = string.match(v, '^I1([PC])(%d+):()')\n"                    \
  "  if not st then return false end\n"                                           \
  "  local q = p + tonumber(ol)\n"                                                \
  "  if q - 1 > #v then return false end\n"                                       \
  "  local c, fl, r = string.match(v, '^(%d+):(%d+):()', q)\n"                    \
  "  if not c then return false end\n"                                            \
  "  local e = r + tonumber(fl) - 1\n"                                            \
  "  if e > #v then return false end\n"                                           \
  "  return st == 'C' or e == #v\n"                                               \
  "end\n"

/// claim (servers without SET NX GET): ARGV in-progress record, lease_ms.
/// -> nil (claimed) | the existing record | the WRONGTYPE error of a foreign type.
inline constexpr const char* kClaimScript =
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return v end\n"
    "if v then return v end\n"
    "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\n"
    "return false\n";

/// complete: ARGV "I1P<#owner>:<owner>", response, retention_ms.
/// -> 1 | 0 (lease lost: absent, completed, or another owner) | {9, reason} (foreign value).
inline constexpr const char* kCompleteScript =
    IDEM_REDIS_LUA_VALID
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return {9, tostring(v.err)} end\n"
    "if not v then return 0 end\n"
    "if string.sub(v, 1, #ARGV[1]) == ARGV[1] then\n"
    "  redis.call('SET', KEYS[1], 'I1C' .. string.sub(v, 4) .. ARGV[2], 'PX', ARGV[3])\n"
    "  return 1\n"
    "end\n"
    "if valid(v) then return 0 end\n"
    "return {9, 'not an idem record'}\n";

/// release: ARGV "I1P<#owner>:<owner>". -> 1 | 0 (not held) | {9, reason}.
inline constexpr const char* kReleaseScript =
    IDEM_REDIS_LUA_VALID
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return {9, tostring(v.err)} end\n"
    "if not v then return 0 end\n"
    "if string.sub(v, 1, #ARGV[1]) == ARGV[1] then\n"
    "  redis.call('DEL', KEYS[1])\n"
    "  return 1\n"
    "end\n"
    "if valid(v) then return 0 end\n"
    "return {9, 'not an idem record'}\n";

/// lookup: no ARGV. -> 0 absent | {record, pttl} | {9, reason} (the record is decoded in C++).
inline constexpr const char* kLookupScript =
    "local v = redis.pcall('GET', KEYS[1])\n"
    "if type(v) == 'table' then return {9, tostring(v.err)} end\n"
    "if not v then return 0 end\n"
    "return {v, redis.call('PTTL', KEYS[1])}\n";

#undef IDEM_REDIS_LUA_VALID

}  // namespace idem::redis::detail
