// SPDX-License-Identifier: MIT
// A LogSink forwarding to an spdlog logger (target idem::spdlog).
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string_view>
#include <utility>

#include "idem/log.hpp"

namespace idem::log {

/// spdlog's level for an idem level.
inline spdlog::level::level_enum to_spdlog_level(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

/// A sink logging each line through `logger` (spdlog's default logger when null) at the mapped
/// level; spdlog's own level filter and sinks then apply.
///
/// @code
///   auto logger = std::make_shared<idem::LoggingObserver>(
///       idem::log::spdlog_sink(spdlog::stderr_color_mt("idem")));
/// @endcode
inline LogSink spdlog_sink(std::shared_ptr<spdlog::logger> logger = nullptr) {
  if (!logger) logger = spdlog::default_logger();
  return [logger = std::move(logger)](LogLevel level, std::string_view line) {
    logger->log(to_spdlog_level(level), "{}", line);
  };
}

}  // namespace idem::log
