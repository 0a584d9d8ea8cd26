// SPDX-License-Identifier: MIT
// The flash sale's simulated Redis failover, shared by the PostgreSQL and MySQL backends.
#pragma once

#include <string>

namespace flash_sale {

/// Deletes the Redis keys of the sale's scope under `prefix` (or every key with `flushall`).
/// @throws std::runtime_error when Redis cannot be reached.
void clear_redis(const std::string& url, const std::string& prefix, bool flushall);

}  // namespace flash_sale
