// SPDX-License-Identifier: MIT
// RabbitMQ consumer loops into PostgreSQL: idem's loop (QueueConsumer + ConsumerLoop +
// IdempotentConsumer over PostgresStore) against a hand-written rabbitmq-c + libpqxx loop doing
// the seed recipe (the consume record row, with a unique key, in the effect's transaction, then
// the ack), on the same broker, queue layout and prefetch; and the plain loop without
// de-duplication for reference. Each loop drains a queue of --messages persistent messages
// published beforehand (not timed); rounds interleaved (the order reversed every other
// round); per-round ratios, medians.
//
//   per batch (one transaction per received batch: the headline pair)
//     plain             effect rows, one multiple ack
//     handwritten       one multi-row record INSERT ... ON CONFLICT DO NOTHING RETURNING, the
//                       effects of the new ones, one multiple ack
//     idem              ConsumerLoop::poll_batch (consume_batch), durable-only guard
//     idem_memory       the same, MemoryStore in front
//   per message (one transaction each)
//     plain_each        effect row, ack
//     handwritten_each  record row (INSERT ... ON CONFLICT DO NOTHING) + effect row, ack
//     idem_each         ConsumerLoop::poll_each (consume), durable-only guard
//     idem_each_memory  the same, MemoryStore in front
//
// The durable-only guard is the like-for-like pair of the hand-written loop (the same
// database, no other store); the MemoryStore lines show what a fast store in front costs.
#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <pqxx/pqxx>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/side_by_side.hpp"
#include "idem/consumer.hpp"
#include "idem/memory_store.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "idem/rabbitmq/client.hpp"
#include "idem/rabbitmq/consumer_loop.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace rmq = idem::rabbitmq;

struct Args {
  std::string amqp = "amqp://guest:guest@127.0.0.1:5672";
  std::string postgres;
  int messages = 2000;
  int rounds = 7;
  int prefetch = 32;
  std::string only;
};

// The hand-written side: rabbitmq-c as its README shows it (basic.qos, basic.consume,
// amqp_consume_message, amqp_basic_ack), failing loudly.
class RawConsumer {
 public:
  RawConsumer(const std::string& url, const std::string& queue, int prefetch) {
    std::string buf = url;
    amqp_connection_info info{};
    amqp_default_connection_info(&info);
    if (amqp_parse_url(buf.data(), &info) != AMQP_STATUS_OK) die("bad url");
    conn_ = amqp_new_connection();
    amqp_socket_t* s = amqp_tcp_socket_new(conn_);
    if (amqp_socket_open(s, info.host, info.port) != AMQP_STATUS_OK) die("connect");
    check(amqp_login(conn_, info.vhost, 0, AMQP_DEFAULT_FRAME_SIZE, 30, AMQP_SASL_METHOD_PLAIN,
                     info.user, info.password),
          "login");
    amqp_channel_open(conn_, 1);
    check(amqp_get_rpc_reply(conn_), "channel.open");
    amqp_basic_qos(conn_, 1, 0, static_cast<uint16_t>(prefetch), 0);
    check(amqp_get_rpc_reply(conn_), "basic.qos");
    amqp_basic_consume(conn_, 1, amqp_cstring_bytes(queue.c_str()), amqp_empty_bytes, 0, 0, 0,
                       amqp_empty_table);
    check(amqp_get_rpc_reply(conn_), "basic.consume");
  }
  ~RawConsumer() {
    amqp_channel_close(conn_, 1, AMQP_REPLY_SUCCESS);
    amqp_connection_close(conn_, AMQP_REPLY_SUCCESS);
    amqp_destroy_connection(conn_);
  }
  RawConsumer(const RawConsumer&) = delete;
  RawConsumer& operator=(const RawConsumer&) = delete;

  // One delivery within `timeout_ms` (0: only one already there). false on timeout.
  bool next(amqp_envelope_t& env, long timeout_ms) {
    amqp_maybe_release_buffers(conn_);
    timeval tv{timeout_ms / 1000, static_cast<suseconds_t>((timeout_ms % 1000) * 1000)};
    amqp_rpc_reply_t r = amqp_consume_message(conn_, &env, &tv, 0);
    if (r.reply_type == AMQP_RESPONSE_NORMAL) return true;
    if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION && r.library_error == AMQP_STATUS_TIMEOUT) {
      return false;
    }
    die("consume");
  }
  void ack(std::uint64_t tag, bool multiple) {
    if (amqp_basic_ack(conn_, 1, tag, multiple ? 1 : 0) != AMQP_STATUS_OK) die("ack");
  }

 private:
  [[noreturn]] static void die(const char* what) {
    std::fprintf(stderr, "raw consumer: %s failed\n", what);
    std::exit(1);
  }
  static void check(const amqp_rpc_reply_t& r, const char* what) {
    if (r.reply_type != AMQP_RESPONSE_NORMAL) die(what);
  }
  amqp_connection_state_t conn_;
};

std::string str(amqp_bytes_t b) { return std::string(static_cast<const char*>(b.bytes), b.len); }

// Publishes `n` persistent messages (ids "<prefix>:order_<i>") to a fresh queue; not timed.
void fill(rmq::Publisher& p, const std::string& queue, const std::string& prefix, int n) {
  rmq::QueueOptions q;
  q.name = queue;
  p.declare_queue(q);
  p.purge_queue(queue);
  std::vector<rmq::OutgoingMessage> batch;
  for (int i = 0; i < n; ++i) {
    rmq::OutgoingMessage m;
    m.routing_key = queue;
    m.message_id = prefix + ":order_" + std::to_string(i);
    m.body = "{\"order\":" + std::to_string(i) + ",\"amount\":100}";
    batch.push_back(std::move(m));
    if (batch.size() == 500 || i + 1 == n) {
      p.publish(batch);
      batch.clear();
    }
  }
}

}  // namespace

int main(int argc, char** argv) try {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--amqp") a.amqp = argv[i + 1];
    if (k == "--postgres") a.postgres = argv[i + 1];
    if (k == "--messages") a.messages = std::atoi(argv[i + 1]);
    if (k == "--rounds") a.rounds = std::atoi(argv[i + 1]);
    if (k == "--prefetch") a.prefetch = std::atoi(argv[i + 1]);
    if (k == "--only") a.only = argv[i + 1];
  }
  if (a.postgres.empty() || a.messages <= 0 || a.rounds <= 0 || a.prefetch <= 0) {
    std::fprintf(stderr,
                 "usage: idem_bench_rabbitmq --amqp URL --postgres CONNINFO [--messages N]"
                 " [--rounds N] [--prefetch N] [--only a,b]\n");
    return 2;
  }
  auto wanted = [&](const std::string& name) {
    return a.only.empty() || ("," + a.only + ",").find("," + name + ",") != std::string::npos;
  };
  const std::string pid = std::to_string(::getpid());
  rmq::PublisherOptions po;
  po.connection.url = a.amqp;
  rmq::Publisher publisher{po};

  // Tables: the effect (the same on every side, an unprepared INSERT), the hand-written loop's
  // consume record (the recipe's minimal row: the unique key and a timestamp), idem's
  // mq_consume_record (PostgresStore's migration).
  const std::string effect = "rmq_bench_effect_" + pid;
  const std::string record = "rmq_bench_record_" + pid;
  pqxx::connection pg{a.postgres};
  {
    pqxx::nontransaction nt(pg);
    nt.exec("CREATE TABLE " + effect +
            " (id bigserial PRIMARY KEY, message_id text NOT NULL, body text NOT NULL)");
    nt.exec("CREATE TABLE " + record +
            " (message_id text NOT NULL, consumer_group text NOT NULL, consumed_at timestamptz"
            " NOT NULL DEFAULT now(), PRIMARY KEY (message_id, consumer_group))");
  }
  const std::string insert_effect = "INSERT INTO " + effect + " (message_id, body) VALUES ($1, $2)";
  const std::string insert_record = "INSERT INTO " + record +
                                    " (message_id, consumer_group) VALUES ($1, $2) ON CONFLICT DO"
                                    " NOTHING";
  std::string fsync, sync_commit;
  {
    pqxx::nontransaction nt(pg);
    fsync = nt.exec("SHOW fsync")[0][0].as<std::string>();
    sync_commit = nt.exec("SHOW synchronous_commit")[0][0].as<std::string>();
  }
  idem::postgres::PostgresStore store{
      idem::postgres::PostgresStoreOptions::mq_consume_record(a.postgres)};
  idem::GuardOptions go;
  go.durable_source = idem::DuplicateSource::kMqRecord;

  // --- the loops; each returns messages/s over draining its queue ----------------------------
  using Loop = std::function<double(const std::string& queue, const std::string& group)>;
  auto raw_each = [&](bool with_record) -> Loop {
    return [&, with_record](const std::string& queue, const std::string& group) {
      RawConsumer c{a.amqp, queue, a.prefetch};
      const auto t0 = Clock::now();
      for (int done = 0; done < a.messages;) {
        amqp_envelope_t env;
        if (!c.next(env, 5000)) throw std::runtime_error("raw loop: the queue ran dry");
        const std::string id = str(env.message.properties.message_id);
        const std::string body = str(env.message.body);
        {
          pqxx::work tx(pg);
          bool fresh = true;
          if (with_record) fresh = tx.exec_params(insert_record, id, group).affected_rows() == 1;
          if (fresh) tx.exec_params(insert_effect, id, body);
          tx.commit();
        }
        c.ack(env.delivery_tag, false);
        amqp_destroy_envelope(&env);
        ++done;
      }
      return a.messages / std::chrono::duration<double>(Clock::now() - t0).count();
    };
  };
  auto raw_batch = [&](bool with_record) -> Loop {
    return [&, with_record](const std::string& queue, const std::string& group) {
      RawConsumer c{a.amqp, queue, a.prefetch};
      const auto t0 = Clock::now();
      for (int done = 0; done < a.messages;) {
        std::vector<std::pair<std::string, std::string>> batch;  // id, body
        std::uint64_t last_tag = 0;
        amqp_envelope_t env;
        while (static_cast<int>(batch.size()) < a.prefetch &&
               c.next(env, batch.empty() ? 5000 : 0)) {
          batch.emplace_back(str(env.message.properties.message_id), str(env.message.body));
          last_tag = env.delivery_tag;
          amqp_destroy_envelope(&env);
        }
        if (batch.empty()) throw std::runtime_error("raw loop: the queue ran dry");
        {
          pqxx::work tx(pg);
          std::map<std::string, bool> fresh;
          if (with_record) {
            std::string sql = "INSERT INTO " + record + " (message_id, consumer_group) VALUES ";
            for (std::size_t i = 0; i < batch.size(); ++i) {
              sql += (i ? ", (" : "(") + tx.quote(batch[i].first) + ", " + tx.quote(group) + ")";
            }
            sql += " ON CONFLICT DO NOTHING RETURNING message_id";
            for (const auto& row : tx.exec(sql)) fresh[row[0].as<std::string>()] = true;
          }
          for (const auto& [id, body] : batch) {
            if (!with_record || fresh.erase(id) == 1) tx.exec_params(insert_effect, id, body);
          }
          tx.commit();
        }
        c.ack(last_tag, true);
        done += static_cast<int>(batch.size());
      }
      return a.messages / std::chrono::duration<double>(Clock::now() - t0).count();
    };
  };
  auto idem_loop = [&](bool batched, bool memory) -> Loop {
    return [&, batched, memory](const std::string& queue, const std::string& group) {
      idem::MemoryStore fast;
      auto guard = memory ? idem::IdempotencyGuard<idem::postgres::PostgresStore>(fast, store, go)
                          : idem::IdempotencyGuard<idem::postgres::PostgresStore>(store, go);
      idem::IdempotentConsumer consumer{guard, group};
      rmq::QueueConsumerOptions qo;
      qo.connection.url = a.amqp;
      qo.queue.name = queue;
      qo.prefetch = static_cast<std::uint16_t>(a.prefetch);
      rmq::QueueConsumer broker{qo};
      broker.connect();
      rmq::ConsumerLoopOptions lo;
      lo.max_batch = static_cast<std::size_t>(a.prefetch);
      lo.wait = std::chrono::milliseconds(5000);
      rmq::ConsumerLoop loop{broker, consumer, lo};
      auto handler = [&](pqxx::work& tx, const rmq::Message& m) {
        tx.exec_params(insert_effect, m.message_id, m.body);
      };
      const auto t0 = Clock::now();
      for (std::size_t done = 0; done < static_cast<std::size_t>(a.messages);) {
        const std::size_t n = batched ? loop.poll_batch(handler) : loop.poll_each(handler);
        if (n == 0) throw std::runtime_error("idem loop: the queue ran dry");
        done += n;
      }
      const double rate = a.messages / std::chrono::duration<double>(Clock::now() - t0).count();
      auto s = consumer.stats().snapshot();
      if (s.acked != static_cast<std::uint64_t>(a.messages)) {
        throw std::runtime_error("idem loop: " + std::to_string(s.acked) + " acked");
      }
      return rate;
    };
  };
  const std::vector<std::pair<std::string, Loop>> loops{
      {"plain", raw_batch(false)},
      {"handwritten", raw_batch(true)},
      {"idem", idem_loop(true, false)},
      {"idem_memory", idem_loop(true, true)},
      {"plain_each", raw_each(false)},
      {"handwritten_each", raw_each(true)},
      {"idem_each", idem_loop(false, false)},
      {"idem_each_memory", idem_loop(false, true)}};

  std::map<std::string, std::vector<double>> rate;
  for (int round = 0; round < a.rounds; ++round) {
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < loops.size(); ++i) {
      if (wanted(loops[i].first)) order.push_back(i);
    }
    if (round % 2 == 1) std::reverse(order.begin(), order.end());
    for (std::size_t i : order) {
      const auto& [name, run] = loops[i];
      const std::string tag = name + "-" + std::to_string(round) + "-" + pid;
      const std::string queue = "idem-bench-" + tag;
      fill(publisher, queue, tag, a.messages);
      rate[name].push_back(run(queue, "bench-" + tag));
      publisher.delete_queue(queue);
    }
  }
  {
    pqxx::nontransaction nt(pg);
    nt.exec("DROP TABLE " + effect);
    nt.exec("DROP TABLE " + record);
  }

  std::printf(
      "rabbitmq consumer loop into PostgreSQL: %d persistent messages per round, prefetch %d, "
      "%d interleaved rounds, fsync=%s, synchronous_commit=%s\n",
      a.messages, a.prefetch, a.rounds, fsync.c_str(), sync_commit.c_str());
  const std::map<std::string, const char*> labels{
      {"plain", "plain rabbitmq-c loop, batch, no de-duplication:"},
      {"handwritten", "hand-written rabbitmq-c loop, batch, record rows:"},
      {"idem", "idem poll_batch (consume_batch), durable only:"},
      {"idem_memory", "idem poll_batch (consume_batch), MemoryStore:"},
      {"plain_each", "plain rabbitmq-c loop, per message:"},
      {"handwritten_each", "hand-written rabbitmq-c loop, per message:"},
      {"idem_each", "idem poll_each (consume), durable only:"},
      {"idem_each_memory", "idem poll_each (consume), MemoryStore:"}};
  for (const auto& [name, run] : loops) {
    (void)run;
    const auto& v = rate[name];
    if (v.empty()) continue;
    std::printf("%-46s %8.0f msg/s (median)   rounds:", labels.at(name), idem::bench::median(v));
    for (double x : v) std::printf(" %.0f", x);
    std::printf("\n");
  }
  // Per-round ratios (both loops of a pair ran in the same round), their median; the pass
  // without the WAL flush wait at COMMIT is suffixed _async_commit.
  const std::string suffix = sync_commit == "off" ? "_async_commit" : "";
  auto ratio = [&](const char* label, const std::string& ours, const std::string& base) {
    const auto &o = rate[ours], &b = rate[base];
    if (o.empty() || o.size() != b.size()) return;
    std::vector<double> r;
    for (std::size_t i = 0; i < o.size(); ++i) r.push_back(o[i] / b[i]);
    std::printf("ratio %s%s = %.2f\n", label, suffix.c_str(), idem::bench::median(r));
  };
  // The headline pair: idem's loop as docs/mq.md recommends it (one transaction per received
  // batch) against the hand-written loop of the same shape, on the same database alone.
  ratio("rabbitmq_consume_vs_handwritten", "idem", "handwritten");
  ratio("rabbitmq_consume_memory_vs_handwritten", "idem_memory", "handwritten");
  ratio("rabbitmq_consume_each_vs_handwritten_each", "idem_each", "handwritten_each");
  ratio("rabbitmq_consume_each_memory_vs_handwritten_each", "idem_each_memory", "handwritten_each");
  // For reference: what the record costs against no de-duplication at all.
  ratio("rabbitmq_handwritten_vs_plain", "handwritten", "plain");
  ratio("rabbitmq_consume_vs_plain", "idem", "plain");
  ratio("rabbitmq_handwritten_each_vs_plain_each", "handwritten_each", "plain_each");
  ratio("rabbitmq_consume_each_vs_plain_each", "idem_each", "plain_each");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_bench_rabbitmq: %s\n", e.what());
  return 1;
}
