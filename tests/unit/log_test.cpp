// SPDX-License-Identifier: MIT
// LoggingObserver: one line per duplicate (key, source, first attempt's time and owner), fast
// store down/recovered once per burst, level filter, field quoting; silent by default.
#include "idem/log.hpp"

#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "support/failing_store.hpp"
#include "support/test_env.hpp"

namespace {

// Captures what a sink receives.
struct Capture {
  std::mutex mutex;
  std::vector<std::pair<idem::LogLevel, std::string>> lines;

  idem::LogSink sink() {
    return [this](idem::LogLevel level, std::string_view line) {
      std::lock_guard<std::mutex> lock(mutex);
      lines.emplace_back(level, std::string(line));
    };
  }
  std::vector<std::string> containing(const std::string& needle) {
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<std::string> out;
    for (auto& [level, line] : lines) {
      if (line.find(needle) != std::string::npos) out.push_back(line);
    }
    return out;
  }
};

idem::GuardOptions with_observer(std::shared_ptr<idem::Observer> o) {
  idem::GuardOptions options;
  options.observer = std::move(o);
  return options;
}

TEST(LoggingObserver, SilentByDefault) {
  idem::LoggingObserver observer;
  EXPECT_FALSE(observer.enabled(idem::LogLevel::kError));
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, with_observer(std::make_shared<idem::LoggingObserver>())};
  auto key = idem::Key::make("log.test", "silent");
  EXPECT_EQ(idem::Outcome::kExecuted, guard.run(key, "", [] { return std::string("a"); }).outcome);
  EXPECT_EQ(idem::Outcome::kReplayed, guard.run(key, "", [] { return std::string("b"); }).outcome);
}

TEST(LoggingObserver, FastStoreDuplicateLoggedOnceWithFirstAttempt) {
  Capture capture;
  auto logger = std::make_shared<idem::LoggingObserver>(capture.sink());
  idem::test::TempDir dir;
  idem::MemoryStore fast;
  idem::sqlite::SqliteStore durable{dir.file("log.sqlite")};
  idem::IdempotencyGuard guard{fast, durable, with_observer(logger)};
  auto key = idem::Key::make("order.create", "log_fast_1");
  auto first = guard.run(key, "fp", [](idem::sqlite::Transaction&) { return std::string("o1"); });
  ASSERT_EQ(idem::Outcome::kExecuted, first.outcome);
  EXPECT_TRUE(capture.containing("idem duplicate").empty());

  auto dup = guard.run(key, "fp", [](idem::sqlite::Transaction&) { return std::string("o2"); });
  ASSERT_EQ(idem::Outcome::kReplayed, dup.outcome);
  auto lines = capture.containing("idem duplicate");
  ASSERT_EQ(1u, lines.size());
  ASSERT_FALSE(dup.holder.empty());
  EXPECT_EQ("idem duplicate key=order.create|log_fast_1 source=fast_store outcome=replayed "
            "first_seen=" + idem::log::format_time(dup.first_seen) + " owner=" + dup.holder,
            lines[0]);
  EXPECT_NE(std::string::npos, lines[0].find("first_seen=20"));  // a real date, not "unknown"
  EXPECT_EQ(idem::LogLevel::kInfo, capture.lines.back().first);
}

TEST(LoggingObserver, UniqueIndexAndMismatchNameTheirSource) {
  Capture capture;
  auto logger = std::make_shared<idem::LoggingObserver>(capture.sink());
  idem::test::TempDir dir;
  idem::sqlite::SqliteStore durable{dir.file("log.sqlite")};
  idem::IdempotencyGuard guard{durable, with_observer(logger)};  // no fast store
  auto key = idem::Key::make("payment", "log_unique_1");
  auto h = [](idem::sqlite::Transaction&) { return std::string("paid"); };
  ASSERT_EQ(idem::Outcome::kExecuted, guard.run(key, "fp1", h).outcome);
  ASSERT_EQ(idem::Outcome::kReplayed, guard.run(key, "fp1", h).outcome);
  ASSERT_EQ(idem::Outcome::kFingerprintMismatch, guard.run(key, "fp2", h).outcome);
  auto lines = capture.containing("idem duplicate");
  ASSERT_EQ(2u, lines.size());
  EXPECT_NE(std::string::npos, lines[0].find(" source=unique_index outcome=replayed "));
  EXPECT_NE(std::string::npos, lines[1].find(" source=unique_index outcome=fingerprint_mismatch "));
  EXPECT_EQ(std::string::npos, lines[0].find("owner=unknown"));
}

TEST(LoggingObserver, FastStoreDownAndRecoveredOncePerBurst) {
  Capture capture;
  auto logger = std::make_shared<idem::LoggingObserver>(capture.sink());
  idem::test::TempDir dir;
  idem::MemoryStore inner;
  idem::test::SwitchableFastStore fast{inner};
  idem::sqlite::SqliteStore durable{dir.file("log.sqlite")};
  idem::IdempotencyGuard guard{fast, durable, with_observer(logger)};
  auto h = [](idem::sqlite::Transaction&) { return std::string("ok"); };

  ASSERT_TRUE(guard.run(idem::Key::make("s", "warmup"), "", h).ok());
  fast.failing = true;
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(guard.run(idem::Key::make("s", "down_" + std::to_string(i)), "", h).ok());
  }
  fast.failing = false;
  ASSERT_TRUE(guard.run(idem::Key::make("s", "back"), "", h).ok());
  ASSERT_TRUE(guard.run(idem::Key::make("s", "back2"), "", h).ok());

  auto downs = capture.containing("idem fast store down");
  ASSERT_EQ(1u, downs.size());
  EXPECT_EQ("idem fast store down key=s|down_0 code=store_unavailable "
            "error=\"test: fast store switched off\"",
            downs[0]);
  auto ups = capture.containing("idem fast store recovered");
  ASSERT_EQ(1u, ups.size());
  EXPECT_EQ("idem fast store recovered failed_calls=5", ups[0]);

  // A second burst is reported again.
  fast.failing = true;
  ASSERT_TRUE(guard.run(idem::Key::make("s", "down_again"), "", h).ok());
  EXPECT_EQ(2u, capture.containing("idem fast store down").size());
}

TEST(LoggingObserver, EveryStoreErrorIsOneLineWithKeyStoreAndCode) {
  Capture capture;
  auto logger = std::make_shared<idem::LoggingObserver>(capture.sink());
  idem::test::TempDir dir;
  idem::MemoryStore inner;
  idem::test::SwitchableFastStore fast{inner};
  idem::sqlite::SqliteStore durable{dir.file("errors.sqlite")};
  idem::IdempotencyGuard guard{fast, durable, with_observer(logger)};
  auto h = [](idem::sqlite::Transaction&) { return std::string("ok"); };

  // A fast-store outage: every failing call leaves a line (the down line comes once).
  fast.failing = true;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(guard.run(idem::Key::make("s", "f" + std::to_string(i)), "", h).ok());
  }
  auto fast_lines = capture.containing("idem store error");
  ASSERT_EQ(3u, fast_lines.size());
  EXPECT_EQ(
      "idem store error key=s|f0 role=fast store=switchable code=store_unavailable "
      "error=\"test: fast store switched off\"",
      fast_lines[0]);
  EXPECT_EQ(1u, capture.containing("idem fast store down").size());
  fast.failing = false;

  // A handler's own exception is not a store error.
  EXPECT_THROW((void)guard.run(idem::Key::make("s", "h"), "",
                               [](idem::sqlite::Transaction&) -> std::string {
                                 throw idem::StorageUnavailable("the handler's own");
                               }),
               idem::StorageError);
  EXPECT_EQ(3u, capture.containing("idem store error").size());

  // The durable store fails under the call (its table is gone): the call throws, and the
  // failure is a line too, before the exception reaches the caller.
  durable.database().write(
      [](idem::sqlite::Transaction& tx) { tx.exec("DROP TABLE api_idempotency"); });
  EXPECT_THROW((void)guard.run(idem::Key::make("s", "d1"), "", h), idem::StorageError);
  EXPECT_THROW((void)guard.run(idem::Key::make("s", "d2"), "", [] { return std::string(); }),
               idem::StorageError);
  auto durable_lines = capture.containing("role=durable");
  ASSERT_EQ(2u, durable_lines.size());
  EXPECT_EQ(0u, durable_lines[0].rfind("idem store error key=s|d1 role=durable store=sqlite "
                                       "code=storage_error error=",
                                       0))
      << durable_lines[0];
  EXPECT_NE(std::string::npos, durable_lines[0].find("no such table")) << durable_lines[0];
  EXPECT_NE(std::string::npos, durable_lines[1].find("key=s|d2")) << durable_lines[1];
  EXPECT_EQ(5u, capture.containing("idem store error").size());
}

TEST(LoggingObserver, RejectedRequestAndPassthroughLines) {
  Capture capture;
  idem::LoggingObserverOptions debug;
  debug.min_level = idem::LogLevel::kDebug;
  idem::LoggingObserver logger{capture.sink(), debug};
  logger.on_rejected_request(
      idem::RejectedRequestEvent{"http.orders", idem::RejectReason::kPayloadTooLarge, 413});
  logger.on_rejected_request(idem::RejectedRequestEvent{{}, idem::RejectReason::kInvalidKey, 400});
  logger.on_passthrough(idem::PassthroughEvent{"http.orders", idem::PassthroughReason::kMethod});
  auto rejected = capture.containing("idem rejected request");
  ASSERT_EQ(2u, rejected.size());
  EXPECT_EQ("idem rejected request scope=http.orders reason=payload_too_large status=413",
            rejected[0]);
  EXPECT_EQ("idem rejected request scope=- reason=invalid_key status=400", rejected[1]);
  auto passed = capture.containing("idem passthrough");
  ASSERT_EQ(1u, passed.size());
  EXPECT_EQ("idem passthrough scope=http.orders reason=method", passed[0]);
}

TEST(LoggingObserver, LevelFilterAndDebugCallLines) {
  Capture warn_capture, debug_capture;
  idem::LoggingObserverOptions warn_only;
  warn_only.min_level = idem::LogLevel::kWarn;
  idem::LoggingObserverOptions debug;
  debug.min_level = idem::LogLevel::kDebug;
  auto list = std::make_shared<idem::ObserverList>();
  list->add(std::make_shared<idem::LoggingObserver>(warn_capture.sink(), warn_only));
  list->add(std::make_shared<idem::LoggingObserver>(debug_capture.sink(), debug));
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, with_observer(list)};
  auto key = idem::Key::make("s", "levels");
  ASSERT_TRUE(guard.run(key, "", [] { return std::string("x"); }).ok());
  ASSERT_TRUE(guard.run(key, "", [] { return std::string("x"); }).ok());
  EXPECT_TRUE(warn_capture.lines.empty());
  auto calls = debug_capture.containing("idem call key=s|levels");
  ASSERT_EQ(2u, calls.size());
  EXPECT_NE(std::string::npos,
            calls[0].find("outcome=executed mode=fast_only source=handler degraded=false"));
  EXPECT_NE(std::string::npos,
            calls[1].find("outcome=replayed mode=fast_only source=fast_store degraded=false"));
  EXPECT_EQ(1u, debug_capture.containing("idem duplicate").size());
}

TEST(LoggingObserver, HandlerErrorAndThrowingSinkNeverBreakTheCall) {
  Capture capture;
  idem::MemoryStore fast;
  auto list = std::make_shared<idem::ObserverList>();
  list->add(std::make_shared<idem::LoggingObserver>(
      [](idem::LogLevel, std::string_view) { throw std::runtime_error("sink down"); }));
  list->add(std::make_shared<idem::LoggingObserver>(capture.sink()));
  idem::IdempotencyGuard guard{fast, with_observer(list)};
  auto key = idem::Key::make("s", "throwing");
  EXPECT_THROW(
      (void)guard.run(key, "", []() -> std::string { throw std::logic_error("boom"); }),
      std::logic_error);
  EXPECT_EQ(std::vector<std::string>{"idem handler error key=s|throwing error=boom"},
            capture.containing("handler error"));
  // The cause of an idem::Error a handler throws (its own SQL's failure, answered to the
  // client as a store failure) shows with its code.
  auto other = idem::Key::make("s", "own-sql");
  EXPECT_THROW((void)guard.run(other, "",
                               []() -> std::string {
                                 throw idem::StorageError("UNIQUE constraint failed: payment.no");
                               }),
               idem::StorageError);
  EXPECT_EQ(1u, capture
                    .containing("code=storage_error error=\"UNIQUE constraint failed: "
                                "payment.no\"")
                    .size());
  ASSERT_TRUE(guard.run(key, "", [] { return std::string("x"); }).ok());
  ASSERT_EQ(idem::Outcome::kReplayed, guard.run(key, "", [] { return std::string("x"); }).outcome);
}

TEST(LogFormat, QuotesFieldsAndFormatsTimes) {
  EXPECT_EQ("plain|key", idem::log::quote_field("plain|key"));
  EXPECT_EQ("\"\"", idem::log::quote_field(""));
  EXPECT_EQ("\"a b\"", idem::log::quote_field("a b"));
  EXPECT_EQ("\"say \\\"hi\\\" \\\\ \\x0A\"", idem::log::quote_field("say \"hi\" \\ \n"));
  EXPECT_EQ("unknown", idem::log::format_time(idem::TimePoint{}));
  EXPECT_EQ("2026-11-29T10:56:57.123Z",
            idem::log::format_time(idem::from_millis(1795949817123LL)));
  EXPECT_EQ("1969-12-31T23:59:59.999Z", idem::log::format_time(idem::from_millis(-1)));
  EXPECT_EQ("1926-12-31T12:44:33.692Z",
            idem::log::format_time(idem::from_millis(-1357038926308LL)));
  EXPECT_EQ("warn", idem::log_level_name(idem::LogLevel::kWarn));
}

}  // namespace
