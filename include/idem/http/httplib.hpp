// SPDX-License-Identifier: MIT
// The cpp-httplib adapter of idem::http::Endpoint (target idem::http).
//
// @code
//   idem::http::Endpoint create{guard, options};
//   server.Post("/orders", idem::http::httplib_handler(create, "/orders", principal_of,
//       [&](const httplib::Request& req, idem::sqlite::Transaction& tx) {
//         return idem::http::Response{201, {{"Content-Type", "application/json"}}, ...};
//       }));
// @endcode
#pragma once

#include <httplib.h>

#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "idem/http/endpoint.hpp"

namespace idem::http {

/// A RequestView of a cpp-httplib request (views into `req`, which must outlive it).
/// @param req       the request
/// @param route     the route pattern ("/orders")
/// @param principal the authenticated principal or tenant ("" for anonymous)
inline RequestView request_view(const httplib::Request& req, std::string_view route,
                                std::string_view principal) {
  RequestView view;
  view.method = req.method;
  view.route = route;
  view.principal = principal;
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
