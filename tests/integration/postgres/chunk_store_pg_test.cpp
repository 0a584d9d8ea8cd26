// SPDX-License-Identifier: MIT
// idem::postgres::ChunkStore on the real server: each (request_id, chunk_offset) stored once
// whatever the number of writers, resumable from the contiguous prefix (also by a new store
// object, as after a restart), composable with the guard's transaction.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/postgres/stream_store.hpp"
#include "idem/stream.hpp"
#include "pg_test_support.hpp"

namespace {

namespace pg = idem::test::pg;
using idem::postgres::ChunkStore;

class ChunkStorePg : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_POSTGRES();
    store_ = std::make_unique<idem::postgres::PostgresStore>(pg::options());
    chunks_ = std::make_unique<ChunkStore>(*store_);
  }
  std::unique_ptr<idem::postgres::PostgresStore> store_;
  std::unique_ptr<ChunkStore> chunks_;
};

TEST_F(ChunkStorePg, AppendStoresOnceAndResumeReturnsThePrefix) {
  const std::string rid = idem::test::unique_name("chat");
  EXPECT_TRUE(chunks_->append(rid, 0, "Hello, "));
  EXPECT_FALSE(chunks_->append(rid, 0, "Hello, "));  // the server wrote it twice
  EXPECT_TRUE(chunks_->append(rid, 7, "wor"));
  EXPECT_FALSE(chunks_->append(rid, 7, "world"));  // a stored offset keeps its first body
  EXPECT_EQ(2u, chunks_->count(rid));
  auto r = chunks_->resume(rid);
  EXPECT_EQ("Hello, wor", r.text);
  EXPECT_EQ(10u, r.next_offset);
  EXPECT_FALSE(r.has_gap);
}

TEST_F(ChunkStorePg, ResumeStopsAtTheFirstHoleAndUsesOverlapsSuffixOnly) {
  const std::string rid = idem::test::unique_name("chat");
  const std::string bin("a\0b\xff", 4);  // bodies are bytes (BYTEA), not text
  ASSERT_TRUE(chunks_->append(rid, 0, bin));
  ASSERT_TRUE(chunks_->append(rid, 2,
                              "b\xff"
                              "cd"));              // overlaps [2, 4): adds "cd"
  ASSERT_TRUE(chunks_->append(rid, 10, "later"));  // beyond a hole at [6, 10)
  auto r = chunks_->resume(rid);
  EXPECT_EQ(6u, r.next_offset);
  EXPECT_EQ(bin + "cd", r.text);
  EXPECT_EQ(3u, r.chunks);
  EXPECT_TRUE(r.has_gap);

  // A restarted producer (new store objects) continues from the stored offset, never
  // re-emitting a byte.
  idem::postgres::PostgresStore again{pg::options()};
  ChunkStore chunks2{again};
  auto r2 = chunks2.resume(rid);
  EXPECT_EQ(r.next_offset, r2.next_offset);
  EXPECT_EQ(r.text, r2.text);
  idem::stream::ProducerDedup producer{rid, r2.next_offset};
  EXPECT_FALSE(producer.admit(0, bin + "cd").has_value());
  const std::string retried = bin + "cdEF";  // admit answers a view into it: keep it alive
  auto c = producer.admit(0, retried);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(6u, c->offset);
  EXPECT_TRUE(chunks2.append(rid, c->offset, c->body));
  EXPECT_EQ(4u, chunks2.count(rid));

  EXPECT_EQ(4u, chunks_->erase(rid));
  EXPECT_EQ(0u, chunks_->resume(rid).next_offset);
}

TEST_F(ChunkStorePg, SixteenWritersOfTheSameChunksStoreEachOnce) {
  const std::string rid = idem::test::unique_name("chat");
  constexpr int kThreads = 16, kChunks = 40;
  std::atomic<int> stored{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Each writer goes through the chunks in its own order.
      for (int i = 0; i < kChunks; ++i) {
        int k = (i * 7 + t) % kChunks;
        if (chunks_->append(rid, static_cast<std::uint64_t>(k) * 4,
                            "tok" + std::to_string(k % 10))) {
          ++stored;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(kChunks, stored.load());  // exactly one writer was first for each chunk
  EXPECT_EQ(static_cast<std::uint64_t>(kChunks), chunks_->count(rid));
  auto r = chunks_->resume(rid);
  EXPECT_EQ(static_cast<std::uint64_t>(kChunks) * 4, r.next_offset);
  EXPECT_FALSE(r.has_gap);
}

TEST_F(ChunkStorePg, AppendInsideTheGuardsTransactionCommitsOrRollsBackWithIt) {
  const std::string rid = idem::test::unique_name("chat");
  idem::IdempotencyGuard guard{*store_};
  auto key = idem::Key::make("chat.chunk", rid + "_0");
  auto r = guard.run(key, "", [&](pqxx::work& tx) {
    EXPECT_TRUE(chunks_->append(tx, rid, 0, "first"));
    EXPECT_FALSE(chunks_->append(tx, rid, 0, "first"));  // a repeat never aborts tx
    return std::string("ok");
  });
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(1u, chunks_->count(rid));

  auto key2 = idem::Key::make("chat.chunk", rid + "_5");
  EXPECT_THROW((void)guard.run(key2, "",
                               [&](pqxx::work& tx) -> std::string {
                                 chunks_->append(tx, rid, 5, "lost");
                                 throw std::runtime_error("handler failed");
                               }),
               std::runtime_error);
  EXPECT_EQ(1u, chunks_->count(rid));  // rolled back with the record
  EXPECT_EQ(5u, chunks_->resume(rid).next_offset);
}

TEST_F(ChunkStorePg, AppendAllStoresEachChunkOnce) {
  std::vector<idem::stream::Chunk> all = {{0, "Hel"}, {3, "lo, "}, {7, "world"}, {12, "!"}};
  std::vector<idem::stream::Chunk> first(all.begin(), all.begin() + 2);
  EXPECT_EQ(2u, store_->with_transaction(
                    [&](pqxx::work& tx) { return chunks_->append_all(tx, "chat_all", first); }));
  EXPECT_EQ(2u, store_->with_transaction(
                    [&](pqxx::work& tx) { return chunks_->append_all(tx, "chat_all", all); }));
  EXPECT_EQ(4u, chunks_->count("chat_all"));
  EXPECT_EQ("Hello, world!", chunks_->resume("chat_all").text);
  std::vector<idem::stream::Chunk> bad = {{0, "a"}, {std::uint64_t{1} << 63, "b"}};
  EXPECT_THROW(store_->with_transaction(
                   [&](pqxx::work& tx) { return chunks_->append_all(tx, "chat_bad", bad); }),
               idem::UsageError);
  EXPECT_EQ(0u, chunks_->count("chat_bad"));
}

TEST_F(ChunkStorePg, BadRequestIdsAndTableNamesAreRefused) {
  EXPECT_THROW(chunks_->append("has space", 0, "x"), idem::InvalidKey);
  EXPECT_THROW(chunks_->append("", 0, "x"), idem::InvalidKey);
  EXPECT_THROW(ChunkStore(*store_, {"ai_stream_chunk; DROP TABLE x", true}), idem::UsageError);
}

}  // namespace
