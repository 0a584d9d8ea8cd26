// SPDX-License-Identifier: MIT
// A complete idempotent consumer loop on a RabbitMQ queue. Copy it.
//
//   receive a batch (basic.consume, manual acks, prefetch --prefetch) -> consumer.consume(...)
//   per message (or, with --consume-batch, consumer.consume_batch(...) for the batch: one
//   SQLite transaction) -> ack what may be acked (one multiple ack when it can); retry_later:
//   nack with requeue after --retry-delay-ms; mismatch: publish to <queue>.parked, then ack;
//   poison: after --max-attempts failures the dead-letter sink publishes it to <queue>.dlx
//   (bound to <queue>.dead), then ack.
//
// Messages carry a message-id property (the producer's global id: a producer retry publishes a
// new message with the same id) or, without one, `biz_no`, `event` and `version` headers
// (idem::make_message_id). The business effect is one row in an `effect` table, written in
// the same SQLite transaction as the consume record.
//
//   idem_example_rabbitmq_consumer --amqp amqp://guest:guest@127.0.0.1:5672 --db billing.db
//   idem_example_rabbitmq_consumer --publish 100 ...   (publish sample messages and exit)
//
// Options: --queue --group --consumer (a name for logs) --db --prefetch --batch (most messages
// per batch, default the prefetch) --linger-ms (go on collecting a batch this long after its
// first message) --wait-ms --retry-delay-ms --max-attempts --heartbeat-s --quorum --delay-ms
// (slow consumer: sleep before each message) [--delay-inside] (sleep inside the handler's
// transaction instead) --hang-inside-after N (fault drills: after N applied messages, print
// `hanging inside the transaction of <id>` on stderr and stop inside the next handler, its
// claim and transaction open, until killed) [--consume-batch] --fast-store memory|redis
// (--redis URL) --lease-ms
// --log FILE (one line per delivery, written before processing) --exit-when-drained (exit once
// the queue is empty and nothing is held) [--drain-after FILE] (only once FILE exists). The
// last line printed is a summary: `summary consumer=c1 deliveries=... redeliveries=...`.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/consumer.hpp"
#include "idem/memory_store.hpp"
#include "idem/rabbitmq/client.hpp"
#include "idem/rabbitmq/consumer_loop.hpp"
#include "idem/sqlite/attempt_ledger.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#ifdef RABBITMQ_CONSUMER_WITH_REDIS
#include "idem/redis/redis_store.hpp"
#endif

namespace {

namespace rmq = idem::rabbitmq;

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

struct Config {
  std::string amqp = "amqp://guest:guest@127.0.0.1:5672";
  std::string queue = "orders";
  std::string group = "billing";
  std::string consumer = "consumer-1";
  std::string db = "rabbitmq_consumer.db";
  long prefetch = 32;
  long batch = 0;  // 0: the prefetch
  long linger_ms = 0;
  long wait_ms = 500;
  long retry_delay_ms = 200;
  long max_attempts = 3;
  long heartbeat_s = 30;
  bool quorum = false;
  long delay_ms = 0;
  bool delay_inside = false;
  long hang_inside_after = -1;  // >= 0: stop inside the handler after that many (kill tests)
  bool consume_batch = false;
  std::string fast_store = "memory";  // memory | redis
  std::string redis = "redis://127.0.0.1:6379";
  long lease_ms = 30000;
  std::string log;
  bool exit_when_drained = false;
  std::string drain_after;
  long publish = 0;
};

constexpr const char* kUsage =
    "usage: idem_example_rabbitmq_consumer [--amqp URL] [--queue Q] [--group G] [--consumer C]\n"
    "         [--db PATH] [--prefetch N] [--batch N] [--linger-ms N] [--wait-ms N]\n"
    "         [--retry-delay-ms N] [--max-attempts N] [--heartbeat-s N] [--quorum]\n"
    "         [--delay-ms N] [--delay-inside] [--hang-inside-after N] [--consume-batch]\n"
    "         [--fast-store memory|redis] [--redis URL] [--lease-ms N] [--log FILE]\n"
    "         [--exit-when-drained] [--drain-after FILE]\n"
    "       idem_example_rabbitmq_consumer --publish N [--amqp URL] [--queue Q]\n"
    "         (publishes N sample messages and exits)\n";

Config parse(int argc, char** argv) {
  Config c;
  std::map<std::string, std::string*> text{{"--amqp", &c.amqp},
                                           {"--queue", &c.queue},
                                           {"--group", &c.group},
                                           {"--consumer", &c.consumer},
                                           {"--db", &c.db},
                                           {"--log", &c.log},
                                           {"--fast-store", &c.fast_store},
                                           {"--redis", &c.redis},
                                           {"--drain-after", &c.drain_after}};
  std::map<std::string, long*> numbers{{"--prefetch", &c.prefetch},
                                       {"--batch", &c.batch},
                                       {"--linger-ms", &c.linger_ms},
                                       {"--wait-ms", &c.wait_ms},
                                       {"--retry-delay-ms", &c.retry_delay_ms},
                                       {"--max-attempts", &c.max_attempts},
                                       {"--heartbeat-s", &c.heartbeat_s},
                                       {"--delay-ms", &c.delay_ms},
                                       {"--lease-ms", &c.lease_ms},
                                       {"--hang-inside-after", &c.hang_inside_after},
                                       {"--publish", &c.publish}};
  std::map<std::string, bool*> flags{{"--quorum", &c.quorum},
                                     {"--delay-inside", &c.delay_inside},
                                     {"--consume-batch", &c.consume_batch},
                                     {"--exit-when-drained", &c.exit_when_drained}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (auto f = flags.find(a); f != flags.end()) {
      *f->second = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument("missing value after " + a);
    std::string v = argv[++i];
    if (auto t = text.find(a); t != text.end()) {
      *t->second = v;
    } else if (auto n = numbers.find(a); n != numbers.end()) {
      *n->second = std::stol(v);
    } else {
      throw std::invalid_argument("unknown option " + a + " (--help lists the options)");
    }
  }
  if (c.prefetch <= 0 || c.prefetch > 65535) throw std::invalid_argument("--prefetch: 1..65535");
  if (c.batch <= 0) c.batch = c.prefetch;
  if (c.max_attempts <= 0) throw std::invalid_argument("--max-attempts must be positive");
  if (c.fast_store != "memory" && c.fast_store != "redis") {
    throw std::invalid_argument("--fast-store must be memory or redis");
  }
  return c;
}

rmq::ConnectionOptions connection(const Config& c, const std::string& role) {
  rmq::ConnectionOptions o;
  o.url = c.amqp;
  o.heartbeat = std::chrono::seconds(c.heartbeat_s);
  o.name = c.consumer + " " + role;
  o.reconnect_backoff = std::chrono::milliseconds(100);
  o.reconnect_backoff_max = std::chrono::milliseconds(1000);
  return o;
}

rmq::QueueOptions queue_of(const Config& c) {
  rmq::QueueOptions q;
  q.name = c.queue;
  q.type = c.quorum ? rmq::QueueType::kQuorum : rmq::QueueType::kClassic;
  q.dead_letter_exchange = c.queue + ".dlx";  // the broker's own dead letters land there too
  return q;
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
  rmq::PublisherOptions po;
  po.connection = connection(c, "publisher");
  rmq::Publisher publisher{po};
  rmq::declare_dead_letters(publisher, c.queue);
  publisher.declare_queue(queue_of(c));
  std::vector<rmq::OutgoingMessage> batch;
  for (long i = 0; i < c.publish; ++i) {
    rmq::OutgoingMessage m;
    m.routing_key = c.queue;
    m.message_id = "order_" + std::to_string(i) + ":paid:v1";
    m.body = "{\"order\":" + std::to_string(i) + ",\"amount\":100}";
    m.content_type = "application/json";
    batch.push_back(std::move(m));
    if (batch.size() == 500 || i + 1 == c.publish) {
      publisher.publish(batch);  // confirmed; what was not is published again (same ids)
      batch.clear();
    }
  }
  std::printf("published %ld messages to %s\n", c.publish, c.queue.c_str());
  return 0;
}

bool file_exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

}  // namespace

int main(int argc, char** argv) try {
  Config cfg = parse(argc, argv);
  if (cfg.publish > 0) return publish(cfg);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);

  // --- broker: a publisher (dead letters, parking) and the queue's consumer -------------------
  rmq::PublisherOptions po;
  po.connection = connection(cfg, "publisher");
  rmq::Publisher publisher{po};
  rmq::QueueConsumerOptions qo;
  qo.connection = connection(cfg, "consumer");
  qo.queue = queue_of(cfg);
  qo.prefetch = static_cast<std::uint16_t>(cfg.prefetch);
  rmq::QueueConsumer broker{qo};
  // Declared once; they are durable, so a broker restart keeps them.
  rmq::Destination dead, parked;
  for (;;) {
    try {
      dead = rmq::declare_dead_letters(publisher, cfg.queue);
      parked = rmq::declare_parking(publisher, cfg.queue);
      break;
    } catch (const idem::StorageError& e) {
      if (!e.retryable() || g_stop != 0) throw;
      std::fprintf(stderr, "%s: %s (retrying)\n", cfg.consumer.c_str(), e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  // --- stores, guard, consumer ---------------------------------------------------------------
  // Fast store: a per-process MemoryStore, or Redis shared by every consumer of the group (an
  // in-flight duplicate in another process then answers retry_later at once). Either way the
  // SQLite consume record decides in the end.
  std::unique_ptr<idem::FastStore> fast;
  if (cfg.fast_store == "redis") {
#ifdef RABBITMQ_CONSUMER_WITH_REDIS
    fast = std::make_unique<idem::redis::RedisStore>(idem::redis::RedisStoreOptions{cfg.redis});
#else
    throw std::invalid_argument("--fast-store redis needs a build with idem::redis");
#endif
  } else {
    fast = std::make_unique<idem::MemoryStore>();
  }
  idem::sqlite::SqliteStore durable{cfg.db, idem::sqlite::SqliteStoreOptions::mq_consume_record()};
  durable.database().write([](idem::sqlite::Transaction& tx) {
    tx.exec(
        "CREATE TABLE IF NOT EXISTS effect (message_id TEXT NOT NULL, consumer TEXT NOT "
        "NULL, body TEXT NOT NULL)");
  });
  idem::GuardOptions guard_options;
  guard_options.durable_source = idem::DuplicateSource::kMqRecord;
  // A consumer killed mid-message leaves its fast claim until the lease ends: longer than the
  // slowest handler, shorter than you want a crashed message to wait.
  guard_options.lease = std::chrono::milliseconds(cfg.lease_ms);
  idem::IdempotencyGuard guard{*fast, durable, guard_options};

  idem::ConsumerOptions consumer_options;
  consumer_options.max_attempts = static_cast<std::uint32_t>(cfg.max_attempts);
  consumer_options.attempts =
      std::make_shared<idem::sqlite::SqliteAttemptLedger>(durable.shared_database());
  consumer_options.dead_letter = rmq::dead_letter_sink(publisher, dead);  // confirmed publish
  idem::IdempotentConsumer consumer{guard, cfg.group, consumer_options};

  rmq::ConsumerLoopOptions lo;
  lo.ids.build = rmq::business_id_from_headers();  // no message-id: biz_no, event, version
  lo.max_batch = static_cast<std::size_t>(cfg.batch);
  lo.wait = std::chrono::milliseconds(cfg.wait_ms);
  lo.linger = std::chrono::milliseconds(cfg.linger_ms);
  lo.retry_delay = std::chrono::milliseconds(cfg.retry_delay_ms);
  lo.park = parked;
  rmq::ConsumerLoop loop{broker, consumer, lo, &publisher};

  DeliveryLog log{cfg.log};
  auto delay = [&] {
    if (cfg.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(cfg.delay_ms));
  };
  long applied = 0;  // handler calls that got past the poison check (--hang-inside-after)
  // The business effect, in the transaction of the consume record.
  auto apply = [&](idem::sqlite::Transaction& tx, const rmq::Message& m) {
    if (m.body.rfind("poison", 0) == 0) throw std::runtime_error("cannot apply: " + m.body);
    if (cfg.delay_inside) delay();  // slow business work, inside the transaction
    if (cfg.hang_inside_after >= 0 && applied++ == cfg.hang_inside_after) {
      // A fault drill: the process stops here, claim held and transaction open, until a kill
      // (or a stop signal) ends it.
      std::fprintf(stderr, "hanging inside the transaction of %s\n",
                   rmq::message_id_of(m, lo.ids).c_str());
      std::fflush(stderr);
      while (g_stop == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    tx.exec("INSERT INTO effect (message_id, consumer, body) VALUES (?, ?, ?)",
            rmq::message_id_of(m, lo.ids), cfg.consumer, m.body);
  };

  // --- the loop ---------------------------------------------------------------------------------
  int idle = 0;
  while (g_stop == 0) {
    try {
      auto batch = loop.receive();
      // One line per delivery before processing: connection:tag redelivered count id seq.
      std::string lines;
      for (const auto& m : batch) {
        const std::string* seq = m.header("x-seq");
        lines += std::to_string(m.connection) + ':' + std::to_string(m.delivery_tag) + ' ' +
                 (m.redelivered ? '1' : '0') + ' ' + std::to_string(rmq::delivery_count_of(m)) +
                 ' ' + rmq::message_id_of(m, lo.ids) + ' ' + (seq ? *seq : "-") + '\n';
      }
      log.write(lines);
      if (!batch.empty()) {
        if (!cfg.delay_inside) {
          for (std::size_t i = 0; i < batch.size(); ++i) delay();  // slow pre-processing
        }
        if (cfg.consume_batch) {
          loop.process_batch(batch, apply);
        } else {
          loop.process_each(batch, apply);
        }
        idle = 0;
        continue;
      }
      // Drained: nothing came, nothing is held or unacked, and the queue has nothing ready
      // (twice in a row).
      if (cfg.exit_when_drained && (cfg.drain_after.empty() || file_exists(cfg.drain_after)) &&
          loop.held() == 0 && broker.unsettled() == 0 &&
          publisher.queue_info(cfg.queue).messages == 0 && ++idle >= 2) {
        break;
      }
    } catch (const idem::StorageError& e) {
      // Broker or SQLite hiccup: nothing was acked that did not commit. The loop holds the
      // deliveries left without a verdict and requeues them on a later poll; after a broker
      // failure the client reconnects on the next call (after its backoff).
      std::fprintf(stderr, "%s: %s (retrying)\n", cfg.consumer.c_str(), e.what());
      idle = 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  auto s = consumer.stats().snapshot();
  const auto& ls = loop.stats();
  auto bs = broker.stats();
  std::printf(
      "summary consumer=%s deliveries=%llu acked=%llu duplicates=%llu retry_later=%llu "
      "mismatched=%llu dead_lettered=%llu failures=%llu redeliveries=%llu requeued=%llu "
      "parked=%llu stale=%llu connection_losses=%llu connects=%llu\n",
      cfg.consumer.c_str(), static_cast<unsigned long long>(s.deliveries),
      static_cast<unsigned long long>(s.acked), static_cast<unsigned long long>(s.duplicates),
      static_cast<unsigned long long>(s.retry_later), static_cast<unsigned long long>(s.mismatched),
      static_cast<unsigned long long>(s.dead_lettered), static_cast<unsigned long long>(s.failures),
      static_cast<unsigned long long>(s.redeliveries), static_cast<unsigned long long>(ls.requeued),
      static_cast<unsigned long long>(ls.parked), static_cast<unsigned long long>(ls.stale),
      static_cast<unsigned long long>(bs.connection.connection_losses),
      static_cast<unsigned long long>(bs.connection.connects));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "rabbitmq_consumer: %s\n", e.what());
  return 1;
}
