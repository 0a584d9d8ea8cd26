// SPDX-License-Identifier: MIT
// Parsing of RedisStoreOptions::uri.
#pragma once

#include <string>
#include <string_view>

#include "idem/export.hpp"

namespace idem::redis::detail {

/// Where and how to connect, parsed from a URI.
struct Endpoint {
  bool unix_socket = false;
  bool tls = false;      ///< rediss://: TLS (src/redis/tls.hpp)
  std::string host;      ///< TCP host name or address (brackets of an IPv6 literal removed)
  int port = 6379;       ///< TCP port
  std::string path;      ///< Unix socket path
  std::string user;      ///< ACL user (empty: AUTH <password> only)
  std::string password;  ///< empty: no AUTH
  int db = 0;            ///< SELECT db when non-zero
  std::string display;   ///< the URI with the password masked, for messages
};

/// Parses `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (same form, TLS),
/// `tcp://...` (same form) and `unix://[[user]:password@]/path[?db=N]`.
/// @throws idem::UsageError naming what is wrong (the password is never echoed).
/// Exported from a shared libidem_redis for libidem_mq (not API).
IDEM_EXPORT Endpoint parse_uri(std::string_view uri);

}  // namespace idem::redis::detail
