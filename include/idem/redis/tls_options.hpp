// SPDX-License-Identifier: MIT
// TLS settings of a `rediss://` connection (RedisStoreOptions::tls, RedisStreamsOptions::tls).
#pragma once

#include <string>

namespace idem::redis {

/// How a `rediss://` URI's connections are secured. The server's certificate chain and name
/// are always verified (there is no switch to turn that off): against `ca_file` when set, else
/// against the system's certificate authorities. Setting any field with a URI that is not
/// `rediss://` is an idem::UsageError (TLS would silently not be used).
///
/// @code
///   idem::redis::RedisStoreOptions o;
///   o.uri = "rediss://:secret@redis.internal:6380";
///   o.tls.ca_file = "/etc/idem/redis-ca.pem";   // a private CA; empty: the system's
///   idem::redis::RedisStore fast{o};
/// @endcode
struct TlsOptions {
  /// PEM file with the certificate authorities that may sign the server's certificate. Empty
  /// means the system's (OpenSSL's default paths; /etc/ssl/certs on Debian).
  std::string ca_file{};
  /// The name the server's certificate must carry (a DNS subjectAltName, or an IP address
  /// entry for an address), also sent as SNI for names. Empty means the URI's host.
  std::string server_name{};
  /// Client certificate (PEM, chain allowed) for servers that ask for one (redis-server
  /// `tls-auth-clients yes`). Empty means none.
  std::string cert_file{};
  /// Private key of `cert_file` (PEM, unencrypted). Required with `cert_file`.
  std::string key_file{};

  /// True when any field is set.
  bool any() const noexcept {
    return !ca_file.empty() || !server_name.empty() || !cert_file.empty() || !key_file.empty();
  }
};

}  // namespace idem::redis
