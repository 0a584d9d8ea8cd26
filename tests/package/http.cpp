// SPDX-License-Identifier: MIT
// Consumer of idem::http: a cpp-httplib request seen through the endpoint layer.
#include <idem/http/httplib.hpp>

#include "consumer.hpp"

int main() {
  check_version();
  httplib::Request req;
  req.method = "POST";
  req.body = "{}";
  req.headers.emplace("Idempotency-Key", "\"abc\"");
  idem::http::RequestView view = idem::http::request_view(req, "/orders", "tenant");
  CONSUMER_CHECK(view.method == "POST" && view.route == "/orders" && view.body == "{}");
  httplib::Response out;
  idem::http::Response r;
  r.status = 201;
  r.body = "ok";
  idem::http::write_response(r, out);
  CONSUMER_CHECK(out.status == 201 && out.body == "ok");
  std::printf("http: cpp-httplib adapter works\n");
  return 0;
}
