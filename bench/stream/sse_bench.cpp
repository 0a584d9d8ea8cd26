// SPDX-License-Identifier: MIT
// The SSE endpoint of examples/ai_chat with producer de-duplication and the durable chunk table
// (POST /chats behind Idempotency-Key, the generator's pieces through ProducerDedup into SQLite,
// GET /chats/{id}/events served from the table) against the same endpoint shape streaming
// straight from the generator (same pieces, same event format, one write per event, same
// cpp-httplib server options). Events/s as a client reading the stream sees them; interleaved
// rounds, medians. Also printed: the process's CPU time per event on each side (every thread,
// user + system, from getrusage), which the load of other processes moves far less than
// events/s.
//
//   idem_bench_sse [rounds] [answer_bytes]
#include <httplib.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chat_server.hpp"
#include "idem/memory_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// CPU time of the whole process (every thread, user + system), in seconds.
double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::size_t count_events(const std::string& body) {
  std::size_t n = 0;
  for (auto at = body.find("event: chunk"); at != std::string::npos;
       at = body.find("event: chunk", at + 12)) {
    ++n;
  }
  return n;
}

// Reads one event stream to its end. @return the chunk events received (0 on failure).
std::size_t read_stream(httplib::Client& client, const std::string& path) {
  std::string body;
  auto r = client.Get(path.c_str(), [&](const char* data, std::size_t n) {
    body.append(data, n);
    return true;
  });
  if (!r || r->status != 200 || body.find("event: done") == std::string::npos) return 0;
  return count_events(body);
}

// The baseline: the same event stream, straight from the generator.
class PlainServer {
 public:
  explicit PlainServer(std::size_t max_chunk) {
    server_.new_task_queue = [] { return new httplib::ThreadPool(32); };
    server_.set_tcp_nodelay(true);
    server_.Get(R"(/plain/([A-Za-z0-9_]+)/events)", [max_chunk](const httplib::Request& req,
                                                                httplib::Response& res) {
      std::string id = req.matches[1].str();
      std::size_t length = std::stoul(req.get_param_value("length"));
      res.set_header("Cache-Control", "no-store");
      res.set_chunked_content_provider(
          "text/event-stream", [id, length, max_chunk](std::size_t, httplib::DataSink& sink) {
            const std::string text = ai_chat::answer(id, length);
            ai_chat::GeneratorOptions g;
            g.max_chunk = max_chunk;
            g.seed = ai_chat::stable_hash(id);
            ai_chat::Generator gen{text, g};
            std::string out;
            while (auto piece = gen.next()) {
              out.clear();
              ai_chat::append_chunk_event(out, id, piece->offset, piece->bytes);
              if (!sink.write(out.data(), out.size())) return false;
            }
            out.clear();
            ai_chat::append_done_event(out, text.size());
            if (!sink.write(out.data(), out.size())) return false;
            sink.done();
            return true;
          });
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  ~PlainServer() {
    server_.stop();
    thread_.join();
  }
  int port() const { return port_; }

 private:
  httplib::Server server_;
  std::thread thread_;
  int port_ = -1;
};

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  const std::size_t length = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 65536;
  const int chats_per_round = 3;

  auto dir =
      std::filesystem::temp_directory_path() / ("idem-bench-sse-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  int status = 0;
  {
    auto db = std::make_shared<idem::sqlite::Database>((dir / "chat.sqlite").string());
    idem::MemoryStore fast;
    idem::sqlite::SqliteStore durable{db};
    ai_chat::SqliteChats chats{db};
    idem::IdempotencyGuard<idem::sqlite::SqliteStore> guard{fast, durable};
    ai_chat::ServerOptions options;
    options.token_delay = std::chrono::microseconds(0);  // the model is as fast as it gets
    options.max_length = length;
    ai_chat::ChatServer<idem::sqlite::SqliteStore, ai_chat::SqliteChats> ours{guard, chats,
                                                                              options};
    ours.start();
    PlainServer plain{options.max_chunk};

    httplib::Client ours_client("127.0.0.1", ours.port());
    httplib::Client plain_client("127.0.0.1", plain.port());
    ours_client.set_read_timeout(60, 0);
    plain_client.set_read_timeout(60, 0);
    std::vector<double> ours_rate, plain_rate, ours_cpu, plain_cpu;  // events/s, us per event
    std::size_t ours_events = 0, plain_events = 0;
    int n = 0;
    for (int round = 0; round < rounds + 1; ++round) {  // round 0 warms up, not counted
      auto t0 = Clock::now();
      double c0 = cpu_seconds();
      std::size_t events = 0;
      for (int i = 0; i < chats_per_round; ++i, ++n) {
        std::string body =
            nlohmann::json{{"prompt", "bench " + std::to_string(n)}, {"length", length}}.dump();
        auto r =
            ours_client.Post("/chats", {{"Idempotency-Key", "\"bench-" + std::to_string(n) + "\""}},
                             body, "application/json");
        if (!r || r->status != 201) {
          std::fprintf(stderr, "POST /chats failed\n");
          return 1;
        }
        std::string id = nlohmann::json::parse(r->body)["request_id"].get<std::string>();
        std::size_t got = read_stream(ours_client, "/chats/" + id + "/events");
        if (got == 0) {
          std::fprintf(stderr, "stream of %s failed\n", id.c_str());
          return 1;
        }
        events += got;
      }
      double ours_s = std::chrono::duration<double>(Clock::now() - t0).count();
      double ours_c = cpu_seconds() - c0;

      t0 = Clock::now();
      c0 = cpu_seconds();
      std::size_t plain_got = 0;
      for (int i = 0; i < chats_per_round; ++i) {
        std::size_t got = read_stream(plain_client, "/plain/bench_" + std::to_string(n + i) +
                                                        "/events?length=" + std::to_string(length));
        if (got == 0) {
          std::fprintf(stderr, "plain stream failed\n");
          return 1;
        }
        plain_got += got;
      }
      double plain_s = std::chrono::duration<double>(Clock::now() - t0).count();
      double plain_c = cpu_seconds() - c0;
      if (round == 0) continue;
      ours_cpu.push_back(1e6 * ours_c / static_cast<double>(events));
      plain_cpu.push_back(1e6 * plain_c / static_cast<double>(plain_got));
      ours_rate.push_back(static_cast<double>(events) / ours_s);
      plain_rate.push_back(static_cast<double>(plain_got) / plain_s);
      ours_events += events;
      plain_events += plain_got;
    }
    std::printf(
        "workload: %d interleaved rounds of %d chats, %zu-byte answers in 1..%zu-byte "
        "chunks (%zu and %zu events), one CPU, SQLite WAL synchronous=NORMAL\n",
        rounds, chats_per_round, length, options.max_chunk, ours_events, plain_events);
    std::printf("sse with ProducerDedup + chunk table (POST included): %.0f events/s (median)\n",
                median(ours_rate));
    std::printf("sse straight from the generator:                      %.0f events/s (median)\n",
                median(plain_rate));
    std::printf(
        "process CPU per event (all threads, user + system): %.2f us with the chunk table, "
        "%.2f us straight (medians)\n",
        median(ours_cpu), median(plain_cpu));
    std::printf("ratio sse_stream_dedup_vs_plain = %.2f\n", median(ours_rate) / median(plain_rate));
    ours.stop();
  }
  std::filesystem::remove_all(dir);
  return status;
}
