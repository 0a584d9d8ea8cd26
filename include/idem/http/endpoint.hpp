// SPDX-License-Identifier: MIT
// idem::http::Endpoint: Idempotency-Key handling for one HTTP route, framework-agnostic
// (a RequestView in, a Response out). Adapters: idem/http/httplib.hpp (cpp-httplib).
//
// File: http/endpoint.hpp
//
// What a request gets (IETF httpapi draft "The Idempotency-Key HTTP Header Field"):
//
//   a method not in guarded_methods         the handler runs; no record, no store I/O
//                                           (default guarded: POST and PATCH)
//   body over max_body_bytes (1 MiB)        413 payload_too_large, before anything is read
//                                           or stored
//   no Idempotency-Key, key required        400 missing_key       (problem+json)
//   no Idempotency-Key, key optional        the handler runs; no record, no store I/O
//   more than one field, or malformed       400 invalid_key       (bare `abc` only with
//                                           key_syntax = KeySyntax::kAllowBareToken)
//   first request with this key             the handler's response, as it returned it
//   same key, same payload, completed       the first response replayed: its status, the chosen
//                                           headers (EndpointOptions::replay_headers) and the
//                                           body byte for byte, plus `Idempotent-Replayed: true`
//   same key, first request still running   409 in_progress + `Retry-After` (with
//                                           EndpointOptions::wait_for_result, or a client's
//                                           `Prefer: wait=N` under max_prefer_wait: the first
//                                           result once it is done, if within the wait)
//   same key, different payload             422 fingerprint_mismatch
//   key refused by EndpointOptions::admit_key  the refusal it returned, never stored (e.g. 403
//                                           unknown_token: http/form_token.hpp)
//   idem store failure (idem::Error)        its errc's status (503 + Retry-After when retryable)
//
// Error answers are problem+json unless EndpointOptions::error_formatter builds them. Requests
// refused with 400/413/422 and pass-throughs reach the guard's Observer (on_rejected_request,
// on_passthrough); store failures reach it from the guard (on_store_error), so a 503 always
// leaves a log line and a metric behind.
//
// The key is scoped server-side (see http/idempotency_key.hpp): scope = the endpoint's scope,
// id = SHA-256 of (principal, method, route, client key), so a client never receives another
// client's stored response. The fingerprint covers the method, the route, the concrete path and
// query (RequestView::path, RequestView::query, when the adapter fills them), the request headers
// named in EndpointOptions::fingerprint_headers and the body, unless EndpointOptions::fingerprint
// says otherwise (e.g. idem::http::json_fingerprint(): the body as canonical JSON, so
// re-serialised JSON with the same meaning replays instead of answering 422).
//
// The handler is `Response(Transaction&)` (transactional: its writes commit with the record)
// or `Response()` (two-phase / fast-only), exactly as for IdempotencyGuard::run. Responses the
// predicate `store_response` rejects (default: 5xx, 408, 425, 429) are returned to this caller but not stored:
// the transaction rolls back and the claim is released, so a retry runs again. To fail without
// any response, throw: the exception propagates unchanged after the claim is released (an
// idem::Error too, except a storage failure of the handler's own SQL: StorageError and its
// kinds, LeaseLost, answered as store failures).
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

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/detail/handler_error.hpp"
#include "idem/detail/plain_transaction.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/http/idempotency_key.hpp"
#include "idem/http/response.hpp"
#include "idem/observer.hpp"

namespace idem::http {

/// The header added to replayed responses.
inline constexpr std::string_view kReplayedHeader = "Idempotent-Replayed";

/// What Endpoint needs of a request. Views: the framework's request must outlive the call.
struct RequestView {
  /// Method as sent ("POST").
  std::string_view method;
  /// The route pattern or name ("/orders"), not the concrete path: part of the key's scope.
  std::string_view route;
  /// The concrete path ("/accounts/1/refund"), as the framework decoded it; "" when the adapter
  /// does not provide it. Covered by the default fingerprint: the same key sent to another
  /// resource of the route is a 422, never the other resource's replay.
  std::string_view path;
  /// The query parameters (name, value) in the framework's order (idem::http::request_view:
  /// sorted by name); covered by the default fingerprint like `path`.
  std::vector<std::pair<std::string_view, std::string_view>> query;
  /// The authenticated principal or tenant; "" for anonymous callers (who share one namespace).
  std::string_view principal;
  /// Every header field line, in order (names in any case).
  std::vector<std::pair<std::string_view, std::string_view>> headers;
  /// The body bytes.
  std::string_view body;
};

/// What the replay hook (EndpointOptions::on_replay) knows of the stored record.
struct ReplayInfo {
  /// The scoped key the response is stored under.
  const Key& key;
  /// When the first request created the record (epoch when the store does not report it).
  TimePoint first_seen;
  /// When the record expires (epoch when the store does not report it).
  TimePoint expires_at;
  /// Which store answered (kFastStore or kDurableStore).
  Source source;
};

/// The fingerprint material of a request as Endpoint computes it by default: the method, the
/// route, the concrete path and query when the request has them, the values of the headers
/// named in `headers` (in that order; absent and empty differ) and `body`, each
/// length-prefixed. A fingerprint hook can call it with a transformed body. (A request without
/// path and query has the material of earlier versions.)
inline std::string fingerprint_material(const RequestView& request,
                                        const std::vector<std::string>& headers,
                                        std::string_view body) {
  std::string material = "idem.http.fp.v1";
  detail::append_length_prefixed(material, request.method);
  detail::append_length_prefixed(material, request.route);
  if (!request.path.empty() || !request.query.empty()) {
    material += "|target";
    detail::append_length_prefixed(material, request.path);
    for (const auto& [name, value] : request.query) {
      detail::append_length_prefixed(material, name);
      detail::append_length_prefixed(material, value);
    }
  }
  for (const auto& name : headers) {
    material += '|';
    for (const auto& [n, v] : request.headers) {
      if (iequals(n, name)) detail::append_length_prefixed(material, v);
    }
  }
  material += '|';
  detail::append_length_prefixed(material, body);
  return material;
}

/// Whether a handler response of `status` is stored and replayed when EndpointOptions::
/// store_response is empty: below 500, except 408 Request Timeout, 425 Too Early and 429 Too
/// Many Requests, which tell the client to try again later (a stored 429 would answer every
/// retry of the key with it for the whole retention).
constexpr bool default_stored(int status) noexcept {
  return status >= 100 && status < 500 && status != 408 && status != 425 && status != 429;
}

/// Options of an Endpoint.
struct EndpointOptions {
  /// The idem::Key scope of this endpoint, e.g. "http.orders.create" (1..64 of
  /// [A-Za-z0-9._:-]). Required.
  std::string scope;
  /// true: a request without Idempotency-Key gets 400 missing_key. false: it runs the handler
  /// directly (no record, no store I/O; a pass-through with reason no_key).
  bool key_required = true;
  /// Which spellings of the key are accepted. Default: only the Structured-Field string
  /// (`"abc"`, the IETF draft); KeySyntax::kAllowBareToken also takes `abc` (Stripe-style).
  KeySyntax key_syntax = KeySyntax::kStructuredField;
  /// Methods whose requests are guarded, compared exactly (methods are case-sensitive). A
  /// request with another method runs the handler directly: no record, no store I/O (a
  /// pass-through with reason method).
  std::vector<std::string> guarded_methods = {"POST", "PATCH"};
  /// Largest accepted body in bytes: a larger one is answered 413 payload_too_large before the
  /// key is parsed and before any store is touched. 0: no limit. With cpp-httplib also set
  /// Server::set_payload_max_length so such a body is not even read (httplib.hpp).
  std::size_t max_body_bytes = 1024 * 1024;
  /// What the fingerprint covers: returns the material that is hashed (see
  /// fingerprint_material(); json_fingerprint() in idem/http/json.hpp compares JSON bodies by
  /// meaning). Empty: fingerprint_material(request, fingerprint_headers, request.body).
  std::function<std::string(const RequestView&)> fingerprint;
  /// Builds every error answer (400, 409, 413, 422, 5xx) from the code and the public detail.
  /// Empty: problem+json (idem::http::problem). A retryable code gets `Retry-After` afterwards
  /// unless the formatter set one.
  std::function<Response(errc, std::string_view detail)> error_formatter;
  /// Called with each replayed response (after `Idempotent-Replayed: true` was added) and the
  /// record's metadata; it may add or change headers. Empty: none.
  std::function<void(const ReplayInfo&, Response&)> on_replay;
  /// Response headers stored with the response and replayed (case-insensitive names). Others
  /// (Set-Cookie, Date, ...) reach the first caller only.
  std::vector<std::string> replay_headers = {"Content-Type", "Content-Encoding",
                                             "Content-Language", "Location"};
  /// Request headers covered by the fingerprint besides method, route and body (e.g.
  /// "Content-Type"). Empty: none.
  std::vector<std::string> fingerprint_headers;
  /// The Retry-After value (seconds) of 409 in_progress and retryable 503 answers.
  std::chrono::seconds retry_after{1};
  /// Which handler responses are stored and replayed, by status. Empty: `default_stored`
  /// (below 500, except 408, 425 and 429, which say "try again later"). A status outside
  /// 100..599 is never stored.
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
  /// A duplicate that finds its key in progress waits up to this long for the first request's
  /// result and replays it, instead of answering 409 in_progress at once (GuardOptions::
  /// wait_for_result, for this endpoint). 0 (default): the guard's own setting.
  std::chrono::milliseconds wait_for_result{0};
  /// The longest wait a client may ask for with `Prefer: wait=<seconds>` (RFC 7240). 0
  /// (default): the header is ignored. The wait is the client's, capped by this.
  std::chrono::milliseconds max_prefer_wait{0};
};

namespace detail {
// Thrown through the guard to keep a response out of the store (rolled back, released). The
// guard counts it as a handler error; its text says why in the "idem handler error" line.
struct DoNotStore : std::runtime_error {
  explicit DoNotStore(int status, const char* why = "is not stored")
      : std::runtime_error("idem::http: the handler's response (status " +
                           std::to_string(status) + ") " + why +
                           ": sent to this caller only, a retry runs the handler again") {}
};
}  // namespace detail

/// Idempotency-Key handling for one route (see the file comment). Thread-safe; cheap to call.
/// @tparam Durable the guard's durable store type.
template <class Durable>
class Endpoint {
 public:
  /// @param guard   the guard (must outlive the endpoint)
  /// @param options the endpoint's options
  /// @throws idem::InvalidKey when options.scope breaks a scope rule; idem::UsageError when
  ///         retry_after, wait_for_result or max_prefer_wait is negative.
  Endpoint(IdempotencyGuard<Durable>& guard, EndpointOptions options)
      : guard_(guard), options_(std::move(options)) {
    Key::validate_scope(options_.scope);
    if (options_.retry_after.count() < 0 || options_.wait_for_result.count() < 0 ||
        options_.max_prefer_wait.count() < 0) {
      throw UsageError(
          "idem::http::Endpoint: retry_after, wait_for_result and max_prefer_wait must not be "
          "negative");
    }
  }

  /// Handles one request (see the file comment for every answer).
  /// @param request the request
  /// @param handler `Response(Transaction&)` or `Response()`
  /// @return the response to send
  /// @throws whatever the handler throws (after the claim was released); idem::UsageError when a
  ///         transactional handler must pass through and the durable store has no plain
  ///         transaction
  template <class Fn>
  Response handle(const RequestView& request, Fn&& handler) {
    if (options_.max_body_bytes != 0 && request.body.size() > options_.max_body_bytes) {
      return reject(RejectReason::kPayloadTooLarge, errc::kPayloadTooLarge,
                    "the request body has " + std::to_string(request.body.size()) +
                        " bytes; this endpoint accepts at most " +
                        std::to_string(options_.max_body_bytes));
    }
    if (!guards(request.method)) return pass_through(PassthroughReason::kMethod, handler);

    ParsedKey parsed = parse_idempotency_key(key_fields(request), options_.key_syntax);
    std::string client_key;
    switch (parsed.status) {
      case ParsedKey::Status::kOk:
        client_key = std::move(parsed.value);
        break;
      case ParsedKey::Status::kMissing:
        if (!options_.key_required) return pass_through(PassthroughReason::kNoKey, handler);
        return reject(RejectReason::kMissingKey, errc::kMissingKey,
                      "this endpoint requires an Idempotency-Key header, e.g. "
                      "Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\"");
      case ParsedKey::Status::kMalformed:
      case ParsedKey::Status::kMultiple:
        return reject(RejectReason::kInvalidKey, errc::kInvalidKey, parsed.detail);
    }

    Key key =
        scoped_key(options_.scope, request.principal, request.method, request.route, client_key);
    CallOptions call = call_options(request);
    std::string fp = request_fingerprint(request);
    std::optional<Response> first;  // the handler's full response, for this caller
    auto admit = [&] {              // EndpointOptions::admit_key: a refusal is sent, never stored
      if (!options_.admit_key) return;
      if (auto refusal = options_.admit_key(request, client_key)) {
        first = std::move(*refusal);
        throw detail::DoNotStore{first->status, "refuses the key (admit_key)"};
      }
    };
    auto keep = [&](Response r) -> Response {
      // A status outside 100..599 is sent to this caller but never stored: its record could
      // not be replayed.
      bool store = r.status >= 100 && r.status <= 599 &&
                   (options_.store_response ? options_.store_response(r.status)
                                            : default_stored(r.status));
      first = std::move(r);
      if (!store) throw detail::DoNotStore{first->status};
      return stored_part(*first);
    };

    try {
      using Tx = ::idem::detail::transaction_t<Durable>;
      if constexpr (::idem::detail::kTakesTransaction<std::decay_t<Fn>, Tx>) {
        return answer(key,
                      guard_.run(key, fp, call,
                                 [&](Tx& tx) {
                                   admit();
                                   return keep(::idem::detail::call_handler(
                                       [&]() -> decltype(auto) { return handler(tx); }));
                                 }),
                      first);
      } else {
        return answer(key,
                      guard_.run(key, fp, call,
                                 [&] {
                                   admit();
                                   return keep(::idem::detail::call_handler(handler));
                                 }),
                      first);
      }
    } catch (const detail::DoNotStore&) {
      return std::move(*first);
    } catch (const ::idem::detail::HandlerError& h) {
      std::rethrow_exception(h.error);  // the handler's own error, unchanged
    } catch (const Error& e) {
      // The exception's text (backend messages, internal key names, tuning advice) goes to the
      // observer (on_store_error, from the guard); the client gets the code's public message.
      return error_response(e.code(), errc_message(e.code()));
    }
  }

  /// The fingerprint of a request: SHA-256 of EndpointOptions::fingerprint(request) when set,
  /// else of fingerprint_material(request, fingerprint_headers, body).
  std::string request_fingerprint(const RequestView& request) const {
    if (options_.fingerprint) {
      std::string material = "idem.http.fp.hook.v1|";
      material += options_.fingerprint(request);
      return fingerprint(material);
    }
    return fingerprint(fingerprint_material(request, options_.fingerprint_headers, request.body));
  }

  /// A problem+json response for `code` (with Retry-After when the code is retryable).
  Response problem(errc code, std::string_view detail) const {
    Response r = idem::http::problem(code, detail, options_.problem_type_prefix);
    if (is_retryable(code))
      r.set_header("Retry-After", std::to_string(options_.retry_after.count()));
    return r;
  }

  /// The error answer for `code`: EndpointOptions::error_formatter's response (problem+json
  /// when it is empty), plus Retry-After for a retryable code unless the formatter set it.
  Response error_response(errc code, std::string_view detail) const {
    if (!options_.error_formatter) return problem(code, detail);
    Response r = options_.error_formatter(code, detail);
    if (is_retryable(code) && r.header("Retry-After") == nullptr) {
      r.set_header("Retry-After", std::to_string(options_.retry_after.count()));
    }
    return r;
  }

  /// True when requests with `method` are guarded (EndpointOptions::guarded_methods).
  bool guards(std::string_view method) const noexcept {
    for (const auto& m : options_.guarded_methods) {
      if (m == method) return true;
    }
    return false;
  }

  /// The options in force.
  const EndpointOptions& options() const noexcept { return options_; }
  /// The guard's observer (null when none).
  const std::shared_ptr<Observer>& observer() const noexcept { return guard_.options().observer; }

 private:
  // The wait of this request: `Prefer: wait=N` (capped by max_prefer_wait) when allowed, else
  // the endpoint's wait_for_result; nothing set: the guard's own.
  CallOptions call_options(const RequestView& request) const {
    CallOptions c;
    if (options_.wait_for_result.count() > 0) c.wait_for_result = options_.wait_for_result;
    if (options_.max_prefer_wait.count() > 0) {
      for (const auto& [name, value] : request.headers) {
        if (!iequals(name, "Prefer")) continue;
        if (auto seconds = prefer_wait_seconds(value)) {
          c.wait_for_result = std::min<std::chrono::milliseconds>(
              std::chrono::seconds{*seconds}, options_.max_prefer_wait);
        }
      }
    }
    return c;
  }

  // `wait=<delta-seconds>` among the comma-separated preferences of one Prefer field value
  // (RFC 7240 section 4.3; the name is case-insensitive, the value a token or a quoted string:
  // `wait=5` and `wait="5"`); nullopt when absent or malformed.
  static std::optional<long> prefer_wait_seconds(std::string_view field) {
    std::optional<long> found;
    while (!field.empty()) {
      const std::size_t comma = field.find(',');
      std::string_view pref = field.substr(0, comma);
      field = comma == std::string_view::npos ? std::string_view{} : field.substr(comma + 1);
      pref = pref.substr(0, pref.find(';'));  // parameters of a preference are not used
      auto trim = [](std::string_view v) {
        while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
        while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
        return v;
      };
      const std::size_t eq = pref.find('=');
      if (eq == std::string_view::npos || !iequals(trim(pref.substr(0, eq)), "wait")) continue;
      std::string_view digits = trim(pref.substr(eq + 1));
      if (digits.size() >= 2 && digits.front() == '"' && digits.back() == '"') {
        digits = digits.substr(1, digits.size() - 2);
      }
      if (digits.empty() || digits.size() > 9) continue;
      long v = 0;
      bool ok = true;
      for (char ch : digits) {
        if (ch < '0' || ch > '9') ok = false;
        v = v * 10 + (ch - '0');
      }
      if (ok) found = v;
    }
    return found;
  }

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

  Response answer(const Key& key, GuardResult<Response> r, std::optional<Response>& first) const {
    switch (r.outcome) {
      case Outcome::kExecuted:
        return std::move(*first);
      case Outcome::kReplayed: {
        Response replay = std::move(*r.value);
        replay.headers.push_back(Header{std::string(kReplayedHeader), "true"});
        if (options_.on_replay) {
          options_.on_replay(ReplayInfo{key, r.first_seen, r.expires_at, r.source}, replay);
        }
        return replay;
      }
      case Outcome::kInProgress:
        return error_response(errc::kInProgress,
                              "a request with this Idempotency-Key is still being processed; "
                              "retry after " +
                                  std::to_string(options_.retry_after.count()) + " s");
      case Outcome::kFingerprintMismatch:
        return reject(RejectReason::kFingerprintMismatch, errc::kFingerprintMismatch,
                      "this Idempotency-Key was already used with a different request payload");
    }
    return error_response(errc::kStorageError, "unknown outcome");
  }

  // A client error, told to the observer.
  Response reject(RejectReason reason, errc code, std::string_view detail) const {
    Response r = error_response(code, detail);
    if (auto* o = guard_.options().observer.get()) {
      o->on_rejected_request(RejectedRequestEvent{options_.scope, reason, r.status});
    }
    return r;
  }

  // The handler without idempotency: no key, no record, no idempotency store I/O. A
  // transactional handler gets a plain transaction of the durable store.
  template <class Fn>
  Response pass_through(PassthroughReason reason, Fn& handler) {
    if (auto* o = guard_.options().observer.get()) {
      o->on_passthrough(PassthroughEvent{options_.scope, reason});
    }
    using Tx = ::idem::detail::transaction_t<Durable>;
    if constexpr (::idem::detail::kTakesTransaction<std::decay_t<Fn>, Tx>) {
      bool handler_threw = false;
      auto body = [&](Tx& tx) -> Response {
        try {
          return handler(tx);
        } catch (...) {
          handler_threw = true;
          throw;
        }
      };
      if constexpr (!::idem::detail::kHasPlainTransaction<Durable, decltype(body)>) {
        throw UsageError("idem::http::Endpoint: the durable store '" +
                         std::string(guard_.durable_store()->name()) +
                         "' offers no plain transaction, so this transactional handler cannot "
                         "pass through; guard every method and require the key");
      } else {
        try {
          return ::idem::detail::run_plain_transaction(*guard_.durable_store(), body);
        } catch (const Error& e) {
          if (handler_threw) return handler_store_failure(e, guard_.durable_store()->name());
          report_passthrough_store_error(e, guard_.durable_store()->name());
          return error_response(e.code(), errc_message(e.code()));
        }
      }
    } else {
      try {
        return handler();
      } catch (const Error& e) {
        return handler_store_failure(e, "handler");
      }
    }
  }

  // In a catch block of the handler's idem error `e`: its storage failure answered as on the
  // guarded path (a StorageError also reported, keyless, as a failure of `store`), anything
  // else rethrown unchanged.
  Response handler_store_failure(const Error& e, std::string_view store) const {
    if (!::idem::detail::is_store_failure(e)) throw;
    if (dynamic_cast<const StorageError*>(&e) != nullptr) report_passthrough_store_error(e, store);
    return error_response(e.code(), errc_message(e.code()));
  }

  // A pass-through's storage failure told to the observer (no key: the request had none), so
  // its 503 leaves a log line and a metric behind like a guarded one.
  void report_passthrough_store_error(const Error& e, std::string_view store) const {
    if (auto* o = guard_.options().observer.get()) {
      o->on_store_error(StoreErrorEvent{nullptr, StoreRole::kDurable, store, e});
    }
  }

  IdempotencyGuard<Durable>& guard_;
  EndpointOptions options_;
};

/// `Endpoint endpoint{guard, options}` deduces the durable store type.
template <class Durable>
Endpoint(IdempotencyGuard<Durable>&, EndpointOptions) -> Endpoint<Durable>;

}  // namespace idem::http
