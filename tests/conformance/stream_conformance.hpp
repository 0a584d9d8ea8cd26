// SPDX-License-Identifier: MIT
// One typed suite for the durable stream chunk tables (ChunkStore of each database): each
// (request_id, chunk_offset) stored once whatever the number of writers, bodies kept as
// bytes, resumable from the contiguous prefix (also by new objects, as after a restart), and
// composable with the guard's transaction.
//
// A Traits type provides:
//   using Store = ...;                        // the durable store (its Transaction is used)
//   using Chunks = ...;                       // its ChunkStore
//   static const char* env_var();             // null: no server needed
//   static std::unique_ptr<Store> make_store();
//   static std::unique_ptr<Chunks> make_chunks(Store&);
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/guard.hpp"
#include "idem/stream.hpp"
#include "support/test_env.hpp"

namespace idem::test {

template <class Traits>
class StreamConformance : public ::testing::Test {
 protected:
  using TxType = typename Traits::Store::Transaction;

  void SetUp() override {
    std::string value;
    if (Traits::env_var() != nullptr) IDEM_REQUIRE_ENV(value, Traits::env_var());
    store_ = Traits::make_store();
    chunks_ = Traits::make_chunks(*store_);
  }
  std::unique_ptr<typename Traits::Store> store_;
  std::unique_ptr<typename Traits::Chunks> chunks_;
};

TYPED_TEST_SUITE_P(StreamConformance);

TYPED_TEST_P(StreamConformance, AppendStoresOnceAndResumeReturnsThePrefix) {
  auto& chunks = *this->chunks_;
  const std::string rid = unique_name("chat");
  EXPECT_TRUE(chunks.append(rid, 0, "Hello, "));
  EXPECT_FALSE(chunks.append(rid, 0, "Hello, "));  // the server wrote it twice
  EXPECT_TRUE(chunks.append(rid, 7, "wor"));
  EXPECT_FALSE(chunks.append(rid, 7, "world"));  // a stored offset keeps its first body
  EXPECT_EQ(2u, chunks.count(rid));
  auto r = chunks.resume(rid);
  EXPECT_EQ("Hello, wor", r.text);
  EXPECT_EQ(10u, r.next_offset);
  EXPECT_FALSE(r.has_gap);
}

TYPED_TEST_P(StreamConformance, ResumeStopsAtTheFirstHoleAndBodiesAreBytes) {
  auto& chunks = *this->chunks_;
  const std::string rid = unique_name("chat");
  const std::string bin("a\0b\xff", 4);  // bodies are bytes, not text
  ASSERT_TRUE(chunks.append(rid, 0, bin));
  ASSERT_TRUE(chunks.append(rid, 2,
                            "b\xff"
                            "cd"));              // overlaps [2, 4): adds "cd"
  ASSERT_TRUE(chunks.append(rid, 10, "later"));  // beyond a hole at [6, 10)
  auto r = chunks.resume(rid);
  EXPECT_EQ(6u, r.next_offset);
  EXPECT_EQ(bin + "cd", r.text);
  EXPECT_EQ(3u, r.chunks);
  EXPECT_TRUE(r.has_gap);

  // A restarted producer (new objects) continues from the stored offset, never re-emitting.
  auto store2 = TypeParam::make_store();
  auto chunks2 = TypeParam::make_chunks(*store2);
  auto r2 = chunks2->resume(rid);
  EXPECT_EQ(r.next_offset, r2.next_offset);
  EXPECT_EQ(r.text, r2.text);
  stream::ProducerDedup producer{rid, r2.next_offset};
  EXPECT_FALSE(producer.admit(0, bin + "cd").has_value());
  const std::string retried = bin + "cdEF";  // admit answers a view into it: keep it alive
  auto c = producer.admit(0, retried);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(6u, c->offset);
  EXPECT_TRUE(chunks2->append(rid, c->offset, c->body));
  EXPECT_EQ(4u, chunks2->count(rid));

  EXPECT_EQ(4u, chunks.erase(rid));
  EXPECT_EQ(0u, chunks.resume(rid).next_offset);
}

TYPED_TEST_P(StreamConformance, SixteenWritersOfTheSameChunksStoreEachOnce) {
  auto& chunks = *this->chunks_;
  const std::string rid = unique_name("chat");
  constexpr int kThreads = 16, kChunks = 40;
  std::atomic<int> stored{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kChunks; ++i) {  // each writer in its own order
        int k = (i * 7 + t) % kChunks;
        try {
          if (chunks.append(rid, static_cast<std::uint64_t>(k) * 4,
                            "tok" + std::to_string(k % 10))) {
            ++stored;
          }
        } catch (const std::exception& e) {
          ADD_FAILURE() << e.what();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(kChunks, stored.load());  // exactly one writer was first for each chunk
  EXPECT_EQ(static_cast<std::uint64_t>(kChunks), chunks.count(rid));
  auto r = chunks.resume(rid);
  EXPECT_EQ(static_cast<std::uint64_t>(kChunks) * 4, r.next_offset);
  EXPECT_FALSE(r.has_gap);
}

TYPED_TEST_P(StreamConformance, AppendInsideTheGuardsTransactionCommitsOrRollsBackWithIt) {
  using Tx = typename TestFixture::TxType;  // NOLINT
  auto& chunks = *this->chunks_;
  const std::string rid = unique_name("chat");
  IdempotencyGuard guard{*this->store_};
  auto key = Key::make("chat.chunk", rid + "_0");
  auto r = guard.run(key, "", [&](Tx& tx) {
    EXPECT_TRUE(chunks.append(tx, rid, 0, "first"));
    EXPECT_FALSE(chunks.append(tx, rid, 0, "first"));  // a repeat never breaks tx
    return std::string("ok");
  });
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(1u, chunks.count(rid));

  auto key2 = Key::make("chat.chunk", rid + "_5");
  EXPECT_THROW((void)guard.run(key2, "",
                               [&](Tx& tx) -> std::string {
                                 chunks.append(tx, rid, 5, "lost");
                                 throw std::runtime_error("handler failed");
                               }),
               std::runtime_error);
  EXPECT_EQ(1u, chunks.count(rid));  // rolled back with the record
  EXPECT_EQ(5u, chunks.resume(rid).next_offset);
}

TYPED_TEST_P(StreamConformance, BadRequestIdsAreRefused) {
  auto& chunks = *this->chunks_;
  EXPECT_THROW(chunks.append("has space", 0, "x"), InvalidKey);
  EXPECT_THROW(chunks.append("", 0, "x"), InvalidKey);
  EXPECT_THROW(chunks.append("ok_id", static_cast<std::uint64_t>(INT64_MAX) + 1, "x"), UsageError);
  // A chunk ending beyond a BIGINT; every call checks the request id.
  EXPECT_THROW(chunks.append("ok_id", static_cast<std::uint64_t>(INT64_MAX), "xy"), UsageError);
  EXPECT_THROW((void)chunks.count(std::string(129, 'r')), InvalidKey);
  EXPECT_THROW((void)chunks.erase(""), InvalidKey);
}

// An empty chunk is refused: stored, it took the offset of the chunk that carries those bytes,
// which was then answered as a repeat and never stored (the stream stopped there for good).
TYPED_TEST_P(StreamConformance, AnEmptyChunkIsRefusedAndBlocksNothing) {
  auto& chunks = *this->chunks_;
  const std::string rid = unique_name("empty");
  EXPECT_THROW(chunks.append(rid, 0, ""), UsageError);
  EXPECT_TRUE(chunks.append(rid, 0, "Hello"));
  EXPECT_EQ("Hello", chunks.resume(rid).text);
  EXPECT_EQ(1u, chunks.count(rid));
}

REGISTER_TYPED_TEST_SUITE_P(StreamConformance, AppendStoresOnceAndResumeReturnsThePrefix,
                            ResumeStopsAtTheFirstHoleAndBodiesAreBytes,
                            SixteenWritersOfTheSameChunksStoreEachOnce,
                            AppendInsideTheGuardsTransactionCommitsOrRollsBackWithIt,
                            BadRequestIdsAreRefused, AnEmptyChunkIsRefusedAndBlocksNothing);

}  // namespace idem::test
