// SPDX-License-Identifier: MIT
// A plain stderr LogSink formatted with fmt (target idem::fmt).
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <iterator>
#include <string_view>

#include "idem/clock.hpp"
#include "idem/log.hpp"

namespace idem::log {

/// A sink writing `<UTC time> <level> <line>\n` to `stream` (stderr by default), one fwrite
/// per line so concurrent lines never interleave.
///
/// @code
///   auto logger = std::make_shared<idem::LoggingObserver>(idem::log::stderr_sink());
/// @endcode
/// @param stream where to write; must stay open while the sink is used
inline LogSink stderr_sink(std::FILE* stream = stderr) {
  return [stream](LogLevel level, std::string_view line) {
    fmt::memory_buffer buf;
    fmt::format_to(std::back_inserter(buf), "{} {:<5} {}\n", format_time(system_now()),
                   log_level_name(level), line);
    std::fwrite(buf.data(), 1, buf.size(), stream);
    std::fflush(stream);
  };
}

}  // namespace idem::log
