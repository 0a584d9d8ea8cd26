// SPDX-License-Identifier: MIT
#include "idem/memory_store.hpp"

#include <gtest/gtest.h>

#include <type_traits>

#include "conformance/fast_store_conformance.hpp"
#include "idem/guard.hpp"

IDEM_FAST_STORE_CONFORMANCE(Memory, (idem::test::FastStoreFactory{
                                        "memory", nullptr, [](const std::string&) {
                                          return std::make_unique<idem::MemoryStore>();
                                        }}))

namespace {

// A store can be returned by value and kept in a container (max_records' counter moves too).
static_assert(std::is_move_constructible_v<idem::MemoryStore>);

TEST(MemoryStore, LeaseExpiryOnAFakeClockIsATakeover) {
  idem::ManualClock clock;
  idem::MemoryStoreOptions options;
  options.clock = clock.as_clock();
  idem::MemoryStore store(options);
  auto key = idem::Key::make("payment", "o1");
  auto first = idem::OwnerToken::generate();
  auto second = idem::OwnerToken::generate();
  ASSERT_EQ(idem::ClaimStatus::kClaimed,
            store.claim(key, "fp", first, std::chrono::seconds(30)).status);
  clock.advance(std::chrono::seconds(29));
  EXPECT_EQ(idem::ClaimStatus::kBusy,
            store.claim(key, "fp", second, std::chrono::seconds(30)).status);
  clock.advance(std::chrono::seconds(2));
  auto r = store.claim(key, "fp", second, std::chrono::seconds(30));
  EXPECT_EQ(idem::ClaimStatus::kClaimed, r.status);
  EXPECT_TRUE(r.took_over);
  EXPECT_FALSE(store.complete(key, first, "stale", std::chrono::seconds(60)));
  EXPECT_TRUE(store.complete(key, second, "fresh", std::chrono::seconds(60)));
  clock.advance(std::chrono::seconds(59));
  EXPECT_EQ(idem::ClaimStatus::kDone,
            store.claim(key, "fp", first, std::chrono::seconds(30)).status);
  clock.advance(std::chrono::seconds(2));
  EXPECT_EQ(idem::ClaimStatus::kClaimed,
            store.claim(key, "fp", first, std::chrono::seconds(30)).status);
}

TEST(MemoryStore, SweepsExpiredRecords) {
  idem::ManualClock clock;
  idem::MemoryStoreOptions options;
  options.clock = clock.as_clock();
  options.shards = 4;
  idem::MemoryStore store(options);
  for (int i = 0; i < 100; ++i) {
    auto key = idem::Key::make("s", "k" + std::to_string(i));
    auto o = idem::OwnerToken::generate();
    ASSERT_EQ(idem::ClaimStatus::kClaimed,
              store.claim(key, "", o, std::chrono::seconds(1)).status);
    ASSERT_TRUE(store.complete(key, o, "r", std::chrono::seconds(10)));
  }
  EXPECT_EQ(100u, store.size());
  clock.advance(std::chrono::seconds(11));
  EXPECT_EQ(100u, store.purge_expired());
  EXPECT_EQ(0u, store.size());
}

// max_records bounds what client-chosen keys may make the store hold: a new key beyond it is a
// retryable StorageUnavailable (nothing held is dropped for it), expired records make room, a
// fill is skipped, and a guard with a durable store answers the call from it alone.
TEST(MemoryStore, MaxRecordsRefusesNewKeysUntilRecordsExpire) {
  idem::ManualClock clock;
  idem::MemoryStoreOptions options;
  options.clock = clock.as_clock();
  options.shards = 1;
  options.max_records = 3;
  idem::MemoryStore store(options);
  auto key = [](int i) { return idem::Key::make("s", "k" + std::to_string(i)); };
  for (int i = 0; i < 3; ++i) {
    auto o = idem::OwnerToken::generate();
    ASSERT_EQ(idem::ClaimStatus::kClaimed,
              store.claim(key(i), "", o, std::chrono::seconds(1)).status);
    ASSERT_TRUE(store.complete(key(i), o, "r" + std::to_string(i), std::chrono::seconds(10 + i)));
  }
  auto o = idem::OwnerToken::generate();
  EXPECT_THROW(store.claim(key(3), "", o, std::chrono::seconds(1)), idem::StorageUnavailable);
  store.fill(key(4), "", "copy", std::chrono::seconds(60));
  EXPECT_FALSE(store.lookup(key(4)).has_value());
  // Keys held still answer; a release makes room.
  EXPECT_EQ("r1", store.claim(key(1), "", o, std::chrono::seconds(1)).response);
  clock.advance(std::chrono::milliseconds(10'500));  // k0 expired, k1 and k2 not
  EXPECT_EQ(idem::ClaimStatus::kClaimed,
            store.claim(key(3), "", o, std::chrono::seconds(1)).status);
  EXPECT_EQ(3u, store.size());
  EXPECT_TRUE(store.release(key(3), o));
  store.fill(key(4), "", "copy", std::chrono::seconds(60));
  EXPECT_EQ("copy", store.lookup(key(4))->response);

  idem::MemoryStoreOptions tiny;
  tiny.max_records = 1;
  idem::MemoryStore full(tiny);
  int runs = 0;
  idem::IdempotencyGuard fast_only{full};
  (void)fast_only.run(key(0), "", [&] { return std::to_string(++runs); });
  EXPECT_THROW(fast_only.run(key(1), "", [&] { return std::to_string(++runs); }),
               idem::StorageUnavailable);
  EXPECT_EQ(1, runs);
}

TEST(MemoryStore, RejectsNonPositiveDurations) {
  idem::MemoryStore store;
  auto key = idem::Key::make("s", "k");
  auto o = idem::OwnerToken::generate();
  EXPECT_THROW(store.claim(key, "", o, std::chrono::milliseconds(0)), idem::UsageError);
  ASSERT_EQ(idem::ClaimStatus::kClaimed, store.claim(key, "", o, std::chrono::seconds(1)).status);
  EXPECT_THROW(store.complete(key, o, "", std::chrono::seconds(0)), idem::UsageError);
}

}  // namespace
