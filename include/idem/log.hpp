// SPDX-License-Identifier: MIT
// Logging for idem: a one-function sink interface (silent by default) and LoggingObserver,
// which turns the guard's events into one line each.
//
// File: log.hpp
//
// idem never writes to stdout/stderr on its own. A service that wants lines passes a sink, a
// `std::function<void(LogLevel, std::string_view)>`, to a LoggingObserver and hands the observer
// to the guard (GuardOptions::observer). Adapters: idem/log/fmt_sink.hpp (plain stderr through
// fmt, target idem::fmt) and idem/log/spdlog_sink.hpp (an spdlog logger, target idem::spdlog).
//
// What is logged, one line per event, `key=value` fields, values never containing spaces or
// quoted with "..." when they might:
//
//   info  idem duplicate key=<scope|id> source=<fast_store|unique_index|state_machine|mq_record>
//               outcome=<replayed|in_progress|fingerprint_mismatch>
//               first_seen=<ISO-8601 UTC ms|unknown> owner=<first attempt's token|unknown>
//   warn  idem fast store down key=<key> code=<errc name> error="<what()>"
//   info  idem fast store recovered failed_calls=<n>
//   warn  idem lease takeover key=<key> store=<fast|durable>
//   error idem lease lost key=<key> store=<fast|durable>
//   warn  idem handler error key=<key> [code=<errc name>] error="<what()>"
//               (code: when the handler threw an idem::Error, e.g. its own SQL's StorageError)
//   debug idem durable retry key=<key> reason="<reason>"
//   warn  idem store error key=<key|-> role=<fast|durable> store=<name> code=<errc name>
//               error="<what()>"                       (every store failure)
//   info  idem rejected request scope=<scope|-> reason=<missing_key|invalid_key|
//               payload_too_large|fingerprint_mismatch> status=<400|413|422>
//   debug idem passthrough scope=<scope> reason=<no_key|method|disabled>
//   debug idem redelivery group=<group> message_id=<id> delivery_count=<n>
//   debug idem call key=<key> outcome=... mode=... source=... degraded=<bool> total_us=<n>
//
// Every duplicate the guard detects is logged exactly once, so "why are there two identical
// transactions?" is answered by grepping the key. The fast store's down/recovered pair is
// logged once per burst of failures (the guard already deduplicates the events), not per call.
//
// @code
//   auto logger = std::make_shared<idem::LoggingObserver>(idem::log::stderr_sink());
//   idem::GuardOptions options;
//   options.observer = logger;
//   idem::IdempotencyGuard guard{fast, durable, options};
// @endcode
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/clock.hpp"
#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"

namespace idem {

/// Severity of a log line.
enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

/// Stable lower-case name: debug, info, warn, error, off.
constexpr std::string_view log_level_name(LogLevel l) noexcept {
  switch (l) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "unknown";
}

/// Receives one formatted line (no trailing newline) and its level. Must be thread-safe.
/// An empty function means "silent".
using LogSink = std::function<void(LogLevel, std::string_view)>;

namespace log {

/// A sink that drops everything (the default).
inline LogSink silent_sink() { return {}; }

/// `t` as ISO-8601 UTC with milliseconds ("2026-11-29T10:56:57.123Z"), or "unknown" for epoch.
inline std::string format_time(TimePoint t) {
  long long ms = to_millis(t);
  if (ms == 0) return "unknown";
  // Whole seconds rounded down, so times before 1970 keep a positive millisecond part.
  const long long rem = ((ms % 1000) + 1000) % 1000;
  std::time_t secs = static_cast<std::time_t>((ms - rem) / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  std::size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::string out(buf, n);
  char frac[8];
  std::snprintf(frac, sizeof frac, ".%03dZ", static_cast<int>(rem));
  return out + frac;
}

/// `s` as a log field value: unchanged when it is non-empty printable ASCII without space,
/// '"' or '\'; otherwise double-quoted with \" \\ and \xNN escapes (so a line stays one line).
inline std::string quote_field(std::string_view s) {
  bool plain = !s.empty();
  for (char ch : s) {
    auto c = static_cast<unsigned char>(ch);
    if (c < 0x21 || c > 0x7E || c == '"' || c == '\\') {
      plain = false;
      break;
    }
  }
  if (plain) return std::string(s);
  std::string out = "\"";
  for (char ch : s) {
    auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c > 0x7E) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += ch;
    }
  }
  out += '"';
  return out;
}

}  // namespace log

/// Options of a LoggingObserver.
struct LoggingObserverOptions {
  /// Lines below this level are not formatted at all. kInfo logs duplicates and store events;
  /// kDebug adds one line per call and durable retries.
  LogLevel min_level = LogLevel::kInfo;
};

/// An Observer that formats each event into one line and sends it to a LogSink (see the file
/// comment for the lines). Thread-safe if the sink is. Never throws (a throwing sink is ignored).
class LoggingObserver final : public Observer {
 public:
  /// @param sink    where lines go; empty means silent
  /// @param options minimum level
  explicit LoggingObserver(LogSink sink = {}, LoggingObserverOptions options = {})
      : sink_(std::move(sink)), options_(options) {}

  /// info: `idem duplicate key=... source=... outcome=... first_seen=... owner=...`.
  void on_duplicate(const DuplicateEvent& e) noexcept override {
    if (!enabled(LogLevel::kInfo)) return;
    emit(LogLevel::kInfo, [&] {
      return "idem duplicate key=" + log::quote_field(e.key.str()) +
             " source=" + std::string(duplicate_source_name(e.source)) +
             " outcome=" + std::string(outcome_name(e.outcome)) +
             " first_seen=" + log::format_time(e.first_seen) +
             " owner=" + (e.holder.empty() ? std::string("unknown") : log::quote_field(e.holder));
    });
  }

  /// warn: `idem fast store down key=... code=... error="..."` (once per burst).
  void on_fast_store_down(const Key& key, const Error& error) noexcept override {
    if (!enabled(LogLevel::kWarn)) return;
    emit(LogLevel::kWarn, [&] {
      return "idem fast store down key=" + log::quote_field(key.str()) +
             " code=" + std::string(errc_name(error.code())) +
             " error=" + log::quote_field(error.what());
    });
  }

  /// info: `idem fast store recovered failed_calls=<n>`.
  void on_fast_store_recovered(std::uint64_t failed_calls) noexcept override {
    if (!enabled(LogLevel::kInfo)) return;
    emit(LogLevel::kInfo, [&] {
      return "idem fast store recovered failed_calls=" + std::to_string(failed_calls);
    });
  }

  /// warn: `idem lease takeover key=... store=...`.
  void on_takeover(const Key& key, std::string_view store) noexcept override {
    if (!enabled(LogLevel::kWarn)) return;
    emit(LogLevel::kWarn, [&] {
      return "idem lease takeover key=" + log::quote_field(key.str()) +
             " store=" + std::string(store);
    });
  }

  /// error: `idem lease lost key=... store=...`.
  void on_lease_lost(const Key& key, std::string_view store) noexcept override {
    if (!enabled(LogLevel::kError)) return;
    emit(LogLevel::kError, [&] {
      return "idem lease lost key=" + log::quote_field(key.str()) + " store=" + std::string(store);
    });
  }

  /// warn: `idem handler error key=... [code=...] error="..."` (the cause: a handler's own
  /// SQL that failed is answered as a store failure, and this line is where it shows).
  void on_handler_exception(const Key& key, const std::exception_ptr& error) noexcept override {
    if (!enabled(LogLevel::kWarn)) return;
    emit(LogLevel::kWarn, [&] {
      std::string line = "idem handler error key=" + log::quote_field(key.str());
      try {
        if (error) std::rethrow_exception(error);
        line += " error=\"unknown\"";
      } catch (const Error& e) {
        line += " code=";
        line += errc_name(e.code());
        line += " error=" + log::quote_field(e.what());
      } catch (const std::exception& e) {
        line += " error=" + log::quote_field(e.what());
      } catch (...) {
        line += " error=\"not a std::exception\"";
      }
      return line;
    });
  }

  /// debug: `idem durable retry key=... reason="..."`.
  void on_durable_retry(const Key& key, std::string_view reason) noexcept override {
    if (!enabled(LogLevel::kDebug)) return;
    emit(LogLevel::kDebug, [&] {
      return "idem durable retry key=" + log::quote_field(key.str()) +
             " reason=" + log::quote_field(reason);
    });
  }

  /// warn: `idem store error key=... role=... store=... code=... error="..."` (every failure).
  void on_store_error(const StoreErrorEvent& e) noexcept override {
    if (!enabled(LogLevel::kWarn)) return;
    emit(LogLevel::kWarn, [&] {
      return "idem store error key=" + (e.key ? log::quote_field(e.key->str()) : std::string("-")) +
             " role=" + std::string(store_role_name(e.role)) +
             " store=" + log::quote_field(e.store) +
             " code=" + std::string(errc_name(e.error.code())) +
             " error=" + log::quote_field(e.error.what());
    });
  }

  /// info: `idem rejected request scope=... reason=... status=...`.
  void on_rejected_request(const RejectedRequestEvent& e) noexcept override {
    if (!enabled(LogLevel::kInfo)) return;
    emit(LogLevel::kInfo, [&] {
      return "idem rejected request scope=" +
             (e.scope.empty() ? std::string("-") : log::quote_field(e.scope)) +
             " reason=" + std::string(reject_reason_name(e.reason)) +
             " status=" + std::to_string(e.status);
    });
  }

  /// debug: `idem passthrough scope=... reason=...`.
  void on_passthrough(const PassthroughEvent& e) noexcept override {
    if (!enabled(LogLevel::kDebug)) return;
    emit(LogLevel::kDebug, [&] {
      return "idem passthrough scope=" + log::quote_field(e.scope) +
             " reason=" + std::string(passthrough_reason_name(e.reason));
    });
  }

  /// debug: `idem redelivery group=... message_id=... delivery_count=...`.
  void on_redelivery(const RedeliveryEvent& e) noexcept override {
    if (!enabled(LogLevel::kDebug)) return;
    emit(LogLevel::kDebug, [&] {
      return "idem redelivery group=" + log::quote_field(e.group) +
             " message_id=" + log::quote_field(e.message_id) +
             " delivery_count=" + std::to_string(e.delivery_count);
    });
  }

  /// debug: `idem call key=... outcome=... mode=... source=... degraded=... total_us=...`.
  void on_call(const CallEvent& e) noexcept override {
    if (!enabled(LogLevel::kDebug)) return;
    emit(LogLevel::kDebug, [&] {
      return "idem call key=" + log::quote_field(e.key.str()) +
             " outcome=" + std::string(outcome_name(e.outcome)) +
             " mode=" + std::string(mode_name(e.mode)) +
             " source=" + std::string(source_name(e.source)) +
             " degraded=" + (e.degraded ? "true" : "false") + " total_us=" +
             std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(e.total).count());
    });
  }

  /// Logs a line through the same sink and level filter (for application code that wants its
  /// idempotency-related lines, e.g. a state-machine duplicate, next to the guard's).
  void log(LogLevel level, std::string_view line) noexcept {
    if (!enabled(level)) return;
    emit(level, [&] { return std::string(line); });
  }

  /// True when a line of `level` would reach the sink.
  bool enabled(LogLevel level) const noexcept {
    return sink_ && level != LogLevel::kOff && level >= options_.min_level;
  }

 private:
  template <class Format>
  void emit(LogLevel level, Format&& format) noexcept {
    try {
      std::string line = format();
      sink_(level, line);
    } catch (...) {
      // Logging must never break the guarded call.
    }
  }

  LogSink sink_;
  LoggingObserverOptions options_;
};

}  // namespace idem
