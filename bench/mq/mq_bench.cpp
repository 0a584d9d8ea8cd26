// SPDX-License-Identifier: MIT
// Consumer-loop throughput on Redis Streams: XREADGROUP batch -> handler -> XACK batch. The
// handler writes one effect row. "plain" is the loop without idem; "dedup" runs the handler
// through IdempotentConsumer (fast-store claim, the consume record in the same transaction as
// the effect, fast-store complete). Like with like:
//   * SQLite (embedded): one transaction per message (consume) and one per XREADGROUP batch
//     (consume_batch: one pipelined claim round trip, one transaction, one pipelined complete),
//     with MemoryStore or RedisStore in front;
//   * PostgreSQL (--postgres, the production shape, RedisStore in front): one transaction per
//     message (consume) and one per batch (consume_batch: the batch's records in ONE INSERT).
// The effect table is the same on both sides: (message_id, body) in SQLite, plus a bigserial
// primary key in PostgreSQL. Next to them, the hand-written record recipe of the seed tables
// ("insert the consume record, run the business, mark it consumed", in the effect's
// transaction): a consume record row (message_id, consumer_group) with its primary key and a
// timestamp, inserted with ON CONFLICT DO NOTHING, the effect only when it was new; per message
// (one transaction each) and per read batch (one transaction; PostgreSQL: ONE multi-row record
// INSERT ... RETURNING), sqlite3 / libpqxx called directly; against them idem's consumer with
// the durable store alone (the same database and nothing else), and with a fast store in front.
// Same process, rounds interleaved (plain, dedup, ...), medians;
// `--only a,b` runs some loops. run.sh pins the servers and this driver to one CPU, except for
// its last pass: `--threads N` runs the PostgreSQL batch loops with N consumers of one group
// draining the same stream (throughput; each plain consumer has its own connection, the dedup
// consumers share one IdempotentConsumer and its stores, as the threads of one service do).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../common/latency_proxy.hpp"
#include "../common/raw_sqlite.hpp"
#include "idem/consumer.hpp"
#include "idem/memory_store.hpp"
#include "idem/mq/redis_streams.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#ifdef IDEM_BENCH_WITH_POSTGRES
#include <pqxx/pqxx>

#include "idem/postgres/postgres_store.hpp"
#endif

namespace {

struct Args {
  std::string redis = "redis://127.0.0.1:6379";
  int messages = 3000;
  int rounds = 5;
  std::size_t batch = 64;
  std::string only;       // comma-separated loop names to run (all when empty)
  std::string postgres;   // libpq conninfo: adds the PostgreSQL loops (--postgres)
  int pg_messages = 300;  // per round in the PostgreSQL loops (a commit each: slower)
  long latency_us = 0;    // >0: every connection through a LatencyProxy on CPU 1 (one way)
  int threads = 1;        // >1: the PostgreSQL batch loops with this many consumers of one group
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string publish(idem::mq::RedisStreams& redis, int round, const char* kind, int n) {
  std::string stream = "idem-bench:mq:" + std::string(kind) + ":" + std::to_string(round) + ":" +
                       std::to_string(::getpid());
  redis.del(stream);
  redis.create_group(stream, "bench");
  std::vector<idem::mq::Fields> entries;
  for (int i = 0; i < n; ++i) {
    entries.push_back({{"message_id", "order_" + std::to_string(i) + ":paid:v1"},
                       {"body", "{\"order\":" + std::to_string(i) + ",\"amount\":100}"}});
    if (entries.size() == 500) {
      redis.add_many(stream, entries);
      entries.clear();
    }
  }
  if (!entries.empty()) redis.add_many(stream, entries);
  return stream;
}

// The loop; `handle(batch)` returns the entry ids that may be acked. @return messages/s.
template <class Handle>
double drain(idem::mq::RedisStreams& redis, const std::string& stream, std::size_t batch,
             int expected, Handle&& handle) {
  auto t0 = std::chrono::steady_clock::now();
  int done = 0;
  for (;;) {
    auto entries = redis.read_group(stream, "bench", "worker", batch, std::nullopt);
    if (entries.empty()) break;
    done += static_cast<int>(redis.ack(stream, "bench", handle(entries)));
  }
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (done != expected) {
    std::fprintf(stderr, "acked %d of %d\n", done, expected);
    std::exit(1);
  }
  redis.del(stream);
  return done / secs;
}

// `threads` consumers of one group drain the stream at once, each with its own connections;
// `handle(thread, batch)` returns the entry ids that may be acked. @return messages/s.
template <class Handle>
double drain_parallel(idem::mq::RedisStreams& redis, const std::string& stream, std::size_t batch,
                      int expected, int threads, Handle&& handle) {
  std::vector<long> done(static_cast<std::size_t>(threads), 0);
  std::vector<std::thread> workers;
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const std::string name = "worker-" + std::to_string(t);
      for (;;) {
        auto entries = redis.read_group(stream, "bench", name, batch, std::nullopt);
        if (entries.empty()) break;
        done[static_cast<std::size_t>(t)] +=
            static_cast<long>(redis.ack(stream, "bench", handle(t, entries)));
      }
    });
  }
  for (auto& w : workers) w.join();
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  long total = 0;
  for (long d : done) total += d;
  if (total != expected) {
    std::fprintf(stderr, "acked %ld of %d\n", total, expected);
    std::exit(1);
  }
  redis.del(stream);
  return static_cast<double>(total) / secs;
}

std::shared_ptr<idem::sqlite::Database> open_db(const std::filesystem::path& path) {
  auto db = std::make_shared<idem::sqlite::Database>(path.string());
  db->write([](idem::sqlite::Transaction& tx) {
    tx.exec("CREATE TABLE effect (message_id TEXT NOT NULL, body TEXT NOT NULL)");
  });
  return db;
}

void insert_effect(idem::sqlite::Transaction& tx, const idem::mq::StreamEntry& e) {
  tx.exec("INSERT INTO effect (message_id, body) VALUES (?, ?)", *e.find("message_id"),
          *e.find("body"));
}

using Entries = std::vector<idem::mq::StreamEntry>;

idem::GuardOptions mq_guard_options() {
  idem::GuardOptions go;
  go.durable_source = idem::DuplicateSource::kMqRecord;
  return go;
}

// A consumer group (record scope) per loop and round: Redis keeps the records of earlier runs.
std::string group_of(const std::string& kind, const std::string& round) {
  return kind + "-" + std::to_string(::getpid()) + "-" + round;
}

// The dedup side of a loop: `effect(tx, entry)` for each entry through consume() (one
// transaction each) or, `batched`, through consume_batch(). @return the entry ids to ack.
template <class Tx, class Consumer, class Effect>
std::vector<std::string> consume_entries(Consumer& consumer, const Entries& batch, bool batched,
                                         Effect&& effect) {
  std::vector<std::string> fps;
  std::vector<idem::Delivery> deliveries;
  for (const auto& e : batch) fps.push_back(idem::fingerprint(*e.find("body")));
  for (std::size_t i = 0; i < batch.size(); ++i) {
    deliveries.push_back(idem::Delivery{*batch[i].find("message_id"), fps[i],
                                        *batch[i].find("body"), batch[i].delivery_count});
  }
  std::vector<idem::Verdict> verdicts;
  if (batched) {
    verdicts =
        consumer.consume_batch(deliveries, [&](Tx& tx, std::size_t i) { effect(tx, batch[i]); });
  } else {
    for (std::size_t i = 0; i < batch.size(); ++i) {
      verdicts.push_back(consumer.consume(deliveries[i], [&](Tx& tx) { effect(tx, batch[i]); }));
    }
  }
  std::vector<std::string> acks;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (idem::should_ack(verdicts[i])) acks.push_back(batch[i].id);
  }
  return acks;
}

// The hand-written SQLite recipe (sqlite3 directly): the consume record row and the effect row
// in one transaction, per message or per batch.
class RawConsumeRecord {
 public:
  RawConsumeRecord(const std::filesystem::path& path, std::string group)
      : group_(std::move(group)),
        db_(init(path).string()),
        begin_(db_.get(), "BEGIN IMMEDIATE"),
        commit_(db_.get(), "COMMIT"),
        record_(db_.get(),
                "INSERT INTO mq_consume_record (message_id, consumer_group, consumed_at)"
                " VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING"),
        effect_(db_.get(), "INSERT INTO effect (message_id, body) VALUES (?1, ?2)") {}

  /// One transaction per message (`batched` false) or per batch. @return the ids to ack.
  std::vector<std::string> handle(const Entries& batch, bool batched) {
    std::vector<std::string> acks;
    if (batched) begin_.run();
    for (const auto& e : batch) {
      if (!batched) begin_.run();
      const std::string_view id = *e.find("message_id");
      record_.text(1, id).text(2, group_).integer(3, idem::to_millis(idem::system_now())).run();
      if (sqlite3_changes(db_.get()) == 1) effect_.text(1, id).text(2, *e.find("body")).run();
      if (!batched) commit_.run();
      acks.push_back(e.id);
    }
    if (batched) commit_.run();
    return acks;
  }

 private:
  static const std::filesystem::path& init(const std::filesystem::path& path) {
    idem::bench::RawSqlite db{path.string()};
    db.exec("CREATE TABLE effect (message_id TEXT NOT NULL, body TEXT NOT NULL)");
    db.exec(
        "CREATE TABLE mq_consume_record (message_id TEXT NOT NULL, consumer_group TEXT NOT"
        " NULL, consumed_at INTEGER NOT NULL, PRIMARY KEY (message_id, consumer_group))"
        " WITHOUT ROWID");
    return path;
  }
  std::string group_;
  idem::bench::RawSqlite db_;
  idem::bench::RawStatement begin_, commit_, record_, effect_;
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--redis") a.redis = argv[i + 1];
    if (k == "--messages") a.messages = std::atoi(argv[i + 1]);
    if (k == "--rounds") a.rounds = std::atoi(argv[i + 1]);
    if (k == "--batch") a.batch = static_cast<std::size_t>(std::atoi(argv[i + 1]));
    if (k == "--only") a.only = argv[i + 1];
    if (k == "--postgres") a.postgres = argv[i + 1];
    if (k == "--pg-messages") a.pg_messages = std::atoi(argv[i + 1]);
    if (k == "--latency-us") a.latency_us = std::atol(argv[i + 1]);
    if (k == "--threads") a.threads = std::atoi(argv[i + 1]);
  }
  if (a.threads < 1) {
    std::fprintf(stderr, "--threads must be positive\n");
    return 2;
  }
  // --latency-us: the servers as if on another host; every connection (streams, stores, the
  // plain loops' own) goes through a delay line in each direction.
  std::unique_ptr<idem::bench::LatencyProxy> redis_proxy, pg_proxy;
  if (a.latency_us > 0) {
    const std::regex redis_port(":([0-9]+)$"), pg_port("port=([0-9]+)");
    std::smatch m;
    if (!std::regex_search(a.redis, m, redis_port)) {
      std::fprintf(stderr, "--latency-us needs --redis redis://host:port\n");
      return 2;
    }
    redis_proxy = std::make_unique<idem::bench::LatencyProxy>(
        std::stoi(m[1]), std::chrono::microseconds(a.latency_us), 1);
    a.redis = std::regex_replace(a.redis, redis_port, ":" + std::to_string(redis_proxy->port()));
    if (!a.postgres.empty()) {
      if (!std::regex_search(a.postgres, m, pg_port)) {
        std::fprintf(stderr, "--latency-us needs port=N in --postgres\n");
        return 2;
      }
      pg_proxy = std::make_unique<idem::bench::LatencyProxy>(
          std::stoi(m[1]), std::chrono::microseconds(a.latency_us), 1);
      a.postgres =
          std::regex_replace(a.postgres, pg_port, "port=" + std::to_string(pg_proxy->port()));
    }
  }
  auto wanted = [&](const char* name) {
    return a.only.empty() ||
           ("," + a.only + ",").find("," + std::string(name) + ",") != std::string::npos;
  };
  if (a.threads > 1) {
    for (const char* single :
         {"plain", "dedup_redis", "dedup_memory", "plain_batch", "dedup_batch_redis",
          "dedup_batch_memory", "plain_pg", "dedup_pg", "handwritten", "handwritten_batch",
          "dedup_durable", "dedup_batch_durable", "handwritten_pg", "dedup_pg_durable"}) {
      if (wanted(single)) {
        std::fprintf(stderr,
                     "--threads runs the PostgreSQL batch loops only: add --only "
                     "plain_pg_batch,dedup_pg_batch,dedup_pg_batch_memory,handwritten_pg_batch,"
                     "dedup_pg_batch_durable\n");
        return 2;
      }
    }
  }
  auto dir =
      std::filesystem::temp_directory_path() / ("idem-bench-mq-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  idem::mq::RedisStreamsOptions streams_options{a.redis};
  streams_options.pool_size = std::max<std::size_t>(4, static_cast<std::size_t>(a.threads) + 1);
  idem::mq::RedisStreams redis{streams_options};
  idem::redis::RedisStoreOptions fast_options{a.redis};
  fast_options.pool_size = std::max<std::size_t>(8, static_cast<std::size_t>(a.threads) + 1);

  // Five loops, rounds interleaved: per-message transactions without the consume record, with
  // it (fast store MemoryStore, then RedisStore), and one transaction per batch without and
  // with it.
  std::vector<double> plain, dedup, dedup_redis, plain_batch, dedup_batch, dedup_batch_redis;
  // The hand-written record recipe and idem's consumer with the durable store alone.
  std::vector<double> handwritten, handwritten_batch, dedup_durable, dedup_batch_durable;
#ifdef IDEM_BENCH_WITH_POSTGRES
  // The production shape: the effect row goes to PostgreSQL, one transaction per message;
  // with de-duplication the consume record commits in that same transaction (PostgresStore)
  // behind a RedisStore claim. Both sides run the same unprepared INSERT.
  std::vector<double> plain_pg, dedup_pg, plain_pg_batch, dedup_pg_batch, dedup_pg_batch_memory;
  std::vector<double> handwritten_pg, handwritten_pg_batch, dedup_pg_durable,
      dedup_pg_batch_durable;
  // --latency-us: the round trips of each loop's drains (not of its publishing), counted at the
  // delay lines, and the messages they consumed.
  struct Trips {
    std::uint64_t trips = 0, messages = 0;
  };
  Trips trips_plain_pg, trips_dedup_pg, trips_plain_pg_batch, trips_dedup_pg_batch,
      trips_dedup_pg_batch_memory, trips_handwritten_pg, trips_handwritten_pg_batch,
      trips_dedup_pg_durable, trips_dedup_pg_batch_durable;
  auto proxied_trips = [&]() -> std::uint64_t {
    return (redis_proxy ? redis_proxy->round_trips() : 0) +
           (pg_proxy ? pg_proxy->round_trips() : 0);
  };
  auto counted = [&](Trips& t, int messages, auto&& run_loop) {
    const std::uint64_t before = proxied_trips();
    const double v = run_loop();
    t.trips += proxied_trips() - before;
    t.messages += static_cast<std::uint64_t>(messages);
    return v;
  };
  std::unique_ptr<pqxx::connection> pg;
  std::vector<std::unique_ptr<pqxx::connection>> pg_threads;  // --threads: one per consumer
  std::unique_ptr<idem::postgres::PostgresStore> pg_store;
  // The durable-alone loops' store: a record table of their own, made by migrate() at the start
  // and dropped at the end, as the recipe's. Both pairs' tables then hold the same rows (their
  // two loops' records of this run); mq_consume_record also holds the fast-store loops' records
  // and those of earlier runs on the server.
  std::unique_ptr<idem::postgres::PostgresStore> pg_durable_store;
  std::string pg_fsync, pg_sync_commit;
  const std::string pg_plain_table = "mq_bench_plain_" + std::to_string(::getpid());
  const std::string pg_dedup_table = "mq_bench_dedup_" + std::to_string(::getpid());
  const std::string pg_hw_table = "mq_bench_handwritten_" + std::to_string(::getpid());
  const std::string pg_hw_record = "mq_bench_record_" + std::to_string(::getpid());
  const std::string pg_durable_table = "mq_bench_durable_" + std::to_string(::getpid());
  const std::string pg_durable_record = "mq_bench_idem_record_" + std::to_string(::getpid());
  const std::string pg_durable_insert =
      "INSERT INTO " + pg_durable_table + " (message_id, body) VALUES ($1, $2)";
  const std::string pg_hw_insert =
      "INSERT INTO " + pg_hw_table + " (message_id, body) VALUES ($1, $2)";
  const std::string pg_hw_record_insert = "INSERT INTO " + pg_hw_record +
                                          " (message_id, consumer_group) VALUES ($1, $2)"
                                          " ON CONFLICT DO NOTHING";
  const std::string pg_plain_insert =
      "INSERT INTO " + pg_plain_table + " (message_id, body) VALUES ($1, $2)";
  const std::string pg_dedup_insert =
      "INSERT INTO " + pg_dedup_table + " (message_id, body) VALUES ($1, $2)";
  if (!a.postgres.empty() &&
      (wanted("plain_pg") || wanted("dedup_pg") || wanted("plain_pg_batch") ||
       wanted("dedup_pg_batch") || wanted("dedup_pg_batch_memory") || wanted("handwritten_pg") ||
       wanted("handwritten_pg_batch") || wanted("dedup_pg_durable") ||
       wanted("dedup_pg_batch_durable"))) {
    pg = std::make_unique<pqxx::connection>(a.postgres);
    pqxx::nontransaction nt(*pg);
    for (const auto& t : {pg_plain_table, pg_dedup_table, pg_hw_table, pg_durable_table}) {
      nt.exec("DROP TABLE IF EXISTS " + t);
      nt.exec("CREATE TABLE " + t +
              " (id bigserial PRIMARY KEY, message_id TEXT NOT NULL, body TEXT NOT NULL)");
    }
    // The recipe's consume record: the unique key and a timestamp (bench/rabbitmq's too).
    nt.exec("DROP TABLE IF EXISTS " + pg_hw_record);
    nt.exec("CREATE TABLE " + pg_hw_record +
            " (message_id text NOT NULL, consumer_group text NOT NULL, consumed_at timestamptz"
            " NOT NULL DEFAULT now(), PRIMARY KEY (message_id, consumer_group))");
    pg_fsync = nt.exec("SHOW fsync")[0][0].as<std::string>();
    pg_sync_commit = nt.exec("SHOW synchronous_commit")[0][0].as<std::string>();
    pg_store = std::make_unique<idem::postgres::PostgresStore>(
        idem::postgres::PostgresStoreOptions::mq_consume_record(a.postgres));
    auto durable_options = idem::postgres::PostgresStoreOptions::mq_consume_record(a.postgres);
    durable_options.table = pg_durable_record;
    pg_durable_store = std::make_unique<idem::postgres::PostgresStore>(durable_options);
    for (int t = 0; a.threads > 1 && t < a.threads; ++t) {
      pg_threads.push_back(std::make_unique<pqxx::connection>(a.postgres));
    }
  }
#endif
  for (int round = 0; round < a.rounds; ++round) {
    const std::string r = std::to_string(round);
    if (wanted("plain")) {
      auto db = open_db(dir / ("plain" + r + ".db"));
      auto stream = publish(redis, round, "plain", a.messages);
      plain.push_back(drain(redis, stream, a.batch, a.messages, [&](const Entries& batch) {
        std::vector<std::string> acks;
        for (const auto& e : batch) {
          db->write([&](idem::sqlite::Transaction& tx) { insert_effect(tx, e); });
          acks.push_back(e.id);
        }
        return acks;
      }));
    }
    // The dedup loops over SQLite: `fast` in front, one transaction per message or per batch.
    // (`fast` null: the durable store alone.)
    auto run_dedup = [&](idem::FastStore* fast, const char* kind, bool batched) {
      auto db = open_db(dir / (std::string(kind) + r + ".db"));
      idem::sqlite::SqliteStore durable{db, idem::sqlite::SqliteStoreOptions::mq_consume_record()};
      auto guard =
          fast != nullptr
              ? idem::IdempotencyGuard<idem::sqlite::SqliteStore>{*fast, durable,
                                                                  mq_guard_options()}
              : idem::IdempotencyGuard<idem::sqlite::SqliteStore>{durable, mq_guard_options()};
      idem::IdempotentConsumer consumer{guard, group_of(kind, r)};
      auto stream = publish(redis, round, kind, a.messages);
      return drain(redis, stream, a.batch, a.messages, [&](const Entries& batch) {
        return consume_entries<idem::sqlite::Transaction>(consumer, batch, batched, insert_effect);
      });
    };
    if (wanted("dedup_memory")) {
      idem::MemoryStore fast;
      dedup.push_back(run_dedup(&fast, "dedup_memory", false));
    }
    if (wanted("dedup_redis")) {
      idem::redis::RedisStore fast{fast_options};
      dedup_redis.push_back(run_dedup(&fast, "dedup_redis", false));
    }
    if (wanted("plain_batch")) {
      auto db = open_db(dir / ("plain_batch" + r + ".db"));
      auto stream = publish(redis, round, "plain_batch", a.messages);
      plain_batch.push_back(drain(redis, stream, a.batch, a.messages, [&](const Entries& batch) {
        std::vector<std::string> acks;
        db->write([&](idem::sqlite::Transaction& tx) {
          for (const auto& e : batch) insert_effect(tx, e);
        });
        for (const auto& e : batch) acks.push_back(e.id);
        return acks;
      }));
    }
    if (wanted("dedup_batch_memory")) {
      idem::MemoryStore fast;
      dedup_batch.push_back(run_dedup(&fast, "dedup_batch_memory", true));
    }
    if (wanted("dedup_batch_redis")) {
      idem::redis::RedisStore fast{fast_options};
      dedup_batch_redis.push_back(run_dedup(&fast, "dedup_batch_redis", true));
    }
    auto run_handwritten = [&](const char* kind, bool batched) {
      RawConsumeRecord hw{dir / (std::string(kind) + r + ".db"), group_of(kind, r)};
      auto stream = publish(redis, round, kind, a.messages);
      return drain(redis, stream, a.batch, a.messages,
                   [&](const Entries& batch) { return hw.handle(batch, batched); });
    };
    if (wanted("handwritten")) handwritten.push_back(run_handwritten("handwritten", false));
    if (wanted("dedup_durable")) {
      dedup_durable.push_back(run_dedup(nullptr, "dedup_durable", false));
    }
    if (wanted("handwritten_batch")) {
      handwritten_batch.push_back(run_handwritten("handwritten_batch", true));
    }
    if (wanted("dedup_batch_durable")) {
      dedup_batch_durable.push_back(run_dedup(nullptr, "dedup_batch_durable", true));
    }
#ifdef IDEM_BENCH_WITH_POSTGRES
    if (pg && wanted("plain_pg")) {
      auto stream = publish(redis, round, "plain_pg", a.pg_messages);
      plain_pg.push_back(counted(trips_plain_pg, a.pg_messages, [&] {
        return drain(redis, stream, a.batch, a.pg_messages, [&](const Entries& batch) {
          std::vector<std::string> acks;
          for (const auto& e : batch) {
            pqxx::work tx(*pg);
            tx.exec_params(pg_plain_insert, *e.find("message_id"), *e.find("body"));
            tx.commit();
            acks.push_back(e.id);
          }
          return acks;
        });
      }));
    }
    // The dedup loops over PostgreSQL, RedisStore in front.
    // (`fast` null: the durable store alone, on its own record and effect tables.)
    auto run_dedup_pg = [&](const char* kind, bool batched, idem::FastStore* fast, Trips& trips) {
      auto guard = fast != nullptr
                       ? idem::IdempotencyGuard<idem::postgres::PostgresStore>{*fast, *pg_store,
                                                                               mq_guard_options()}
                       : idem::IdempotencyGuard<idem::postgres::PostgresStore>{*pg_durable_store,
                                                                               mq_guard_options()};
      const std::string& effect_insert = fast != nullptr ? pg_dedup_insert : pg_durable_insert;
      idem::IdempotentConsumer consumer{guard, group_of(kind, r)};
      auto stream = publish(redis, round, kind, a.pg_messages);
      auto handle = [&](const Entries& batch) {
        return consume_entries<pqxx::work>(
            consumer, batch, batched, [&](pqxx::work& tx, const idem::mq::StreamEntry& e) {
              tx.exec_params(effect_insert, *e.find("message_id"), *e.find("body"));
            });
      };
      return counted(trips, a.pg_messages, [&] {
        if (a.threads > 1) {
          return drain_parallel(redis, stream, a.batch, a.pg_messages, a.threads,
                                [&](int, const Entries& batch) { return handle(batch); });
        }
        return drain(redis, stream, a.batch, a.pg_messages, handle);
      });
    };
    if (pg_store && wanted("dedup_pg")) {
      idem::redis::RedisStore fast{fast_options};
      dedup_pg.push_back(run_dedup_pg("dedup_pg", false, &fast, trips_dedup_pg));
    }
    if (pg && wanted("plain_pg_batch")) {
      auto stream = publish(redis, round, "plain_pg_batch", a.pg_messages);
      auto plain_batch_of = [&](pqxx::connection& c, const Entries& batch) {
        std::vector<std::string> acks;
        pqxx::work tx(c);
        for (const auto& e : batch) {
          tx.exec_params(pg_plain_insert, *e.find("message_id"), *e.find("body"));
        }
        tx.commit();
        for (const auto& e : batch) acks.push_back(e.id);
        return acks;
      };
      plain_pg_batch.push_back(counted(trips_plain_pg_batch, a.pg_messages, [&] {
        return a.threads > 1
                   ? drain_parallel(redis, stream, a.batch, a.pg_messages, a.threads,
                                    [&](int t, const Entries& batch) {
                                      return plain_batch_of(
                                          *pg_threads[static_cast<std::size_t>(t)], batch);
                                    })
                   : drain(redis, stream, a.batch, a.pg_messages,
                           [&](const Entries& batch) { return plain_batch_of(*pg, batch); });
      }));
    }
    if (pg_store && wanted("dedup_pg_batch")) {
      idem::redis::RedisStore fast{fast_options};
      dedup_pg_batch.push_back(run_dedup_pg("dedup_pg_batch", true, &fast, trips_dedup_pg_batch));
    }
    if (pg_store && wanted("dedup_pg_batch_memory")) {
      idem::MemoryStore fast;
      dedup_pg_batch_memory.push_back(
          run_dedup_pg("dedup_pg_batch_memory", true, &fast, trips_dedup_pg_batch_memory));
    }
    // The hand-written record recipe on PostgreSQL (libpqxx): per message, the record INSERT ...
    // ON CONFLICT DO NOTHING and the effect when it was new; per batch, ONE multi-row record
    // INSERT ... ON CONFLICT DO NOTHING RETURNING message_id, then the new ones' effects.
    const std::string hw_group = group_of("handwritten_pg", r);
    const std::string hw_batch_group = group_of("handwritten_pg_batch", r);
    auto hw_each_of = [&](pqxx::connection& c, const Entries& batch) {
      std::vector<std::string> acks;
      for (const auto& e : batch) {
        pqxx::work tx(c);
        if (tx.exec_params(pg_hw_record_insert, *e.find("message_id"), hw_group).affected_rows() ==
            1) {
          tx.exec_params(pg_hw_insert, *e.find("message_id"), *e.find("body"));
        }
        tx.commit();
        acks.push_back(e.id);
      }
      return acks;
    };
    auto hw_batch_of = [&](pqxx::connection& c, const Entries& batch) {
      std::vector<std::string> acks;
      pqxx::work tx(c);
      std::string sql = "INSERT INTO " + pg_hw_record + " (message_id, consumer_group) VALUES ";
      for (std::size_t i = 0; i < batch.size(); ++i) {
        sql += (i ? ", (" : "(") + tx.quote(*batch[i].find("message_id")) + ", " +
               tx.quote(hw_batch_group) + ")";
      }
      sql += " ON CONFLICT DO NOTHING RETURNING message_id";
      std::set<std::string> fresh;
      for (const auto& row : tx.exec(sql)) fresh.insert(row[0].as<std::string>());
      for (const auto& e : batch) {
        if (fresh.erase(std::string(*e.find("message_id"))) == 1) {
          tx.exec_params(pg_hw_insert, *e.find("message_id"), *e.find("body"));
        }
      }
      tx.commit();
      for (const auto& e : batch) acks.push_back(e.id);
      return acks;
    };
    if (pg && wanted("handwritten_pg")) {
      auto stream = publish(redis, round, "handwritten_pg", a.pg_messages);
      handwritten_pg.push_back(counted(trips_handwritten_pg, a.pg_messages, [&] {
        return drain(redis, stream, a.batch, a.pg_messages,
                     [&](const Entries& batch) { return hw_each_of(*pg, batch); });
      }));
    }
    if (pg_store && wanted("dedup_pg_durable")) {
      dedup_pg_durable.push_back(
          run_dedup_pg("dedup_pg_durable", false, nullptr, trips_dedup_pg_durable));
    }
    if (pg && wanted("handwritten_pg_batch")) {
      auto stream = publish(redis, round, "handwritten_pg_batch", a.pg_messages);
      handwritten_pg_batch.push_back(counted(trips_handwritten_pg_batch, a.pg_messages, [&] {
        return a.threads > 1
                   ? drain_parallel(redis, stream, a.batch, a.pg_messages, a.threads,
                                    [&](int t, const Entries& batch) {
                                      return hw_batch_of(*pg_threads[static_cast<std::size_t>(t)],
                                                         batch);
                                    })
                   : drain(redis, stream, a.batch, a.pg_messages,
                           [&](const Entries& batch) { return hw_batch_of(*pg, batch); });
      }));
    }
    if (pg_store && wanted("dedup_pg_batch_durable")) {
      dedup_pg_batch_durable.push_back(
          run_dedup_pg("dedup_pg_batch_durable", true, nullptr, trips_dedup_pg_batch_durable));
    }
#endif
  }
  std::filesystem::remove_all(dir);
#ifdef IDEM_BENCH_WITH_POSTGRES
  if (pg) {
    pqxx::nontransaction nt(*pg);
    for (const auto& t :
         {pg_plain_table, pg_dedup_table, pg_hw_table, pg_hw_record, pg_durable_table}) {
      nt.exec("DROP TABLE IF EXISTS " + t);
    }
    // The durable loops' record table, and its row in the version table (a table made again
    // under this name is then migrated afresh).
    pg_durable_store.reset();
    nt.exec("DROP TABLE IF EXISTS " + pg_durable_record);
    nt.exec_params("DELETE FROM idem_schema_version WHERE name = $1", pg_durable_record);
  }
#endif
  // Figures and ratios of the loops that ran (--only), like with like: per-message loops
  // against each other, batch loops against each other.
  auto line = [](const char* label, const std::vector<double>& v) {
    if (!v.empty()) std::printf("%-48s %8.0f msg/s (median)\n", label, median(v));
  };
  auto ratio = [](const char* name, const std::vector<double>& ours,
                  const std::vector<double>& base) {
    if (!ours.empty() && !base.empty()) {
      std::printf("ratio %s = %.2f\n", name, median(ours) / median(base));
    }
  };
  if (!plain.empty() || !dedup.empty() || !dedup_redis.empty() || !plain_batch.empty() ||
      !dedup_batch.empty() || !dedup_batch_redis.empty() || !handwritten.empty() ||
      !handwritten_batch.empty() || !dedup_durable.empty() || !dedup_batch_durable.empty()) {
    std::printf(
        "mq consumer loop, SQLite: %d messages per round, XREADGROUP/XACK batches of %zu, "
        "%d interleaved rounds, SQLite WAL synchronous=NORMAL\n",
        a.messages, a.batch, a.rounds);
    line("plain, one transaction per message:", plain);
    line("dedup, consume(), fast store RedisStore:", dedup_redis);
    line("dedup, consume(), fast store MemoryStore:", dedup);
    line("plain, one transaction per batch:", plain_batch);
    line("dedup, consume_batch(), fast store RedisStore:", dedup_batch_redis);
    line("dedup, consume_batch(), fast store MemoryStore:", dedup_batch);
    ratio("mq_dedup_vs_plain", dedup_redis, plain);
    ratio("mq_dedup_memory_vs_plain", dedup, plain);
    ratio("mq_dedup_batch_redis_vs_plain_batch", dedup_batch_redis, plain_batch);
    ratio("mq_dedup_batch_memory_vs_plain_batch", dedup_batch, plain_batch);
    line("hand-written record recipe, per message:", handwritten);
    line("dedup, consume(), durable store alone:", dedup_durable);
    line("hand-written record recipe, per batch:", handwritten_batch);
    line("dedup, consume_batch(), durable store alone:", dedup_batch_durable);
    ratio("mq_consume_batch_sqlite_vs_handwritten_consume_record", dedup_batch_durable,
          handwritten_batch);
    ratio("mq_consume_batch_sqlite_memory_vs_handwritten_consume_record", dedup_batch,
          handwritten_batch);
    ratio("mq_consume_batch_sqlite_redis_vs_handwritten_consume_record", dedup_batch_redis,
          handwritten_batch);
    ratio("mq_consume_sqlite_vs_handwritten_consume_record", dedup_durable, handwritten);
    ratio("mq_consume_sqlite_memory_vs_handwritten_consume_record", dedup, handwritten);
    ratio("mq_handwritten_consume_record_batch_vs_plain_batch", handwritten_batch, plain_batch);
  }
#ifdef IDEM_BENCH_WITH_POSTGRES
  if (!plain_pg.empty() || !dedup_pg.empty() || !plain_pg_batch.empty() ||
      !dedup_pg_batch.empty() || !handwritten_pg.empty() || !handwritten_pg_batch.empty() ||
      !dedup_pg_durable.empty() || !dedup_pg_batch_durable.empty()) {
    std::printf(
        "mq consumer loop, PostgreSQL: %d messages per round, XREADGROUP/XACK batches of "
        "%zu, %d interleaved rounds, fsync=%s, synchronous_commit=%s, injected one-way "
        "latency %ld us, %d consumer thread(s) in the group\n",
        a.pg_messages, a.batch, a.rounds, pg_fsync.c_str(), pg_sync_commit.c_str(), a.latency_us,
        a.threads);
    line("plain, one PostgreSQL transaction per message:", plain_pg);
    line("dedup, consume(), RedisStore + PostgresStore:", dedup_pg);
    line("plain, one PostgreSQL transaction per batch:", plain_pg_batch);
    line("dedup, consume_batch(), RedisStore + PostgresStore:", dedup_pg_batch);
    line("dedup, consume_batch(), MemoryStore + PostgresStore:", dedup_pg_batch_memory);
    line("hand-written record recipe, per message:", handwritten_pg);
    line("dedup, consume(), PostgresStore alone:", dedup_pg_durable);
    line("hand-written record recipe, per batch:", handwritten_pg_batch);
    line("dedup, consume_batch(), PostgresStore alone:", dedup_pg_batch_durable);
    std::string suffix = pg_sync_commit == "off" ? "_async_commit" : "";
    if (a.latency_us > 0) suffix += "_latency_" + std::to_string(a.latency_us) + "us";
    if (a.threads > 1) suffix += "_" + std::to_string(a.threads) + "_consumers";
    ratio(("mq_dedup_postgres_vs_plain_postgres" + suffix).c_str(), dedup_pg, plain_pg);
    ratio(("mq_dedup_batch_postgres_vs_plain_batch_postgres" + suffix).c_str(), dedup_pg_batch,
          plain_pg_batch);
    ratio(("mq_dedup_batch_postgres_memory_vs_plain_batch_postgres" + suffix).c_str(),
          dedup_pg_batch_memory, plain_pg_batch);
    // Against the hand-written record recipe: the durable store alone (like for like), then
    // with a fast store in front.
    ratio(("mq_consume_batch_postgres_vs_handwritten_consume_record" + suffix).c_str(),
          dedup_pg_batch_durable, handwritten_pg_batch);
    ratio(("mq_consume_batch_postgres_memory_vs_handwritten_consume_record" + suffix).c_str(),
          dedup_pg_batch_memory, handwritten_pg_batch);
    ratio(("mq_consume_batch_postgres_redis_vs_handwritten_consume_record" + suffix).c_str(),
          dedup_pg_batch, handwritten_pg_batch);
    ratio(("mq_consume_vs_handwritten_consume_record" + suffix).c_str(), dedup_pg_durable,
          handwritten_pg);
    ratio(("mq_consume_redis_vs_handwritten_consume_record" + suffix).c_str(), dedup_pg,
          handwritten_pg);
    ratio(("mq_handwritten_consume_record_batch_vs_plain_batch_postgres" + suffix).c_str(),
          handwritten_pg_batch, plain_pg_batch);
    // Round trips per message, what the delay lines counted (the latency pass only).
    if (a.latency_us > 0) {
      auto per_message = [](const Trips& t) {
        return t.messages ? static_cast<double>(t.trips) / static_cast<double>(t.messages) : 0.0;
      };
      auto trips_line = [&](const char* label, const Trips& t, const Trips* base) {
        if (t.messages == 0) return;
        std::printf("round trips per message, %-38s %6.3f", label, per_message(t));
        if (base && base->messages) {
          std::printf("  (%+.3f against the plain loop)", per_message(t) - per_message(*base));
        }
        std::printf("\n");
      };
      trips_line("plain, transaction per message:", trips_plain_pg, nullptr);
      trips_line("dedup, consume():", trips_dedup_pg, &trips_plain_pg);
      trips_line("plain, transaction per batch:", trips_plain_pg_batch, nullptr);
      trips_line("dedup, consume_batch(), RedisStore:", trips_dedup_pg_batch,
                 &trips_plain_pg_batch);
      trips_line("dedup, consume_batch(), MemoryStore:", trips_dedup_pg_batch_memory,
                 &trips_plain_pg_batch);
      trips_line("hand-written recipe, per message:", trips_handwritten_pg, &trips_plain_pg);
      trips_line("dedup, consume(), PostgresStore alone:", trips_dedup_pg_durable, &trips_plain_pg);
      trips_line("hand-written recipe, per batch:", trips_handwritten_pg_batch,
                 &trips_plain_pg_batch);
      trips_line("dedup, consume_batch(), PostgresStore alone:", trips_dedup_pg_batch_durable,
                 &trips_plain_pg_batch);
      auto trips_ratio = [&](const char* name, const Trips& ours, const Trips& base) {
        if (ours.messages && base.messages && ours.trips) {
          std::printf("ratio %s = %.2f\n", name, per_message(base) / per_message(ours));
        }
      };
      trips_ratio("mq_dedup_postgres_vs_plain_postgres_round_trips", trips_dedup_pg,
                  trips_plain_pg);
      trips_ratio("mq_dedup_batch_postgres_vs_plain_batch_postgres_round_trips",
                  trips_dedup_pg_batch, trips_plain_pg_batch);
      trips_ratio("mq_consume_vs_handwritten_consume_record_round_trips", trips_dedup_pg_durable,
                  trips_handwritten_pg);
      trips_ratio("mq_consume_batch_postgres_vs_handwritten_consume_record_round_trips",
                  trips_dedup_pg_batch_durable, trips_handwritten_pg_batch);
    }
  }
#endif
  return 0;
}
