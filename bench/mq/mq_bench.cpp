// SPDX-License-Identifier: MIT
// Consumer-loop throughput on Redis Streams: XREADGROUP batch -> handler -> XACK batch, where the
// handler writes one effect row to SQLite. "plain" runs it in its own transaction; "dedup" runs
// it through IdempotentConsumer (fast-store claim, then mq_consume_record in the same SQLite
// transaction as the effect); the batch variants use one transaction per XREADGROUP batch
// (consume_batch: one pipelined claim round trip, one transaction, one pipelined complete).
// Same process, rounds interleaved (plain, dedup, ...), medians.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "idem/consumer.hpp"
#include "idem/memory_store.hpp"
#include "idem/mq/redis_streams.hpp"
#include "idem/redis/redis_store.hpp"
#include "idem/sqlite/sqlite_store.hpp"

namespace {

struct Args {
  std::string redis = "redis://127.0.0.1:6379";
  int messages = 3000;
  int rounds = 5;
  std::size_t batch = 64;
  std::string only;  // comma-separated loop names to run (all when empty)
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
  }
  auto wanted = [&](const char* name) {
    return a.only.empty() || ("," + a.only + ",").find("," + std::string(name) + ",") !=
                                 std::string::npos;
  };
  auto dir = std::filesystem::temp_directory_path() /
             ("idem-bench-mq-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  idem::mq::RedisStreams redis{{a.redis}};

  // Five loops, rounds interleaved: per-message transactions without the consume record, with
  // it (fast store MemoryStore, then RedisStore), and one transaction per batch without and
  // with it.
  std::vector<double> plain, dedup, dedup_redis, plain_batch, dedup_batch, dedup_batch_redis;
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
    auto run_dedup = [&](idem::FastStore& fast, const char* kind) {
      auto db = open_db(dir / (std::string(kind) + r + ".db"));
      idem::sqlite::SqliteStore durable{db, idem::sqlite::SqliteStoreOptions::mq_consume_record()};
      idem::GuardOptions go;
      go.durable_source = idem::DuplicateSource::kMqRecord;
      idem::IdempotencyGuard guard{fast, durable, go};
      // A group (record scope) of its own: Redis keeps the records of earlier runs.
      idem::IdempotentConsumer consumer{
          guard, std::string(kind) + "-" + std::to_string(::getpid()) + "-" + r};
      auto stream = publish(redis, round, kind, a.messages);
      return drain(redis, stream, a.batch, a.messages, [&](const Entries& batch) {
        std::vector<std::string> acks;
        for (const auto& e : batch) {
          const std::string& body = *e.find("body");
          auto v = consumer.consume(
              idem::Delivery{*e.find("message_id"), idem::fingerprint(body), body,
                             e.delivery_count},
              [&](idem::sqlite::Transaction& tx) { insert_effect(tx, e); });
          if (idem::should_ack(v)) acks.push_back(e.id);
        }
        return acks;
      });
    };
    if (wanted("dedup_memory")) {
      idem::MemoryStore fast;
      dedup.push_back(run_dedup(fast, "dedup_memory"));
    }
    if (wanted("dedup_redis")) {
      idem::redis::RedisStore fast{idem::redis::RedisStoreOptions{a.redis}};
      dedup_redis.push_back(run_dedup(fast, "dedup_redis"));
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
    auto run_dedup_batch = [&](idem::FastStore& fast, const char* kind) {
      auto db = open_db(dir / (std::string(kind) + r + ".db"));
      idem::sqlite::SqliteStore durable{db, idem::sqlite::SqliteStoreOptions::mq_consume_record()};
      idem::GuardOptions go;
      go.durable_source = idem::DuplicateSource::kMqRecord;
      idem::IdempotencyGuard guard{fast, durable, go};
      // A group (record scope) of its own: Redis keeps the records of earlier runs.
      idem::IdempotentConsumer consumer{
          guard, std::string(kind) + "-" + std::to_string(::getpid()) + "-" + r};
      auto stream = publish(redis, round, kind, a.messages);
      return drain(redis, stream, a.batch, a.messages, [&](const Entries& batch) {
        std::vector<std::string> fps;
        std::vector<idem::Delivery> deliveries;
        for (const auto& e : batch) fps.push_back(idem::fingerprint(*e.find("body")));
        for (std::size_t i = 0; i < batch.size(); ++i) {
          deliveries.push_back(idem::Delivery{*batch[i].find("message_id"), fps[i],
                                              *batch[i].find("body"), batch[i].delivery_count});
        }
        auto verdicts = consumer.consume_batch(
            deliveries,
            [&](idem::sqlite::Transaction& tx, std::size_t i) { insert_effect(tx, batch[i]); });
        std::vector<std::string> acks;
        for (std::size_t i = 0; i < batch.size(); ++i) {
          if (idem::should_ack(verdicts[i])) acks.push_back(batch[i].id);
        }
        return acks;
      });
    };
    if (wanted("dedup_batch_memory")) {
      idem::MemoryStore fast;
      dedup_batch.push_back(run_dedup_batch(fast, "dedup_batch_memory"));
    }
    if (wanted("dedup_batch_redis")) {
      idem::redis::RedisStore fast{idem::redis::RedisStoreOptions{a.redis}};
      dedup_batch_redis.push_back(run_dedup_batch(fast, "dedup_batch_redis"));
    }
  }
  std::filesystem::remove_all(dir);
  std::printf("mq consumer loop: %d messages per round, XREADGROUP/XACK batches of %zu, %d "
              "interleaved rounds, SQLite WAL synchronous=NORMAL\n",
              a.messages, a.batch, a.rounds);
  std::printf("plain, one transaction per message:            %8.0f msg/s (median)\n",
              median(plain));
  std::printf("dedup, consume(), fast store RedisStore:       %8.0f msg/s (median)\n",
              median(dedup_redis));
  std::printf("dedup, consume(), fast store MemoryStore:      %8.0f msg/s (median)\n",
              median(dedup));
  std::printf("plain, one transaction per batch:              %8.0f msg/s (median)\n",
              median(plain_batch));
  std::printf("dedup, consume_batch(), fast store RedisStore:  %8.0f msg/s (median)\n",
              median(dedup_batch_redis));
  std::printf("dedup, consume_batch(), fast store MemoryStore: %8.0f msg/s (median)\n",
              median(dedup_batch));
  // Like with like: per-message loops against each other, batch loops against each other.
  std::printf("ratio mq_dedup_vs_plain = %.2f\n", median(dedup_redis) / median(plain));
  std::printf("ratio mq_dedup_memory_vs_plain = %.2f\n", median(dedup) / median(plain));
  std::printf("ratio mq_dedup_batch_redis_vs_plain_batch = %.2f\n",
              median(dedup_batch_redis) / median(plain_batch));
  std::printf("ratio mq_dedup_batch_memory_vs_plain_batch = %.2f\n",
              median(dedup_batch) / median(plain_batch));
  return 0;
}
