// SPDX-License-Identifier: MIT
// idem::http::FormTokens: server-issued one-time form tokens, the only keys an endpoint accepts
// when clients must not make keys up.
//
// File: http/form_token.hpp
//
// The pattern many web backends use against form resubmission:
//
//   GET  /checkout          the server issues a token with the form: FormTokens::issue(principal)
//   POST /checkout          the submit carries it as its key: `Idempotency-Key: "<token>"`
//     first submit          the handler runs; its idempotency record uses the token up
//     resubmit (any number) the first answer, replayed (409 in_progress while it still runs)
//     a token never issued  403 unknown_token: a client cannot make up keys
//     an expired token      403 unknown_token, detail "expired": fetch the form again
//     another user's token  403 unknown_token: a token is bound to the principal it was issued to
//
// Where the check runs: FormTokens::require_issued sets EndpointOptions::admit_key, which the
// endpoint calls inside the guard's claim, right before the handler runs. So the token is
// checked once per key, by the attempt that runs the handler; a resubmit of a used token never
// reaches the check and replays the first answer, even after the token itself expired. What
// makes the token one-time is the guard's record of it (kept for GuardOptions::retention), not
// a "used" flag that a crash between the flag and the handler could strand: a handler that
// fails (throws, or answers 5xx) leaves the token usable for the retry. require_issued refuses
// a token lifetime longer than the guard's retention, since a token still alive after its
// record was purged could run twice.
//
// Storage: a token is a completed record in a FastStore (MemoryStore in one process, RedisStore
// for several instances behind one load balancer), under Key(FormTokenOptions::scope, token),
// kept for the token's ttl; its fingerprint binds it to the principal. Issuing is one write
// (FastStore::fill), checking one read (FastStore::lookup). A store that loses a token (a
// Redis failover) fails closed: the submit is refused with unknown_token and the user fetches
// the form again; nothing runs twice.
//
// The token is "ft1." <expiry, Unix seconds> "." <128 random bits, hex> (OpenSSL RAND_bytes).
// The expiry in the token refuses a stale token without a store read and words the refusal
// ("expired" rather than "unknown") once the store has dropped the record; acceptance always
// needs the stored record, so editing the expiry makes a different, unknown token.
//
// @code
//   idem::http::FormTokens tokens{fast, {"form.checkout", std::chrono::minutes(30)}};
//   idem::http::EndpointOptions options;
//   options.scope = "http.checkout";
//   tokens.require_issued(options, guard.options());   // only issued tokens are keys
//   idem::http::Endpoint checkout{guard, options};
//
//   // GET /checkout: the form and its token
//   idem::http::IssuedToken t = tokens.issue(user_id);
//   // ... render t.value into the form; the browser submits Idempotency-Key: "<t.value>"
// @endcode
#pragma once

#include <charconv>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/clock.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/http/endpoint.hpp"
#include "idem/http/response.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"

namespace idem::http {

/// Options of FormTokens.
struct FormTokenOptions {
  /// The idem::Key scope under which tokens are stored, e.g. "form.checkout" (1..64 of
  /// [A-Za-z0-9._:-]). One per form: a token issued under one scope is unknown under another.
  /// Use a scope of its own, not the endpoint's.
  std::string scope;
  /// How long an issued token may be submitted for the first time (whole seconds, positive).
  /// At most the guard's GuardOptions::retention (checked by require_issued).
  std::chrono::seconds ttl{30 * 60};
  /// Time source for the expiry (empty: the system clock). The store's own clock decides when
  /// it drops the record; give both the same clock in tests.
  Clock clock{};
};

/// A token as issued.
struct IssuedToken {
  /// The token ("ft1.<expiry>.<32 hex digits>"): the form sends it back as its key.
  std::string value;
  /// When it stops being accepted for a first submit.
  TimePoint expires_at{};

  /// The Idempotency-Key field value that carries it: the token in double quotes (an RFC 8941
  /// sf-string; tokens contain no character that needs escaping).
  std::string header_value() const { return "\"" + value + "\""; }
};

/// What FormTokens::check found.
enum class TokenStatus {
  kValid,    ///< issued under this scope, to this principal, and not expired
  kUnknown,  ///< never issued (or malformed, or issued to another principal, or lost)
  kExpired,  ///< issued, but its lifetime is over
};

/// Stable name: valid, unknown, expired.
constexpr std::string_view token_status_name(TokenStatus s) noexcept {
  switch (s) {
    case TokenStatus::kValid:
      return "valid";
    case TokenStatus::kUnknown:
      return "unknown";
    case TokenStatus::kExpired:
      return "expired";
  }
  return "unknown";
}

/// Issues and checks form tokens (see the file comment). Thread-safe; the store must outlive
/// it, and it must outlive every endpoint it was applied to.
class FormTokens {
 public:
  /// First characters of every token (format version).
  static constexpr std::string_view kPrefix = "ft1.";

  /// @param store   where tokens are kept (a FastStore: memory, Redis, ...)
  /// @param options scope, ttl, clock
  /// @throws idem::InvalidKey for a bad scope; idem::UsageError for a ttl that is not positive.
  FormTokens(FastStore& store, FormTokenOptions options)
      : store_(store), options_(std::move(options)) {
    Key::validate_scope(options_.scope);
    if (options_.ttl.count() <= 0) {
      throw UsageError("idem::http::FormTokens: ttl must be positive");
    }
    if (!options_.clock) options_.clock = system_now;
  }

  /// Issues a token for `principal` (the authenticated user or tenant; "" for anonymous forms,
  /// whose tokens any anonymous client holding them may submit) and stores it for the ttl.
  /// @throws idem::StorageError subclasses when the store fails (nothing was issued).
  IssuedToken issue(std::string_view principal) {
    IssuedToken t;
    t.expires_at =
        options_.clock() + std::chrono::duration_cast<std::chrono::milliseconds>(options_.ttl);
    unsigned char raw[16];
    idem::detail::random_bytes(raw, sizeof raw);
    auto expiry_s =
        std::chrono::duration_cast<std::chrono::seconds>(t.expires_at.time_since_epoch());
    t.value = std::string(kPrefix) + std::to_string(expiry_s.count()) + "." +
              idem::detail::to_hex(raw, sizeof raw);
    store_.fill(Key::make(options_.scope, t.value), binding(principal),
                std::to_string(to_millis(t.expires_at)), options_.ttl);
    return t;
  }

  /// Whether `token` may be used by `principal` now. Reads the store (one lookup) unless the
  /// token is malformed or its expiry has passed.
  /// @throws idem::StorageError subclasses when the store fails.
  TokenStatus check(std::string_view principal, std::string_view token) const {
    auto issued_second = parse_expiry_second(token);
    if (!issued_second) return TokenStatus::kUnknown;
    const TimePoint now = options_.clock();
    // The token carries its expiry rounded down to the second: past that second it is expired
    // whatever the store says.
    if (now >= *issued_second + std::chrono::seconds(1)) return TokenStatus::kExpired;
    std::optional<Record> r = store_.lookup(Key::make(options_.scope, token));
    if (!r) return now >= *issued_second ? TokenStatus::kExpired : TokenStatus::kUnknown;
    if (r->status != Record::Status::kCompleted || r->fingerprint != binding(principal)) {
      return TokenStatus::kUnknown;
    }
    // The store keeps the record for whole seconds; the stored expiry is exact.
    long long stored = 0;
    const std::string& s = r->response;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), stored);
    if (ec != std::errc() || end != s.data() + s.size()) return TokenStatus::kUnknown;
    return now < from_millis(stored) ? TokenStatus::kValid : TokenStatus::kExpired;
  }

  /// The refusal an endpoint sends for `status` (kUnknown or kExpired): 403 problem+json with
  /// code unknown_token and a detail saying which. Never stored.
  Response refusal(TokenStatus status,
                   std::string_view problem_type_prefix = "urn:idem:error:") const {
    if (status == TokenStatus::kExpired) {
      return problem(errc::kUnknownToken,
                     "this form token has expired; fetch the form again for a new token",
                     problem_type_prefix);
    }
    return problem(errc::kUnknownToken,
                   "this Idempotency-Key is not a form token this server issued to you; fetch "
                   "the form for a token",
                   problem_type_prefix);
  }

  /// An EndpointOptions::admit_key accepting only tokens check() finds valid for the
  /// request's principal (others get refusal()). Captures this object by reference.
  std::function<std::optional<Response>(const RequestView&, std::string_view)> admission(
      std::string problem_type_prefix = "urn:idem:error:") const {
    return [this, prefix = std::move(problem_type_prefix)](
               const RequestView& request, std::string_view key) -> std::optional<Response> {
      TokenStatus s = check(request.principal, key);
      if (s == TokenStatus::kValid) return std::nullopt;
      return refusal(s, prefix);
    };
  }

  /// Makes `options` accept only issued tokens as keys: sets admit_key (admission() with the
  /// options' problem type prefix) and key_required.
  /// @param options the endpoint's options, changed in place
  /// @param guard_options the options of the endpoint's guard
  /// @throws idem::UsageError when the token ttl exceeds guard_options.retention (a token
  ///         alive after its used record was purged could run the handler again).
  void require_issued(EndpointOptions& options, const GuardOptions& guard_options) const {
    if (options_.ttl > guard_options.retention) {
      throw UsageError(
          "idem::http::FormTokens: the token ttl (" + std::to_string(options_.ttl.count()) +
          " s) exceeds the guard's retention (" + std::to_string(guard_options.retention.count()) +
          " s): a used token could run again after its record is purged");
    }
    options.key_required = true;
    options.admit_key = admission(options.problem_type_prefix);
  }

  /// The options in force.
  const FormTokenOptions& options() const noexcept { return options_; }

 private:
  // The record's fingerprint: the principal the token was issued to.
  static std::string binding(std::string_view principal) {
    std::string material = "idem.form_token.v1|";
    material += std::to_string(principal.size());
    material += ':';
    material.append(principal.data(), principal.size());
    return fingerprint(material);
  }

  // "ft1.<seconds>.<32 hex>": the expiry second, or nullopt when not of this format.
  static std::optional<TimePoint> parse_expiry_second(std::string_view token) {
    if (token.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
    token.remove_prefix(kPrefix.size());
    auto dot = token.find('.');
    if (dot == std::string_view::npos || dot == 0 || dot > 12) return std::nullopt;
    std::int64_t seconds = 0;
    auto [end, ec] = std::from_chars(token.data(), token.data() + dot, seconds);
    if (ec != std::errc() || end != token.data() + dot || seconds <= 0) return std::nullopt;
    std::string_view hex = token.substr(dot + 1);
    if (hex.size() != 32) return std::nullopt;
    for (char c : hex) {
      if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return std::nullopt;
    }
    return from_millis(seconds * 1000);
  }

  FastStore& store_;
  FormTokenOptions options_;
};

}  // namespace idem::http
