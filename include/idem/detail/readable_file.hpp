// SPDX-License-Identifier: MIT
// A file a connection option names (a TLS CA, certificate or key) must be readable; one that is
// not is a configuration error, said when the client is made rather than as a vague TLS
// failure at every connect. Used by the MySQL and RabbitMQ adapters.
#pragma once

#include <fstream>
#include <string>

#include "idem/errors.hpp"

namespace idem::detail {

/// Throws UsageError "`who``option` '`path`' cannot be read" unless `path` is empty (the option
/// is not set) or names a file this process can open for reading.
inline void require_readable_file(const std::string& who, const char* option,
                                  const std::string& path) {
  if (path.empty()) return;
  if (!std::ifstream(path, std::ios::binary).good()) {
    throw UsageError(who + option + " '" + path + "' cannot be read");
  }
}

}  // namespace idem::detail
