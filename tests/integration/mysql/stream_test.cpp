// SPDX-License-Identifier: MIT
// idem::mysql::ChunkStore on MariaDB: the shared stream suite, and bodies that are not text.
#include <gtest/gtest.h>

#include "conformance/stream_conformance.hpp"
#include "idem/mysql/stream_store.hpp"
#include "mysql_test_support.hpp"

namespace {

namespace my = idem::test::my;

struct MysqlStreamTraits {
  using Store = idem::mysql::MysqlStore;
  using Chunks = idem::mysql::ChunkStore;
  static const char* env_var() { return "IDEM_TEST_MYSQL_URI"; }
  static std::unique_ptr<Store> make_store() { return std::make_unique<Store>(my::options()); }
  static std::unique_ptr<Chunks> make_chunks(Store& s) { return std::make_unique<Chunks>(s); }
};

}  // namespace

namespace idem::test {
using MysqlStreamTypes = ::testing::Types<MysqlStreamTraits>;
INSTANTIATE_TYPED_TEST_SUITE_P(Mysql, StreamConformance, MysqlStreamTypes);
}  // namespace idem::test

namespace {

TEST(MysqlChunkStore, EveryByteValueAndInvalidUtf8ComeBackUnchanged) {
  IDEM_REQUIRE_MYSQL();
  idem::mysql::MysqlStore store{my::options()};
  idem::mysql::ChunkStore chunks{store};
  std::string body;
  for (int i = 0; i < 256; ++i) body.push_back(static_cast<char>(i));
  body += "\xc3\x28\xed\xa0\x80\xf0\x9f\x98\x80";  // invalid UTF-8, a surrogate, an emoji
  const std::string rid = idem::test::unique_name("bytes");
  ASSERT_TRUE(chunks.append(rid, 0, body));
  EXPECT_EQ(body, chunks.resume(rid).text);
  // The bytes in the table are the bytes given (read outside idem).
  auto hex =
      my::raw().query("SELECT HEX(body) FROM ai_stream_chunk WHERE request_id = '" + rid + "'");
  ASSERT_EQ(1u, hex.size());
  EXPECT_EQ(body.size() * 2, hex[0][0]->size());
  EXPECT_THROW(idem::mysql::ChunkStore(store, {"ai_stream_chunk; DROP TABLE x", true}),
               idem::UsageError);
}

}  // namespace
