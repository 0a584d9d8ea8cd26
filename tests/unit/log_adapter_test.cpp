// SPDX-License-Identifier: MIT
// The fmt stderr sink and the spdlog sink write the LoggingObserver's lines.
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <cstdio>
#include <sstream>
#include <string>

#include "idem/log/fmt_sink.hpp"
#include "idem/log/spdlog_sink.hpp"

namespace {

TEST(FmtSink, WritesTimeLevelAndLine) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(nullptr, f);
  idem::LoggingObserver logger{idem::log::stderr_sink(f)};
  logger.log(idem::LogLevel::kWarn, "idem lease takeover key=s|k store=fast");
  logger.log(idem::LogLevel::kDebug, "not shown at the default level");
  std::rewind(f);
  char buf[256] = {};
  ASSERT_NE(nullptr, std::fgets(buf, sizeof buf, f));
  std::string line(buf);
  std::fclose(f);
  // "<ISO time> warn  idem lease takeover key=s|k store=fast\n"
  ASSERT_GT(line.size(), 25u);
  EXPECT_EQ('Z', line[23]);
  EXPECT_EQ(" warn  idem lease takeover key=s|k store=fast\n", line.substr(24));
}

TEST(SpdlogSink, MapsLevelsAndForwardsLines) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto logger = std::make_shared<spdlog::logger>("idem_test", sink);
  logger->set_pattern("%l|%v");
  logger->set_level(spdlog::level::trace);
  idem::LoggingObserverOptions options;
  options.min_level = idem::LogLevel::kDebug;
  idem::LoggingObserver observer{idem::log::spdlog_sink(logger), options};
  observer.log(idem::LogLevel::kError, "idem lease lost key=s|k store=durable");
  observer.log(idem::LogLevel::kDebug, "idem durable retry key=s|k reason=busy");
  logger->flush();
  EXPECT_EQ("error|idem lease lost key=s|k store=durable\n"
            "debug|idem durable retry key=s|k reason=busy\n",
            out.str());
}

}  // namespace
