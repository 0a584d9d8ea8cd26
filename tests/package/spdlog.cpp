// SPDX-License-Identifier: MIT
// Consumer of idem::spdlog: the sink maps idem levels to spdlog's.
#include <idem/log/spdlog_sink.hpp>

#include "consumer.hpp"

int main() {
  check_version();
  CONSUMER_CHECK(idem::log::to_spdlog_level(idem::LogLevel::kWarn) == spdlog::level::warn);
  idem::log::spdlog_sink()(idem::LogLevel::kInfo, "spdlog: sink wrote a line");
  return 0;
}
