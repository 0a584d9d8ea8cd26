// SPDX-License-Identifier: MIT
// idem::http::Endpoint: Idempotency-Key handling for one HTTP route, framework-agnostic
// (a RequestView in, a Response out). Adapters: idem/http/httplib.hpp (cpp-httplib).
//
// File: http/endpoint.hpp
//
// What a request gets (IETF httpapi draft "The Idempotency-Key HTTP Header Field"):
//
//   no Idempotency-Key, key required        400 missing_key       (problem+json)
//   no Idempotency-Key, key optional        the handler runs under a fresh random key
//   more than one field, or malformed       400 invalid_key
//   first request with this key             the handler's response, as it returned it
//   same key, same payload, completed       the first response replayed: its status, the chosen
//                                           headers (EndpointOptions::replay_headers) and the
//                                           body byte for byte, plus `Idempotent-Replayed: true`
//   same key, first request still running   409 in_progress + `Retry-After`
//   same key, different payload             422 fingerprint_mismatch
//   key refused by EndpointOptions::admit_key  the refusal it returned, never stored (e.g. 403
//                                           unknown_token: http/form_token.hpp)
//   idem store failure (idem::Error)        its errc's status (503 + Retry-After when retryable)
//
// The key is scoped server-side (see http/idempotency_key.hpp): scope = the endpoint's scope,
// id = SHA-256 of (principal, method, route, client key), so a client never receives another
// client's stored response. The fingerprint covers the method, the route, the request headers
// named in EndpointOptions::fingerprint_headers and the body.
//
// The handler is `Response(Transaction&)` (transactional: its writes commit with the record)
// or `Response()` (two-phase / fast-only), exactly as for IdempotencyGuard::run. Responses the
// predicate `store_response` rejects (default: 5xx) are returned to this caller but not stored:
// the transaction rolls back and the claim is released, so a retry runs again. To fail without
// any response, throw: the exception propagates after the claim is released.
//
// @code
//   idem::http::EndpointOptions options;
//   options.scope = "http.orders.create";
//   idem::http::Endpoint create_order{guard, options};
//   idem::http::Response r = create_order.handle(view, [&](idem::sqlite::Transaction& tx) {
//     tx.exec("INSERT INTO orders ...");
//     return idem::http::Response{201, {{"Content-Type", "application/json"}}, body};
//   });
// @endcode
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/http/idempotency_key.hpp"
#include "idem/http/response.hpp"

namespace idem::http {

/// The header added to replayed responses.
inline constexpr std::string_view kReplayedHeader = "Idempotent-Replayed";

/// What Endpoint needs of a request. Views: the framework's request must outlive the call.
struct RequestView {
  /// Method as sent ("POST").
  std::string_view method;
  /// The route pattern or name ("/orders"), not the concrete path: part of the key's scope.
  std::string_view route;
  /// The authenticated principal or tenant; "" for anonymous callers (who share one namespace).
  std::string_view principal;
  /// Every header field line, in order (names in any case).
  std::vector<std::pair<std::string_view, std::string_view>> headers;
  /// The body bytes.
  std::string_view body;
};

/// Options of an Endpoint.
struct EndpointOptions {
  /// The idem::Key scope of this endpoint, e.g. "http.orders.create" (1..64 of
  /// [A-Za-z0-9._:-]). Required.
  std::string scope;
  /// true: a request without Idempotency-Key gets 400 missing_key. false: it runs under a
  /// fresh random key (executed every time).
  bool key_required = true;
  /// Response headers stored with the response and replayed (case-insensitive names). Others
  /// (Set-Cookie, Date, ...) reach the first caller only.
  std::vector<std::string> replay_headers = {"Content-Type", "Location"};
  /// Request headers covered by the fingerprint besides method, route and body (e.g.
  /// "Content-Type"). Empty: none.
  std::vector<std::string> fingerprint_headers;
  /// The Retry-After value (seconds) of 409 in_progress and retryable 503 answers.
  std::chrono::seconds retry_after{1};
  /// Which handler responses are stored and replayed, by status. Empty: status < 500.
  std::function<bool(int)> store_response;
  /// Prefix of the problem+json `type` (followed by the errc name).
  std::string problem_type_prefix = "urn:idem:error:";
  /// Which client keys may be used at all, for endpoints whose keys the server hands out (see
  /// http/form_token.hpp: FormTokens::require_issued). Called with the request and the client's
  /// key (unescaped) right before the handler runs for that key, inside the guard's claim: a
  /// duplicate of a completed or running request never reaches it and is answered as usual.
  /// Return a response to refuse the key: this caller gets it, nothing is stored (the claim is
  /// released and the guard counts a handler error). nullopt accepts the key. Whatever it
  /// throws propagates as from the handler. Empty: every well-formed key is accepted.
  std::function<std::optional<Response>(const RequestView&, std::string_view key)> admit_key;
};

namespace detail {
// Thrown through the guard to keep a response out of the store (rolled back, released).
struct DoNotStore {};
}  // namespace detail

/// Idempotency-Key handling for one route (see the file comment). Thread-safe; cheap to call.
/// @tparam Durable the guard's durable store type.
template <class Durable>
class Endpoint {
 public:
  /// @param guard   the guard (must outlive the endpoint)
  /// @param options the endpoint's options
  /// @throws idem::InvalidKey when options.scope breaks a scope rule; idem::UsageError when
  ///         retry_after is negative.
  Endpoint(IdempotencyGuard<Durable>& guard, EndpointOptions options)
      : guard_(guard), options_(std::move(options)) {
    Key::validate_scope(options_.scope);
    if (options_.retry_after.count() < 0) {
      throw UsageError("idem::http::Endpoint: retry_after must not be negative");
    }
  }

  /// Handles one request (see the file comment for every answer).
  /// @param request the request
  /// @param handler `Response(Transaction&)` or `Response()`
  /// @return the response to send
  /// @throws whatever the handler throws (after the claim was released)
  template <class Fn>
  Response handle(const RequestView& request, Fn&& handler) {
    ParsedKey parsed = parse_idempotency_key(key_fields(request));
    std::string client_key;
    switch (parsed.status) {
      case ParsedKey::Status::kOk: client_key = std::move(parsed.value); break;
      case ParsedKey::Status::kMissing:
        if (options_.key_required) {
          return problem(errc::kMissingKey,
                         "this endpoint requires an Idempotency-Key header, e.g. "
                         "Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\"");
        }
        client_key = OwnerToken::generate().str();
        break;
      case ParsedKey::Status::kMalformed:
      case ParsedKey::Status::kMultiple:
        return problem(errc::kInvalidKey, parsed.detail);
    }

    Key key = scoped_key(options_.scope, request.principal, request.method, request.route,
                         client_key);
    std::string fp = request_fingerprint(request);
    std::optional<Response> first;  // the handler's full response, for this caller
    auto admit = [&] {  // EndpointOptions::admit_key: a refusal is sent, never stored
      if (!options_.admit_key) return;
      if (auto refusal = options_.admit_key(request, client_key)) {
        first = std::move(*refusal);
        throw detail::DoNotStore{};
      }
    };
    auto keep = [&](Response r) -> Response {
      bool store = options_.store_response ? options_.store_response(r.status) : r.status < 500;
      first = std::move(r);
      if (!store) throw detail::DoNotStore{};
      return stored_part(*first);
    };

    try {
      using Tx = ::idem::detail::transaction_t<Durable>;
      if constexpr (::idem::detail::kTakesTransaction<std::decay_t<Fn>, Tx>) {
        return answer(guard_.run(key, fp, [&](Tx& tx) { admit(); return keep(handler(tx)); }),
                      first);
      } else {
        return answer(guard_.run(key, fp, [&] { admit(); return keep(handler()); }),
                      first);
      }
    } catch (const detail::DoNotStore&) {
      return std::move(*first);
    } catch (const Error& e) {
      // The exception's text (backend messages, internal key names, tuning advice) stays in the
      // server's logs; the client gets the code's public message.
      return problem(e.code(), errc_message(e.code()));
    }
  }

  /// The fingerprint of a request: SHA-256 over method, route, the chosen headers and body.
  std::string request_fingerprint(const RequestView& request) const {
    std::string material = "idem.http.fp.v1";
    idem::http::detail::append_length_prefixed(material, request.method);
    idem::http::detail::append_length_prefixed(material, request.route);
    for (const auto& name : options_.fingerprint_headers) {
      material += '|';
      for (const auto& [n, v] : request.headers) {
        if (iequals(n, name)) idem::http::detail::append_length_prefixed(material, v);
      }
    }
    material += '|';
    idem::http::detail::append_length_prefixed(material, request.body);
    return fingerprint(material);
  }

  /// A problem+json response for `code` (with Retry-After when the code is retryable).
  Response problem(errc code, std::string_view detail) const {
    Response r = idem::http::problem(code, detail, options_.problem_type_prefix);
    if (is_retryable(code)) r.set_header("Retry-After", std::to_string(options_.retry_after.count()));
    return r;
  }

  /// The options in force.
  const EndpointOptions& options() const noexcept { return options_; }

 private:
  static std::vector<std::string_view> key_fields(const RequestView& request) {
    std::vector<std::string_view> fields;
    for (const auto& [name, value] : request.headers) {
      if (iequals(name, kIdempotencyKeyHeader)) fields.push_back(value);
    }
    return fields;
  }

  // Status, chosen headers and body: what is stored and replayed.
  Response stored_part(const Response& r) const {
    Response s;
    s.status = r.status;
    for (const auto& h : r.headers) {
      for (const auto& name : options_.replay_headers) {
        if (iequals(h.name, name)) {
          s.headers.push_back(h);
          break;
        }
      }
    }
    s.body = r.body;
    return s;
  }

  Response answer(GuardResult<Response> r, std::optional<Response>& first) const {
    switch (r.outcome) {
      case Outcome::kExecuted: return std::move(*first);
      case Outcome::kReplayed: {
        Response replay = std::move(*r.value);
        replay.headers.push_back(Header{std::string(kReplayedHeader), "true"});
        return replay;
      }
      case Outcome::kInProgress:
        return problem(errc::kInProgress,
                       "a request with this Idempotency-Key is still being processed; retry "
                       "after " + std::to_string(options_.retry_after.count()) + " s");
      case Outcome::kFingerprintMismatch:
        return problem(errc::kFingerprintMismatch,
                       "this Idempotency-Key was already used with a different request payload");
    }
    return problem(errc::kStorageError, "unknown outcome");
  }

  IdempotencyGuard<Durable>& guard_;
  EndpointOptions options_;
};

/// `Endpoint endpoint{guard, options}` deduces the durable store type.
template <class Durable>
Endpoint(IdempotencyGuard<Durable>&, EndpointOptions) -> Endpoint<Durable>;

}  // namespace idem::http
