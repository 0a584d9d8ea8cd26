// SPDX-License-Identifier: MIT
// A complete idempotent consumer loop on Redis Streams consumer groups. Copy it.
//
//   XREADGROUP a batch -> consumer.consume(...) per message (or, with --consume-batch,
//   consumer.consume_batch(...) for the whole batch: one pipelined fast-store claim, one
//   SQLite transaction, one pipelined complete) -> XACK the batch (except retry_later);
//   XAUTOCLAIM entries idle longer than --claim-idle-ms (a consumer died, or a message failed
//   and waits for its next attempt); poison messages go to a dead-letter stream, mismatched
//   ones to a parking stream.
//
// Messages carry a `message_id` field (the producer's global id: a producer retry publishes a
// new entry with the same id) and a `body`. Without `message_id`, the id is built from the
// `biz_no`, `event` and `version` fields with idem::make_message_id. The business effect here
// is one row in an `effect` table, written in the same SQLite transaction as the consume record.
//
//   idem_example_mq_consumer --redis redis://127.0.0.1:6379 --db billing.db --consumer c1
//   idem_example_mq_consumer --publish 100 ...     (publish sample messages and exit)
//
// Options: --stream --group --consumer --db --batch --block-ms --claim-idle-ms --claim-every-ms
// (0: never claim) --max-attempts --dead-letter-stream --park-stream --delay-ms (slow consumer)
// [--delay-inside] [--consume-batch] --hang-inside-after N (fault drills: after N applied
// messages, print `hanging inside the transaction of <id>` on stderr and stop inside the next
// handler, its claim and transaction open, until killed) --fast-store redis|memory --lease-ms
// --log FILE (one line per delivery, written before processing) --exit-when-drained
// --metrics-port N (serve Prometheus /metrics on 127.0.0.1:N; 0 picks a free port, printed on
// stderr). The last line printed is a summary: `summary consumer=c1 deliveries=...
// redeliveries=...` (plus `metric_redeliveries=...`, the idem_mq_redeliveries_total counter,
// in a build with idem::prometheus).
//
// Metrics (idem::prometheus): the guard reports to a PrometheusObserver; the consumer tells it
// every delivery whose broker delivery count is above 1 (an entry taken over with XAUTOCLAIM,
// or one left pending after retry_later), so idem_mq_redeliveries_total equals
// ConsumerStats::redeliveries.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/consumer.hpp"
#include "idem/memory_store.hpp"
#include "idem/mq/redis_streams.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/attempt_ledger.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#ifdef MQ_CONSUMER_WITH_PROMETHEUS
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "idem/prometheus/prometheus_observer.hpp"
#endif
#ifdef MQ_CONSUMER_WITH_HTTP
#include <httplib.h>
#endif

namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

struct Config {
  std::string redis = "redis://127.0.0.1:6379";
  std::string stream = "orders";
  std::string group = "billing";
  std::string consumer = "consumer-1";
  std::string db = "mq_consumer.db";
  std::size_t batch = 32;
  long block_ms = 200;
  long claim_idle_ms = 5000;
  long claim_every_ms = 1000;
  unsigned max_attempts = 3;
  std::string dead_letter_stream;  // default: <stream>.dead
  std::string park_stream;         // default: <stream>.parked
  long delay_ms = 0;
  std::string log;
  bool exit_when_drained = false;
  long publish = 0;
  std::string fast_store = "redis";  // redis | memory
  long lease_ms = 30000;
  bool delay_inside = false;  // sleep inside the handler's transaction (kill tests)
  long hang_inside_after = -1;  // >= 0: stop inside the handler after that many (kill tests)
  bool consume_batch = false;  // consume_batch() per XREADGROUP batch instead of consume()
  long metrics_port = -1;     // -1: no /metrics endpoint
};

constexpr const char* kUsage =
    "usage: idem_example_mq_consumer [--redis URL] [--stream S] [--group G] [--consumer C]\n"
    "         [--db PATH] [--batch N] [--block-ms N] [--claim-idle-ms N] [--claim-every-ms N]\n"
    "         [--max-attempts N] [--dead-letter-stream S] [--park-stream S] [--delay-ms N]\n"
    "         [--delay-inside] [--consume-batch] [--hang-inside-after N]\n"
    "         [--fast-store redis|memory] [--lease-ms N] [--log FILE] [--exit-when-drained]\n"
    "         [--metrics-port N]\n"
    "       idem_example_mq_consumer --publish N [--redis URL] [--stream S]\n"
    "         (publishes N sample messages and exits)\n";

Config parse(int argc, char** argv) {
  Config c;
  std::map<std::string, std::string*> text{
      {"--redis", &c.redis},       {"--stream", &c.stream},
      {"--group", &c.group},       {"--consumer", &c.consumer},
      {"--db", &c.db},             {"--dead-letter-stream", &c.dead_letter_stream},
      {"--park-stream", &c.park_stream}, {"--log", &c.log},
      {"--fast-store", &c.fast_store}};
  std::map<std::string, long*> numbers{{"--block-ms", &c.block_ms},
                                       {"--claim-idle-ms", &c.claim_idle_ms},
                                       {"--claim-every-ms", &c.claim_every_ms},
                                       {"--delay-ms", &c.delay_ms},
                                       {"--publish", &c.publish},
                                       {"--lease-ms", &c.lease_ms},
                                       {"--hang-inside-after", &c.hang_inside_after},
                                       {"--metrics-port", &c.metrics_port}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (a == "--exit-when-drained") {
      c.exit_when_drained = true;
      continue;
    }
    if (a == "--delay-inside") {
      c.delay_inside = true;
      continue;
    }
    if (a == "--consume-batch") {
      c.consume_batch = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument("missing value after " + a);
    std::string v = argv[++i];
    if (auto t = text.find(a); t != text.end()) {
      *t->second = v;
    } else if (auto n = numbers.find(a); n != numbers.end()) {
      *n->second = std::stol(v);
    } else if (a == "--batch") {
      c.batch = std::stoul(v);
    } else if (a == "--max-attempts") {
      c.max_attempts = static_cast<unsigned>(std::stoul(v));
    } else {
      throw std::invalid_argument("unknown option " + a + " (--help lists the options)");
    }
  }
  if (c.dead_letter_stream.empty()) c.dead_letter_stream = c.stream + ".dead";
  if (c.park_stream.empty()) c.park_stream = c.stream + ".parked";
  if (c.fast_store != "redis" && c.fast_store != "memory") {
    throw std::invalid_argument("--fast-store must be redis or memory");
  }
  return c;
}

// The message id: the producer's global id, or one built from business number, event, version.
std::string message_id_of(const idem::mq::StreamEntry& e) {
  if (const auto* id = e.find("message_id")) return *id;
  const auto* biz = e.find("biz_no");
  const auto* event = e.find("event");
  const auto* version = e.find("version");
  if (biz && event && version) {
    try {
      return idem::make_message_id(*biz, *event, std::stoull(*version));
    } catch (const std::exception&) {
    }
  }
  return {};  // no usable id: the consumer dead-letters it
}

// Appends lines with one write(2) so a kill -9 never leaves half a batch logged.
class DeliveryLog {
 public:
  explicit DeliveryLog(const std::string& path) {
    if (!path.empty()) fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  }
  ~DeliveryLog() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const std::string& lines) {
    if (fd_ < 0 || lines.empty()) return;
    if (::write(fd_, lines.data(), lines.size()) < 0) std::perror("delivery log");
  }

 private:
  int fd_ = -1;
};

int publish(const Config& c) {
  idem::mq::RedisStreams redis{{c.redis}};
  std::vector<idem::mq::Fields> entries;
  for (long i = 0; i < c.publish; ++i) {
    entries.push_back({{"message_id", "order_" + std::to_string(i) + ":paid:v1"},
                       {"body", "{\"order\":" + std::to_string(i) + ",\"amount\":100}"}});
  }
  redis.add_many(c.stream, entries);
  std::printf("published %ld messages to %s\n", c.publish, c.stream.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  Config cfg = parse(argc, argv);
  if (cfg.publish > 0) return publish(cfg);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);

  // --- broker, stores, guard, consumer --------------------------------------------------------
  idem::mq::RedisStreams redis{{cfg.redis}};
  redis.create_group(cfg.stream, cfg.group);  // false when it exists: fine

  // Fast store: Redis, shared by every consumer of the group (an in-flight duplicate in another
  // process answers retry_later at once), or a per-process MemoryStore. Either way the SQLite
  // consume record decides in the end.
  std::unique_ptr<idem::FastStore> fast;
  if (cfg.fast_store == "redis") {
    fast = std::make_unique<idem::redis::RedisStore>(idem::redis::RedisStoreOptions{cfg.redis});
  } else {
    fast = std::make_unique<idem::MemoryStore>();
  }
  idem::sqlite::SqliteStore durable{cfg.db, idem::sqlite::SqliteStoreOptions::mq_consume_record()};
  durable.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE IF NOT EXISTS effect (message_id TEXT NOT NULL, consumer TEXT NOT "
            "NULL, body TEXT NOT NULL)");
  });
  idem::GuardOptions guard_options;
  guard_options.durable_source = idem::DuplicateSource::kMqRecord;
#ifdef MQ_CONSUMER_WITH_PROMETHEUS
  prometheus::Registry registry;
  auto metrics = std::make_shared<idem::PrometheusObserver>(registry);
  guard_options.observer = metrics;
#endif
#ifdef MQ_CONSUMER_WITH_HTTP
  httplib::Server metrics_server;
  std::thread metrics_thread;
  if (cfg.metrics_port >= 0) {
    metrics_server.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
      res.set_content(prometheus::TextSerializer().Serialize(registry.Collect()),
                      "text/plain; version=0.0.4");
    });
    int port = cfg.metrics_port == 0
                   ? metrics_server.bind_to_any_port("127.0.0.1")
                   : (metrics_server.bind_to_port("127.0.0.1", static_cast<int>(cfg.metrics_port))
                          ? static_cast<int>(cfg.metrics_port)
                          : -1);
    if (port <= 0) throw std::runtime_error("cannot bind metrics port " +
                                            std::to_string(cfg.metrics_port));
    std::fprintf(stderr, "%s: metrics on http://127.0.0.1:%d/metrics\n", cfg.consumer.c_str(),
                 port);
    metrics_thread = std::thread([&] { metrics_server.listen_after_bind(); });
  }
  struct StopMetrics {
    httplib::Server& server;
    std::thread& thread;
    ~StopMetrics() {
      server.stop();
      if (thread.joinable()) thread.join();
    }
  } stop_metrics{metrics_server, metrics_thread};
#else
  if (cfg.metrics_port >= 0) {
    throw std::invalid_argument("--metrics-port needs a build with idem::prometheus and idem::http");
  }
#endif
  // A consumer killed mid-message leaves its fast claim until the lease ends: longer than the
  // slowest handler, shorter than you want a crashed message to wait.
  guard_options.lease = std::chrono::milliseconds(cfg.lease_ms);
  idem::IdempotencyGuard guard{*fast, durable, guard_options};

  idem::ConsumerOptions consumer_options;
  consumer_options.max_attempts = cfg.max_attempts;
  consumer_options.attempts =
      std::make_shared<idem::sqlite::SqliteAttemptLedger>(durable.shared_database());
  consumer_options.dead_letter = [&](const idem::DeadLetter& d) {
    redis.add(cfg.dead_letter_stream, {{"message_id", d.message_id},
                                       {"body", d.payload},
                                       {"error", d.error},
                                       {"attempts", std::to_string(d.attempts)},
                                       {"group", d.group}});
  };
  idem::IdempotentConsumer consumer{guard, cfg.group, consumer_options};

  DeliveryLog log{cfg.log};
  std::uint64_t claimed = 0;
  long applied = 0;  // handler calls that got past the poison check (--hang-inside-after)

  // --- one batch: consume each entry, ack what may be acked in one XACK ------------------------
  auto process = [&](const std::vector<idem::mq::StreamEntry>& batch) {
    std::string lines;
    for (const auto& e : batch) {
      lines += e.id + ' ' + std::to_string(e.delivery_count) + ' ' + message_id_of(e) + '\n';
    }
    log.write(lines);
    auto delay = [&] {
      if (cfg.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(cfg.delay_ms));
    };
    // The business effect, in the transaction of the consume record.
    auto apply = [&](idem::sqlite::Transaction& tx, const std::string& id,
                     const std::string& body) {
      if (body.rfind("poison", 0) == 0) throw std::runtime_error("cannot apply: " + body);
      if (cfg.delay_inside) delay();  // slow business work, inside the transaction
      if (cfg.hang_inside_after >= 0 && applied++ == cfg.hang_inside_after) {
        // A fault drill: the process stops here, claim held and transaction open, until a
        // kill (or a stop signal) ends it.
        std::fprintf(stderr, "hanging inside the transaction of %s\n", id.c_str());
        std::fflush(stderr);
        while (g_stop == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      tx.exec("INSERT INTO effect (message_id, consumer, body) VALUES (?, ?, ?)", id, cfg.consumer,
              body);
    };
    std::vector<std::string> ids, bodies, fps;
    for (const auto& e : batch) {
      ids.push_back(message_id_of(e));
      const std::string* body_field = e.find("body");
      bodies.push_back(body_field ? *body_field : std::string());
      fps.push_back(idem::fingerprint(bodies.back()));
    }
    std::vector<idem::Verdict> verdicts;
    if (cfg.consume_batch) {
      std::vector<idem::Delivery> deliveries;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        if (!cfg.delay_inside) delay();
        deliveries.push_back(idem::Delivery{ids[i], fps[i], bodies[i], batch[i].delivery_count});
      }
      verdicts = consumer.consume_batch(
          deliveries,
          [&](idem::sqlite::Transaction& tx, std::size_t i) { apply(tx, ids[i], bodies[i]); });
    } else {
      for (std::size_t i = 0; i < batch.size(); ++i) {
        if (!cfg.delay_inside) delay();
        verdicts.push_back(
            consumer.consume(idem::Delivery{ids[i], fps[i], bodies[i], batch[i].delivery_count},
                             [&](idem::sqlite::Transaction& tx) { apply(tx, ids[i], bodies[i]); }));
      }
    }
    std::vector<std::string> acks;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      switch (verdicts[i]) {
        case idem::Verdict::kAck:
        case idem::Verdict::kAckDuplicate:
        case idem::Verdict::kDeadLetter:
          acks.push_back(batch[i].id);
          break;
        case idem::Verdict::kMismatch:  // a producer bug: park it for a human, then ack
          redis.add(cfg.park_stream,
                    {{"message_id", ids[i]}, {"body", bodies[i]}, {"entry", batch[i].id}});
          acks.push_back(batch[i].id);
          break;
        case idem::Verdict::kRetryLater:  // stays pending; XAUTOCLAIM brings it back
          break;
      }
    }
    redis.ack(cfg.stream, cfg.group, acks);
  };

  // --- the loop ---------------------------------------------------------------------------------
  using Clock = std::chrono::steady_clock;
  auto next_claim = Clock::now();
  std::string claim_cursor = "0-0";
  while (g_stop == 0) {
    try {
      bool claimed_any = false;
      if (cfg.claim_every_ms > 0 && Clock::now() >= next_claim) {
        auto c = redis.auto_claim(cfg.stream, cfg.group, cfg.consumer,
                                  std::chrono::milliseconds(cfg.claim_idle_ms), claim_cursor,
                                  cfg.batch);
        claim_cursor = c.next_start;
        claimed += c.entries.size();
        claimed_any = !c.entries.empty();
        process(c.entries);
        // Scan on at once while the pending list has more; else wait for the next period.
        if (claim_cursor == "0-0") {
          next_claim = Clock::now() + std::chrono::milliseconds(cfg.claim_every_ms);
        }
      }
      auto batch = redis.read_group(cfg.stream, cfg.group, cfg.consumer, cfg.batch,
                                    std::chrono::milliseconds(cfg.block_ms));
      process(batch);
      if (cfg.exit_when_drained && batch.empty() && !claimed_any &&
          redis.pending(cfg.stream, cfg.group).count == 0) {
        break;
      }
    } catch (const idem::StorageError& e) {
      // Redis or SQLite hiccup: nothing was acked that did not commit; back off and go on.
      std::fprintf(stderr, "%s: %s (retrying)\n", cfg.consumer.c_str(), e.what());
      // A Redis that came back without its data (no persistence, a failover to an empty
      // replica) has no group: made again, from the start of what the stream holds now. The
      // consume records in SQLite keep every message that already ran from running again.
      if (std::string(e.what()).find("NOGROUP") != std::string::npos) {
        try {
          if (redis.create_group(cfg.stream, cfg.group, "0")) {
            std::fprintf(stderr, "%s: group %s made again\n", cfg.consumer.c_str(),
                         cfg.group.c_str());
          }
        } catch (const idem::StorageError&) {  // still down: the next round tries again
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  auto s = consumer.stats().snapshot();
  std::printf(
      "summary consumer=%s deliveries=%llu acked=%llu duplicates=%llu retry_later=%llu "
      "mismatched=%llu dead_lettered=%llu failures=%llu redeliveries=%llu claimed=%llu\n",
      cfg.consumer.c_str(), static_cast<unsigned long long>(s.deliveries),
      static_cast<unsigned long long>(s.acked), static_cast<unsigned long long>(s.duplicates),
      static_cast<unsigned long long>(s.retry_later),
      static_cast<unsigned long long>(s.mismatched),
      static_cast<unsigned long long>(s.dead_lettered),
      static_cast<unsigned long long>(s.failures),
      static_cast<unsigned long long>(s.redeliveries), static_cast<unsigned long long>(claimed));
#ifdef MQ_CONSUMER_WITH_PROMETHEUS
  double metric_redeliveries = 0;
  for (const auto& family : registry.Collect()) {
    if (family.name != "idem_mq_redeliveries_total") continue;
    for (const auto& m : family.metric) metric_redeliveries += m.counter.value;
  }
  std::printf("summary-metrics consumer=%s metric_redeliveries=%llu\n", cfg.consumer.c_str(),
              static_cast<unsigned long long>(metric_redeliveries));
#endif
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "mq_consumer: %s\n", e.what());
  return 1;
}
