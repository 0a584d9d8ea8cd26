// SPDX-License-Identifier: MIT
// idem::http over cpp-httplib against the same handler without idempotency, in one process,
// one keep-alive client, interleaved A/B rounds, medians.
//
//   replay:  the same Idempotency-Key every request (answered by the fast store) vs a plain
//            handler returning a constant body
//   first:   a fresh key every request (claim + SQLite transaction with the record + the
//            business insert + complete) vs a plain SQLite transaction with the business insert
//
// Prints requests/s per round and `ratio <name> = <ours / baseline>` (higher is better).
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <string>
#include <thread>
#include <vector>

#include "idem/http/httplib.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = argc > 1 ? std::atoi(argv[1]) : 11;
  int requests = argc > 2 ? std::atoi(argv[2]) : 1000;
  std::string path = "/tmp/idem_http_bench_" + std::to_string(::getpid()) + ".sqlite";

  idem::sqlite::SqliteStore durable{path};
  durable.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, body TEXT NOT NULL)");
  });
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, durable};
  idem::http::EndpointOptions options;
  options.scope = "bench.orders";
  idem::http::Endpoint endpoint{guard, options};
  const std::string reply = R"({"order_no":"ORD-000001","sku":"A1","qty":2,"status":"WAIT_PAY"})";

  httplib::Server server;
  server.Post("/plain", [&](const httplib::Request&, httplib::Response& res) {
    res.status = 201;
    res.set_content(reply, "application/json");
  });
  server.Post("/plain_insert", [&](const httplib::Request& req, httplib::Response& res) {
    durable.database().write([&](idem::sqlite::Transaction& tx) {
      tx.exec("INSERT INTO orders (body) VALUES (?)", req.body);
    });
    res.status = 201;
    res.set_content(reply, "application/json");
  });
  auto guarded = idem::http::httplib_handler(
      endpoint, "/orders", [](const httplib::Request&) { return std::string("bench"); },
      [&](const httplib::Request& req, idem::sqlite::Transaction& tx) {
        tx.exec("INSERT INTO orders (body) VALUES (?)", req.body);
        return idem::http::Response{201, {{"Content-Type", "application/json"}}, reply};
      });
  server.Post("/guarded", guarded);
  server.set_tcp_nodelay(true);
  server.set_keep_alive_max_count(1'000'000);
  int port = server.bind_to_any_port("127.0.0.1");
  std::thread thread([&] { server.listen_after_bind(); });
  while (!server.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));

  httplib::Client client("127.0.0.1", port);
  client.set_keep_alive(true);
  client.set_tcp_nodelay(true);  // headers and body go in two writes: Nagle would add 40 ms
  const std::string body = R"({"sku":"A1","qty":2})";
  long long next_key = 0;
  auto run = [&](const char* route, int mode) {  // mode 0 none, 1 fixed key, 2 fresh keys
    auto t0 = Clock::now();
    for (int i = 0; i < requests; ++i) {
      httplib::Headers h;
      if (mode == 1) h.emplace("Idempotency-Key", "\"fixed\"");
      if (mode == 2) h.emplace("Idempotency-Key", "\"k" + std::to_string(next_key++) + "\"");
      auto r = client.Post(route, h, body, "application/json");
      if (!r || r->status != 201) {
        std::fprintf(stderr, "request to %s failed\n", route);
        std::exit(1);
      }
    }
    return requests / std::chrono::duration<double>(Clock::now() - t0).count();
  };

  run("/guarded", 1);  // warm up, and complete the fixed key
  run("/plain", 0);
  // ABBA order inside a round cancels a load drift; the ratio is the median of per-round
  // ratios (each round's A and B ran seconds apart, under the same machine load).
  std::vector<double> replay, plain, first, plain_insert, replay_ratio, first_ratio;
  for (int r = 0; r < rounds; ++r) {
    double a1 = run("/guarded", 1), b1 = run("/plain", 0), b2 = run("/plain", 0),
           a2 = run("/guarded", 1);
    double c1 = run("/guarded", 2), d1 = run("/plain_insert", 0), d2 = run("/plain_insert", 0),
           c2 = run("/guarded", 2);
    replay.push_back((a1 + a2) / 2);
    plain.push_back((b1 + b2) / 2);
    first.push_back((c1 + c2) / 2);
    plain_insert.push_back((d1 + d2) / 2);
    replay_ratio.push_back(replay.back() / plain.back());
    first_ratio.push_back(first.back() / plain_insert.back());
    std::printf("round %d: replay %.0f req/s, plain %.0f req/s, first %.0f req/s, "
                "plain insert %.0f req/s\n",
                r + 1, replay.back(), plain.back(), first.back(), plain_insert.back());
  }
  server.stop();
  thread.join();
  std::remove(path.c_str());
  std::remove((path + "-wal").c_str());
  std::remove((path + "-shm").c_str());

  std::printf("median: replay %.0f req/s, plain %.0f req/s, first %.0f req/s, plain insert "
              "%.0f req/s (%d rounds x %d requests, one keep-alive client, SQLite "
              "synchronous=NORMAL)\n",
              median(replay), median(plain), median(first), median(plain_insert), rounds,
              requests);
  std::printf("ratio http_replay_vs_plain_handler = %.3f\n", median(replay_ratio));
  std::printf("ratio http_first_request_vs_plain_insert = %.3f\n", median(first_ratio));
  return 0;
}
