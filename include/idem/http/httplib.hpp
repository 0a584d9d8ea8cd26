// SPDX-License-Identifier: MIT
// The cpp-httplib adapter of idem::http::Endpoint (target idem::http).
//
// @code
//   idem::http::Endpoint create{guard, options};
//   server.Post("/orders", idem::http::httplib_handler(create, "/orders", principal_of,
//       [&](const httplib::Request& req, idem::sqlite::Transaction& tx) {
//         return idem::http::Response{201, {{"Content-Type", "application/json"}}, ...};
//       }));
//   // Requests cpp-httplib refuses itself (a header line over its 8 KiB limit, e.g. an
//   // over-long Idempotency-Key; a body over set_payload_max_length) get problem+json too:
//   server.set_payload_max_length(create.options().max_body_bytes);
//   server.set_error_handler(idem::http::problem_error_handler(create));
// @endcode
#pragma once

#include <httplib.h>

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/http/endpoint.hpp"

namespace idem::http {

namespace detail {

// The pairs cpp-httplib reads out of an application/x-www-form-urlencoded body into
// Request::params beside the query's (its parse_query_text): '&'-separated, blanks around each
// piece trimmed, empty pieces skipped, the name before the first '=' and the value after the
// last, '+' a blank and %XX a byte. A pair decoded otherwise than cpp-httplib does is simply
// not recognised, and stays in the fingerprint (a 422 where a replay was possible, never the
// reverse).
inline std::vector<std::pair<std::string, std::string>> form_pairs(std::string_view body) {
  const auto decode = [](std::string_view s) {
    std::string out;
    for (std::size_t i = 0; i < s.size(); ++i) {
      const auto hex = [](char c) {
        return c >= '0' && c <= '9'   ? c - '0'
               : c >= 'a' && c <= 'f' ? c - 'a' + 10
               : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                      : -1;
      };
      if (s[i] == '+') {
        out.push_back(' ');
      } else if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
        out.push_back(static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2])));
        i += 2;
      } else {
        out.push_back(s[i]);
      }
    }
    return out;
  };
  const auto pieces = [](std::string_view s, char sep) {
    std::vector<std::string_view> out;
    for (std::size_t at = 0; at <= s.size();) {
      std::size_t end = s.find(sep, at);
      if (end == std::string_view::npos) end = s.size();
      std::string_view p = s.substr(at, end - at);
      while (!p.empty() && (p.front() == ' ' || p.front() == '\t')) p.remove_prefix(1);
      while (!p.empty() && (p.back() == ' ' || p.back() == '\t')) p.remove_suffix(1);
      if (!p.empty()) out.push_back(p);
      at = end + 1;
    }
    return out;
  };
  std::vector<std::pair<std::string, std::string>> out;
  for (std::string_view pair : pieces(body, '&')) {
    const auto parts = pieces(pair, '=');
    if (parts.empty()) continue;
    out.emplace_back(decode(parts.front()), parts.size() > 1 ? decode(parts.back()) : "");
  }
  return out;
}

}  // namespace detail

/// A RequestView of a cpp-httplib request (views into `req`, which must outlive it).
/// RequestView::query holds the query's parameters only: cpp-httplib also puts the fields of an
/// application/x-www-form-urlencoded body into Request::params, which the fingerprint then
/// covered twice (and a fingerprint_material hook could not leave a field of the body out).
/// @param req       the request
/// @param route     the route pattern ("/orders")
/// @param principal the authenticated principal or tenant ("" for anonymous)
inline RequestView request_view(const httplib::Request& req, std::string_view route,
                                std::string_view principal) {
  RequestView view;
  view.method = req.method;
  view.route = route;
  view.principal = principal;
  view.path = req.path;
  view.query.reserve(req.params.size());
  std::vector<std::pair<std::string, std::string>> body_fields;
  if (req.get_header_value("Content-Type").rfind("application/x-www-form-urlencoded", 0) == 0) {
    body_fields = detail::form_pairs(req.body);
  }
  std::vector<char> matched(body_fields.size(), 0);
  for (const auto& [name, value] : req.params) {
    bool from_body = false;
    for (std::size_t i = 0; i < body_fields.size() && !from_body; ++i) {
      if (matched[i] == 0 && body_fields[i].first == name && body_fields[i].second == value) {
        matched[i] = 1;
        from_body = true;
      }
    }
    if (!from_body) view.query.emplace_back(name, value);
  }
  view.body = req.body;
  view.headers.reserve(req.headers.size());
  for (const auto& [name, value] : req.headers) view.headers.emplace_back(name, value);
  return view;
}

/// Copies `r` into a cpp-httplib response (status, headers in order, body). Content-Length is
/// left to cpp-httplib.
inline void write_response(const Response& r, httplib::Response& out) {
  out.status = r.status;
  for (const auto& h : r.headers) {
    if (iequals(h.name, "Content-Length")) continue;
    out.set_header(h.name, h.value);
  }
  out.body = r.body;
}

/// Options of problem_error_handler().
struct ServerErrorOptions {
  /// Prefix of the problem `type` (as EndpointOptions::problem_type_prefix).
  std::string problem_type_prefix = "urn:idem:error:";
  /// Builds the answer from the code and the public detail (as
  /// EndpointOptions::error_formatter). Empty: problem+json.
  std::function<Response(errc, std::string_view detail)> error_formatter;
  /// Told of each request turned into a problem (on_rejected_request, empty scope). Null: none.
  std::shared_ptr<Observer> observer;
};

/// A cpp-httplib error handler (Server::set_error_handler) that answers the requests
/// cpp-httplib refuses before any handler runs with idem's error vocabulary instead of a bare
/// status:
///
///   * 400 with no body, a request line read (`req.path` set) and no Idempotency-Key among the
///     headers read: cpp-httplib stopped at a header line over its limit
///     (CPPHTTPLIB_HEADER_MAX_LENGTH, 8192 bytes; typically an over-long key) or a malformed
///     one: 400 invalid_key. A request line that could not be read keeps cpp-httplib's bare
///     400 and is not reported: after refusing a header section, cpp-httplib keeps the
///     connection open and reads the rest of that request's bytes (the lines after the long
///     one, its body) as further "requests", and one over-long key must count once;
///   * 413 with no body (Content-Length over Server::set_payload_max_length): 413
///     payload_too_large.
///
/// Every other response (handlers' own 4xx/5xx, empty-bodied ones too, 404 of unknown routes)
/// is left unchanged: cpp-httplib calls the error handler for every status >= 400, and a
/// request that reached a route carries its match (`req.matches`), one refused before routing
/// none.
inline httplib::Server::HandlerWithResponse problem_error_handler(ServerErrorOptions options = {}) {
  return [options = std::move(options)](const httplib::Request& req, httplib::Response& res) {
    using Handled = httplib::Server::HandlerResponse;
    if (!res.body.empty() || !req.matches.empty()) return Handled::Unhandled;
    errc code = errc::kInvalidKey;
    RejectReason reason = RejectReason::kInvalidKey;
    std::string detail;
    if (res.status == 400 && !req.path.empty() &&
        !req.has_header(std::string(kIdempotencyKeyHeader).c_str())) {
      code = errc::kInvalidKey;
      reason = RejectReason::kInvalidKey;
      detail = "the request's header section could not be read: a header line is longer than " +
               std::to_string(CPPHTTPLIB_HEADER_MAX_LENGTH) +
               " bytes or malformed (an Idempotency-Key has at most " +
               std::to_string(kMaxClientKeyLength) + " bytes)";
    } else if (res.status == 413) {
      code = errc::kPayloadTooLarge;
      reason = RejectReason::kPayloadTooLarge;
      detail = "the request body is larger than this server accepts";
    } else {
      return Handled::Unhandled;
    }
    Response r = options.error_formatter ? options.error_formatter(code, detail)
                                         : problem(code, detail, options.problem_type_prefix);
    write_response(r, res);
    if (options.observer) {
      options.observer->on_rejected_request(RejectedRequestEvent{{}, reason, res.status});
    }
    return Handled::Handled;
  };
}

/// problem_error_handler() answering as `endpoint` does (its problem type prefix, its error
/// formatter, its guard's observer).
template <class Durable>
httplib::Server::HandlerWithResponse problem_error_handler(const Endpoint<Durable>& endpoint) {
  ServerErrorOptions o;
  o.problem_type_prefix = endpoint.options().problem_type_prefix;
  o.error_formatter = endpoint.options().error_formatter;
  o.observer = endpoint.observer();
  return problem_error_handler(std::move(o));
}

/// A cpp-httplib handler running `fn` through `endpoint`.
/// @param endpoint  the Endpoint (must outlive the server)
/// @param route     the route pattern, part of the key's scope
/// @param principal `std::string(const httplib::Request&)`: the authenticated principal
/// @param fn        `Response(const httplib::Request&, Transaction&)` (transactional) or
///                  `Response(const httplib::Request&)` (two-phase / fast-only)
template <class Durable, class PrincipalFn, class Fn>
httplib::Server::Handler httplib_handler(Endpoint<Durable>& endpoint, std::string route,
                                         PrincipalFn principal, Fn fn) {
  return [&endpoint, route = std::move(route), principal = std::move(principal),
          fn = std::move(fn)](const httplib::Request& req, httplib::Response& res) {
    std::string who = principal(req);
    RequestView view = request_view(req, route, who);
    using Tx = ::idem::detail::transaction_t<Durable>;
    Response r;
    if constexpr (std::is_invocable_v<const Fn&, const httplib::Request&, Tx&>) {
      r = endpoint.handle(view, [&](Tx& tx) { return fn(req, tx); });
    } else {
      r = endpoint.handle(view, [&] { return fn(req); });
    }
    write_response(r, res);
  };
}

}  // namespace idem::http
