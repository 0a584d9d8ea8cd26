// SPDX-License-Identifier: MIT
// TLS for rediss:// connections, under a hiredis (0.14) that has none.
//
// hiredis 0.14 reads and writes its socket with plain read()/write() and offers no hook, so the
// TLS session lives next to it: for each pooled connection, the connector opens the TCP
// connection, runs the handshake (certificate chain and host name verified, SNI sent) and one
// PING through it, all in the calling thread within connect_timeout, so every failure is a
// typed exception of the connect. It then hands hiredis one end of a socketpair; a relay
// thread (one per connector, i.e. per store) moves bytes between the other end and the TLS
// session. Nothing crosses the network in clear; the relay adds one local hop per direction.
// A TLS session that fails later closes hiredis' end, which hiredis reports as the server
// closing the connection (StorageUnavailable; the pool drops it and reconnects).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "idem/export.hpp"
#include "idem/redis/tls_options.hpp"
#include "uri.hpp"

namespace idem::redis::detail {

/// Opens TLS connections for one store (see the file comment). Thread-safe.
/// Exported from a shared libidem_redis for libidem_mq (not API).
class IDEM_EXPORT TlsConnector {
 public:
  /// Reads the CA file and the client certificate now.
  /// @param options the TLS options; @param who names the option struct in messages.
  /// @throws idem::UsageError for an unreadable or invalid file, or a certificate without key.
  TlsConnector(const TlsOptions& options, const std::string& who);
  /// Stops the relay thread and closes every tunnel (hiredis contexts on them then read EOF).
  ~TlsConnector();
  TlsConnector(const TlsConnector&) = delete;
  TlsConnector& operator=(const TlsConnector&) = delete;

  /// Connects to `ep` (host, port) over TLS within `timeout` and returns the file descriptor
  /// hiredis should use (redisConnectFd); the caller owns it.
  /// @param what names the call in messages ("connect to rediss://...").
  /// @throws StorageUnavailable (refused, reset, closed during the handshake), StorageTimeout,
  ///         StorageError (certificate not trusted, name mismatch, handshake refused).
  int open(const Endpoint& ep, std::chrono::milliseconds timeout, const std::string& what);

  /// Connections the relay carries now (for tests).
  std::size_t tunnels() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

/// The connector for `ep` when its URI is rediss:// (null otherwise).
/// @throws idem::UsageError when `options` are set but the URI is not rediss://, or as the
///         TlsConnector constructor.
IDEM_EXPORT std::shared_ptr<TlsConnector> make_tls(const Endpoint& ep, const TlsOptions& options,
                                                   const std::string& who);

}  // namespace idem::redis::detail
