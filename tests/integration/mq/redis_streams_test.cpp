// SPDX-License-Identifier: MIT
// idem::mq::RedisStreams against a real redis-server: groups, reads, acks, takeover, errors.
#include "idem/mq/redis_streams.hpp"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <type_traits>

#include "idem/errors.hpp"
#include "idem/redis/redis_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::mq::RedisStreams;

class RedisStreamsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    IDEM_REQUIRE_ENV(url_, "IDEM_TEST_REDIS_URL");
    redis_ = std::make_unique<RedisStreams>(idem::mq::RedisStreamsOptions{url_});
    stream_ = idem::test::unique_name("idem-test:mq");
  }
  void TearDown() override {
    if (redis_) redis_->del(stream_);
  }
  std::string url_;
  std::string stream_;
  std::unique_ptr<RedisStreams> redis_;
};

TEST_F(RedisStreamsTest, GroupReadAckRoundTrip) {
  EXPECT_TRUE(redis_->create_group(stream_, "g"));
  EXPECT_FALSE(redis_->create_group(stream_, "g"));  // exists
  auto ids = redis_->add_many(stream_, {{{"message_id", "m1"}, {"body", std::string("a\0b", 3)}},
                                        {{"message_id", "m2"}, {"body", "x"}}});
  ASSERT_EQ(2u, ids.size());
  EXPECT_EQ(2u, redis_->length(stream_));
  auto batch = redis_->read_group(stream_, "g", "c1", 10, std::nullopt);
  ASSERT_EQ(2u, batch.size());
  EXPECT_EQ(ids[0], batch[0].id);
  EXPECT_EQ("m1", *batch[0].find("message_id"));
  EXPECT_EQ(std::string("a\0b", 3), *batch[0].find("body"));  // binary safe
  EXPECT_EQ(nullptr, batch[0].find("missing"));
  EXPECT_EQ(1u, batch[0].delivery_count);
  EXPECT_EQ(2u, redis_->pending(stream_, "g").of("c1"));
  EXPECT_EQ(2u, redis_->ack(stream_, "g", {batch[0].id, batch[1].id}));
  EXPECT_EQ(0u, redis_->pending(stream_, "g").count);
  EXPECT_TRUE(redis_->read_group(stream_, "g", "c1", 10, std::nullopt).empty());
  EXPECT_TRUE(
      redis_->read_group(stream_, "g", "c1", 10, std::chrono::milliseconds(50)).empty());
}

TEST_F(RedisStreamsTest, AutoClaimTakesOverIdleEntriesWithDeliveryCounts) {
  redis_->create_group(stream_, "g");
  redis_->add(stream_, {{"message_id", "m1"}});
  redis_->add(stream_, {{"message_id", "m2"}});
  auto first = redis_->read_group(stream_, "g", "dead-consumer", 10, std::nullopt);
  ASSERT_EQ(2u, first.size());
  // Not idle long enough yet: nothing to claim.
  EXPECT_TRUE(redis_->auto_claim(stream_, "g", "c2", std::chrono::seconds(60)).entries.empty());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  auto c = redis_->auto_claim(stream_, "g", "c2", std::chrono::milliseconds(20));
  ASSERT_EQ(2u, c.entries.size());
  EXPECT_EQ("m1", *c.entries[0].find("message_id"));
  EXPECT_EQ(2u, c.entries[0].delivery_count);
  EXPECT_EQ("0-0", c.next_start);
  EXPECT_EQ(0u, redis_->pending(stream_, "g").of("dead-consumer"));
  EXPECT_EQ(2u, redis_->pending(stream_, "g").of("c2"));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  auto again = redis_->auto_claim(stream_, "g", "c3", std::chrono::milliseconds(20));
  ASSERT_EQ(2u, again.entries.size());
  EXPECT_EQ(3u, again.entries[1].delivery_count);
}

TEST_F(RedisStreamsTest, ReplyErrorsAreStorageErrors) {
  try {
    redis_->read_group(stream_, "no-such-group", "c", 1, std::nullopt);
    FAIL() << "expected NOGROUP";
  } catch (const idem::StorageError& e) {
    EXPECT_EQ(idem::errc::kStorageError, e.code());
    EXPECT_NE(std::string(e.what()).find("NOGROUP"), std::string::npos);
  }
  redis_->ping();  // the connection is still usable
}

TEST(RedisStreamsConnect, UnreachableServerIsStorageUnavailable) {
  idem::mq::RedisStreamsOptions o;
  o.uri = "redis://127.0.0.1:1";  // nothing listens on port 1
  o.connect_timeout = std::chrono::milliseconds(200);
  RedisStreams redis{o};  // connects lazily: a consumer may start while Redis is down
  EXPECT_THROW(redis.ping(), idem::StorageUnavailable);
  EXPECT_THROW(redis.read_group("s", "g", "c", 1, std::nullopt), idem::StorageUnavailable);
  o.uri = "redis://127.0.0.1:notaport";
  EXPECT_THROW(RedisStreams{o}, idem::UsageError);
}

// The URI alone constructs a RedisStreams, as it does a RedisStore (docs/mq.md).
TEST(RedisStreamsConnect, ConstructedFromAUriLikeRedisStore) {
  static_assert(std::is_constructible_v<RedisStreams, const char*>);
  static_assert(std::is_constructible_v<RedisStreams, std::string>);
  static_assert(std::is_constructible_v<idem::redis::RedisStore, const char*>);
  static_assert(!std::is_convertible_v<const char*, RedisStreams>);  // explicit, as RedisStore
  static_assert(std::is_constructible_v<RedisStreams, std::string_view>);
  RedisStreams redis{"redis://127.0.0.1:1"};
  EXPECT_THROW(redis.ping(), idem::StorageUnavailable);
  EXPECT_THROW(RedisStreams{"redis://127.0.0.1:notaport"}, idem::UsageError);
  // The earlier spelling, options built from the URI, still compiles and means the same.
  const std::string uri = "redis://127.0.0.1:1";
  RedisStreams from_options{{uri}};
  EXPECT_THROW(from_options.ping(), idem::StorageUnavailable);
  RedisStreams from_literal{{"redis://127.0.0.1:1"}};
  EXPECT_THROW(from_literal.ping(), idem::StorageUnavailable);
}

}  // namespace
