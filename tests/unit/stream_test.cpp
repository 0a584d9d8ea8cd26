// SPDX-License-Identifier: MIT
// Streamed output de-duplication: producer suffixes, consumer window and reassembly, durable
// chunk table (SQLite), memory caps.
#include "idem/stream.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "idem/sqlite/stream_store.hpp"
#include "support/test_env.hpp"

namespace {

using idem::stream::Admission;
using idem::stream::ChunkOverlap;
using idem::stream::ProducerDedup;
using idem::stream::Reassembler;
using idem::stream::StreamGap;
using idem::stream::Window;
using idem::stream::WindowFull;
using idem::stream::WindowOptions;

TEST(StreamChunkId, NamesRequestAndOffset) {
  EXPECT_EQ("chat_10001_0", idem::stream::chunk_id("chat_10001", 0));
  EXPECT_EQ("chat_10001_10", idem::stream::chunk_id("chat_10001", 10));
  EXPECT_THROW(idem::stream::chunk_id("", 0), idem::InvalidKey);
  EXPECT_THROW(idem::stream::chunk_id("has space", 0), idem::InvalidKey);
}

TEST(StreamProducer, EmitsEachOffsetOnce) {
  ProducerDedup p{"chat_1"};
  auto a = p.admit(0, "Hello, ");
  ASSERT_TRUE(a);
  EXPECT_EQ(0u, a->offset);
  EXPECT_EQ("Hello, ", a->body);
  EXPECT_FALSE(p.admit(0, "Hello, "));  // exact replay
  EXPECT_EQ(1u, p.duplicate_chunks());
  EXPECT_EQ(7u, p.emitted_end());
}

TEST(StreamProducer, OverlappingRetryEmitsOnlyTheSuffix) {
  ProducerDedup p{"chat_1"};
  ASSERT_TRUE(p.admit(0, "Hello, "));
  auto b = p.admit(3, "lo, world");  // retry from offset 3, other boundaries
  ASSERT_TRUE(b);
  EXPECT_EQ(7u, b->offset);
  EXPECT_EQ("world", b->body);
  EXPECT_EQ(1u, p.trimmed_chunks());
  EXPECT_EQ(4u, p.duplicate_bytes());
  EXPECT_FALSE(p.admit(5, ", wor"));  // inside what was emitted
  EXPECT_EQ(12u, p.emitted_end());
}

TEST(StreamProducer, AHoleIsAProducerBug) {
  ProducerDedup p{"chat_1"};
  ASSERT_TRUE(p.admit(0, "abc"));
  EXPECT_THROW(p.admit(4, "e"), StreamGap);
  EXPECT_EQ(3u, p.emitted_end());  // unchanged
  EXPECT_TRUE(p.admit(3, "de"));
}

TEST(StreamProducer, ResumesFromAnOffset) {
  ProducerDedup p{"chat_1", 10};
  EXPECT_FALSE(p.admit(0, "0123456789"));
  auto c = p.admit(8, "89AB");
  ASSERT_TRUE(c);
  EXPECT_EQ(10u, c->offset);
  EXPECT_EQ("AB", c->body);
}

TEST(StreamWindow, DropsReplaysInOrder) {
  Window w;
  EXPECT_TRUE(w.admit(0, 10).fresh());
  EXPECT_FALSE(w.admit(0, 10).fresh());
  EXPECT_FALSE(w.admit(3, 2).fresh());
  EXPECT_TRUE(w.admit(10, 5).whole);
  EXPECT_EQ(15u, w.watermark());
  EXPECT_EQ(2u, w.duplicates());
  EXPECT_EQ(0u, w.pending());
}

TEST(StreamWindow, OverlapYieldsTheNewPartOnly) {
  Window w;
  w.admit(0, 10);
  Admission a = w.admit(5, 10);
  EXPECT_TRUE(a.fresh());
  EXPECT_FALSE(a.whole);
  EXPECT_EQ(10u, a.begin);
  EXPECT_EQ(15u, a.end);
}

TEST(StreamWindow, ReorderingIsHeldThenMerged) {
  Window w;
  EXPECT_TRUE(w.admit(20, 5).fresh());
  EXPECT_TRUE(w.admit(10, 5).fresh());
  EXPECT_EQ(2u, w.pending());
  EXPECT_EQ(0u, w.watermark());
  EXPECT_FALSE(w.admit(20, 5).fresh());  // out-of-order replay
  EXPECT_TRUE(w.seen(21, 2));
  EXPECT_FALSE(w.seen(15, 1));
  EXPECT_TRUE(w.seen(15, 0));  // an empty range, beyond the watermark too
  EXPECT_TRUE(w.seen(100, 0));
  EXPECT_TRUE(w.admit(15, 5).fresh());  // joins the two pending intervals
  EXPECT_EQ(1u, w.pending());
  EXPECT_TRUE(w.admit(0, 10).fresh());  // closes the hole
  EXPECT_EQ(25u, w.watermark());
  EXPECT_EQ(0u, w.pending());
}

TEST(StreamWindow, GapsStayOpenUntilFilled) {
  Window w;
  w.admit(0, 1);
  w.admit(2, 1);
  w.admit(4, 1);
  EXPECT_EQ(1u, w.watermark());
  EXPECT_EQ(2u, w.pending());
  EXPECT_FALSE(w.seen(1));
  EXPECT_FALSE(w.seen(3));
  EXPECT_TRUE(w.admit(3));
  EXPECT_EQ(1u, w.pending());  // [2, 5)
  EXPECT_TRUE(w.admit(1));
  EXPECT_EQ(5u, w.watermark());
}

TEST(StreamWindow, PartialOverlapOfAPendingInterval) {
  Window w;
  w.admit(10, 10);                  // pending [10, 20)
  Admission head = w.admit(5, 10);  // [5, 15): only [5, 10) is new
  EXPECT_EQ(5u, head.begin);
  EXPECT_EQ(10u, head.end);
  Admission tail = w.admit(15, 10);  // [15, 25): only [20, 25) is new
  EXPECT_EQ(20u, tail.begin);
  EXPECT_EQ(25u, tail.end);
  EXPECT_EQ(1u, w.pending());    // merged into [5, 25)
  EXPECT_EQ(0u, w.watermark());  // which waits for [0, 5)
}

TEST(StreamWindow, TwoUnseenPiecesAreAnOverlapError) {
  Window w;
  w.admit(10, 5);  // pending [10, 15)
  EXPECT_THROW(w.admit(5, 20), ChunkOverlap);
  EXPECT_EQ(1u, w.pending());
  EXPECT_TRUE(w.admit(0, 10).fresh());  // state unchanged and usable
  EXPECT_EQ(15u, w.watermark());
}

TEST(StreamWindow, MemoryCapIsATypedError) {
  WindowOptions o;
  o.max_pending = 4;
  Window w{o};
  for (std::uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(w.admit(2 * i + 1));
  EXPECT_EQ(4u, w.pending());
  try {
    w.admit(100);
    FAIL() << "expected WindowFull";
  } catch (const WindowFull& e) {
    EXPECT_EQ(idem::errc::kInvalidArgument, e.code());
    EXPECT_NE(std::string(e.what()).find("max_pending"), std::string::npos);
  }
  EXPECT_EQ(4u, w.pending());  // unchanged
  EXPECT_TRUE(w.admit(8));     // merges with [7, 8): no new interval needed
  EXPECT_TRUE(w.admit(0));     // the watermark path never needs room
  EXPECT_EQ(2u, w.watermark());
}

TEST(StreamWindow, MaxAheadIsATypedError) {
  WindowOptions o;
  o.max_ahead = 100;
  Window w{o};
  EXPECT_THROW(w.admit(200, 1), WindowFull);
  EXPECT_EQ(0u, w.pending());
  EXPECT_TRUE(w.admit(50, 1).fresh());
  EXPECT_TRUE(w.admit(0, 50).fresh());
  EXPECT_EQ(51u, w.watermark());
  EXPECT_TRUE(w.admit(51, 1000).fresh());  // in order: never limited by max_ahead
  EXPECT_EQ(1051u, w.watermark());
  EXPECT_THROW(Window(WindowOptions{0, 1, 1}), idem::UsageError);
}

TEST(StreamWindow, RandomReplayAndReorderMatchesASetModel) {
  std::mt19937_64 rng(42);
  Window w{WindowOptions{1024, 1u << 20, 1u << 20}};
  std::vector<bool> seen(4000, false);
  std::uint64_t fresh = 0;
  for (int round = 0; round < 20000; ++round) {
    // Offsets cluster near the watermark: replays and short-range reordering.
    std::uint64_t o = w.watermark() + rng() % 24;
    o = o >= 8 ? o - 8 : o;
    if (o >= seen.size()) continue;
    bool expect_new = !seen[o];
    ASSERT_EQ(expect_new, w.admit(o)) << "offset " << o;
    seen[o] = true;
    if (expect_new) ++fresh;
  }
  std::uint64_t wm = 0;
  while (wm < seen.size() && seen[wm]) ++wm;
  EXPECT_EQ(wm, w.watermark());
  EXPECT_GT(fresh, 1000u);
}

TEST(StreamReassembler, ReassemblesAcrossReplayAndReordering) {
  Reassembler r;
  EXPECT_EQ("", r.push(5, "world"));
  EXPECT_EQ(5u, r.buffered_bytes());
  EXPECT_EQ("helloworld", r.push(0, "hello"));
  EXPECT_EQ(0u, r.buffered_bytes());
  EXPECT_EQ("", r.push(0, "hello"));
  EXPECT_EQ("!", r.push(8, "ld!"));
  EXPECT_EQ(11u, r.delivered_end());
  EXPECT_EQ(1u, r.duplicates());
}

TEST(StreamReassembler, BufferedBytesAreCapped) {
  WindowOptions o;
  o.max_buffered_bytes = 8;
  Reassembler r{o};
  EXPECT_EQ("", r.push(10, "abcdef"));
  EXPECT_THROW(r.push(20, "ghijk"), WindowFull);
  EXPECT_EQ(6u, r.buffered_bytes());
  EXPECT_EQ(1u, r.window().pending());  // the refused chunk left no trace
  EXPECT_EQ("0123456789abcdef", r.push(0, "0123456789"));
}

TEST(StreamReassembler, EndToEndWithProducerRetriesAndTransportChaos) {
  std::string text;
  for (int i = 0; i < 500; ++i) text += "token" + std::to_string(i) + ' ';
  std::mt19937 rng(7);
  // Producer: emits chunks of 1..16 bytes and sometimes retries from an earlier offset.
  ProducerDedup producer{"chat_10001"};
  std::vector<std::pair<std::uint64_t, std::string>> sent;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t from = pos;
    if (pos > 20 && rng() % 5 == 0) from = pos - rng() % 20;  // retry a range
    std::size_t len = std::min<std::size_t>(1 + rng() % 16, text.size() - from);
    if (auto c = producer.admit(from, std::string_view(text).substr(from, len))) {
      sent.emplace_back(c->offset, std::string(c->body));
      pos = c->end();
    }
  }
  EXPECT_GT(producer.duplicate_bytes(), 0u);
  // Transport: replays ranges of chunks and swaps neighbours.
  std::vector<std::pair<std::uint64_t, std::string>> wire;
  for (std::size_t i = 0; i < sent.size(); ++i) {
    wire.push_back(sent[i]);
    if (i > 3 && rng() % 7 == 0) {
      for (std::size_t j = i - 3; j <= i; ++j) wire.push_back(sent[j]);
    }
  }
  for (std::size_t i = 1; i + 1 < wire.size(); i += 9) std::swap(wire[i], wire[i + 1]);
  Reassembler client;
  std::string out;
  for (auto& [offset, body] : wire) out += client.push(offset, body);
  EXPECT_EQ(text, out);
  EXPECT_EQ(wire.size() - sent.size(), client.duplicates());
}

// --- durable table ---------------------------------------------------------------------------

class ChunkStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.file("chunks.sqlite");
    db_ = std::make_shared<idem::sqlite::Database>(path_);
  }
  idem::test::TempDir dir_;
  std::string path_;
  std::shared_ptr<idem::sqlite::Database> db_;
};

TEST_F(ChunkStoreTest, WritingAChunkTwiceStoresItOnce) {
  idem::sqlite::ChunkStore chunks{db_};
  EXPECT_TRUE(chunks.append("chat_1", 0, "Hello, "));
  EXPECT_FALSE(chunks.append("chat_1", 0, "Hello, "));
  EXPECT_TRUE(chunks.append("chat_2", 0, "Hello, "));  // another request
  EXPECT_EQ(1u, chunks.count("chat_1"));
  EXPECT_THROW(chunks.append("bad id", 0, "x"), idem::InvalidKey);
}

TEST_F(ChunkStoreTest, AppendJoinsTheCallersTransaction) {
  idem::sqlite::ChunkStore chunks{db_};
  try {
    db_->write([&](idem::sqlite::Transaction& tx) {
      chunks.append(tx, "chat_1", 0, "lost");
      throw std::runtime_error("rollback");
    });
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(0u, chunks.count("chat_1"));
}

TEST_F(ChunkStoreTest, ResumesFromTheLastContiguousOffset) {
  idem::sqlite::ChunkStore chunks{db_};
  chunks.append("chat_1", 0, "Hello");
  chunks.append("chat_1", 5, ", wor");
  chunks.append("chat_1", 14, "later");  // after a hole at [10, 14)
  auto r = chunks.resume("chat_1");
  EXPECT_EQ(10u, r.next_offset);
  EXPECT_EQ("Hello, wor", r.text);
  EXPECT_EQ(3u, r.chunks);
  EXPECT_TRUE(r.has_gap);
  EXPECT_EQ(0u, chunks.resume("chat_none").next_offset);
}

TEST_F(ChunkStoreTest, RestartedProducerContinuesWithoutDuplicates) {
  const std::string text = "The quick brown fox jumps over the lazy dog.";
  {
    idem::sqlite::ChunkStore chunks{db_};
    ProducerDedup p{"chat_9"};
    for (std::size_t off = 0; off < 20; off += 5) {
      auto c = p.admit(off, std::string_view(text).substr(off, 5));
      ASSERT_TRUE(c);
      chunks.append("chat_9", c->offset, c->body);
    }
  }  // "crash"
  db_.reset();
  db_ = std::make_shared<idem::sqlite::Database>(path_);
  idem::sqlite::ChunkStore chunks{db_};
  auto r = chunks.resume("chat_9");
  ASSERT_EQ(20u, r.next_offset);
  ProducerDedup p{"chat_9", r.next_offset};
  // The restarted generator starts over from the beginning, in chunks of 7.
  for (std::size_t off = 0; off < text.size(); off += 7) {
    auto len = std::min<std::size_t>(7, text.size() - off);
    if (auto c = p.admit(off, std::string_view(text).substr(off, len))) {
      EXPECT_TRUE(chunks.append("chat_9", c->offset, c->body)) << c->offset;
    }
  }
  auto full = chunks.resume("chat_9");
  EXPECT_EQ(text, full.text);
  EXPECT_FALSE(full.has_gap);
  // A client reconnecting at offset 20 gets the rest exactly once.
  Reassembler client{{}, 20};
  EXPECT_EQ(text.substr(20), client.push(14, full.text.substr(14)));
}

TEST_F(ChunkStoreTest, OverlappingRowsContributeTheirSuffix) {
  idem::sqlite::ChunkStore chunks{db_};
  chunks.append("chat_1", 0, "abcdef");
  chunks.append("chat_1", 3, "defgh");
  EXPECT_EQ("abcdefgh", chunks.resume("chat_1").text);
}

TEST_F(ChunkStoreTest, AppendAllStoresMany64RowsPerStatementEachOnce) {
  idem::sqlite::ChunkStore chunks{db_};
  std::string text;
  std::vector<idem::stream::Chunk> all;
  for (int i = 0; i < 150; ++i) text += "chunk" + std::to_string(i) + ';';
  for (std::size_t at = 0, n = 1; at < text.size(); at += n, n = n % 7 + 1) {
    n = std::min(n, text.size() - at);
    all.push_back({at, std::string_view(text).substr(at, n)});
  }
  ASSERT_GT(all.size(), 200u);  // three full statements and a remainder
  std::vector<idem::stream::Chunk> first(all.begin(), all.begin() + 70);
  EXPECT_EQ(70u, db_->write([&](idem::sqlite::Transaction& tx) {
    return chunks.append_all(tx, "chat_all", first);
  }));
  // Again with everything: only the 70 stored before are skipped.
  EXPECT_EQ(all.size() - 70, db_->write([&](idem::sqlite::Transaction& tx) {
    return chunks.append_all(tx, "chat_all", all);
  }));
  EXPECT_EQ(0u, db_->write([&](idem::sqlite::Transaction& tx) {
    return chunks.append_all(tx, "chat_all", all);
  }));
  EXPECT_EQ(all.size(), chunks.count("chat_all"));
  auto r = chunks.resume("chat_all");
  EXPECT_EQ(text, r.text);
  EXPECT_FALSE(r.has_gap);
  // Rolled back with the caller's transaction.
  EXPECT_THROW(db_->write([&](idem::sqlite::Transaction& tx) {
    chunks.append_all(tx, "chat_rollback", all);
    throw std::runtime_error("handler failed");
  }),
               std::runtime_error);
  EXPECT_EQ(0u, chunks.count("chat_rollback"));
  // Bad input: typed errors, nothing written.
  std::vector<idem::stream::Chunk> bad = {{0, "a"}, {std::uint64_t{1} << 63, "b"}};
  EXPECT_THROW(db_->write([&](idem::sqlite::Transaction& tx) {
    return chunks.append_all(tx, "chat_bad", bad);
  }),
               idem::UsageError);
  EXPECT_EQ(0u, chunks.count("chat_bad"));
  EXPECT_THROW(db_->write([&](idem::sqlite::Transaction& tx) {
    return chunks.append_all(tx, "bad id", first);
  }),
               idem::InvalidKey);
}

// The table's SQL as sqlite_master keeps it.
std::string table_sql(idem::sqlite::Database& db, const std::string& table) {
  return db.read([&](idem::sqlite::Session& s) {
    return s.query_text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", table)
        .value_or("");
  });
}
std::int64_t recorded_version(idem::sqlite::Database& db, const std::string& table) {
  return db.read([&](idem::sqlite::Session& s) {
    return s.query_int64("SELECT version FROM idem_schema_version WHERE name = ?", table)
        .value_or(0);
  });
}

TEST_F(ChunkStoreTest, NewTablesAreVersionTwoWithoutRowidKeyedByThePair) {
  {
    idem::sqlite::ChunkStore chunks{db_};
    EXPECT_EQ(2, chunks.schema_version());
    EXPECT_TRUE(chunks.append("chat_1", 0, "abc"));
    EXPECT_FALSE(chunks.append("chat_1", 0, "abc"));
  }
  const std::string sql = table_sql(*db_, "ai_stream_chunk");
  EXPECT_NE(std::string::npos, sql.find("PRIMARY KEY (request_id, chunk_offset)")) << sql;
  EXPECT_NE(std::string::npos, sql.find("WITHOUT ROWID")) << sql;
  EXPECT_EQ(2, recorded_version(*db_, "ai_stream_chunk"));
  // The key is the pair itself: the same offset twice is refused by SQLite too.
  EXPECT_THROW(db_->write([](idem::sqlite::Transaction& tx) {
    tx.exec(
        "INSERT INTO ai_stream_chunk (request_id, chunk_offset, body, created_at)"
        " VALUES ('chat_1', 0, x'00', 0)");
  }),
               idem::StorageError);
  idem::sqlite::ChunkStore again{db_};  // reopened: migrating again changes nothing
  EXPECT_EQ(2, again.schema_version());
  EXPECT_EQ("abc", again.resume("chat_1").text);
}

TEST_F(ChunkStoreTest, VersionOneTablesAreUsedAsTheyAre) {
  // The layout every earlier idem created, with a row written the way it wrote them.
  db_->write([](idem::sqlite::Transaction& tx) {
    tx.exec_script(
        "CREATE TABLE ai_stream_chunk (request_id VARCHAR(128) NOT NULL,"
        " chunk_offset BIGINT NOT NULL CHECK (chunk_offset >= 0), body BLOB NOT NULL,"
        " created_at BIGINT NOT NULL, UNIQUE (request_id, chunk_offset))");
    tx.exec(
        "INSERT INTO ai_stream_chunk (request_id, chunk_offset, body, created_at)"
        " VALUES (?, ?, ?, ?)",
        "chat_old", 0, idem::sqlite::Blob{"Hello, "}, 1);
  });
  const std::string before = table_sql(*db_, "ai_stream_chunk");
  idem::sqlite::ChunkStore chunks{db_};
  EXPECT_EQ(1, chunks.schema_version());
  EXPECT_EQ(1, recorded_version(*db_, "ai_stream_chunk"));
  EXPECT_EQ(before, table_sql(*db_, "ai_stream_chunk"));  // not rebuilt
  EXPECT_FALSE(chunks.append("chat_old", 0, "Hello, "));  // stored before
  EXPECT_TRUE(chunks.append("chat_old", 7, "w"));
  // 70 one-byte chunks from offset 7: one 64-row statement and single rows, the first stored.
  const std::string rest = "world" + std::string(65, '!');
  std::vector<idem::stream::Chunk> more;
  for (std::size_t i = 0; i < rest.size(); ++i)
    more.push_back({7 + i, std::string_view(rest).substr(i, 1)});
  EXPECT_EQ(69u, db_->write([&](idem::sqlite::Transaction& tx) {
    return chunks.append_all(tx, "chat_old", more);
  }));
  EXPECT_EQ("Hello, " + rest, chunks.resume("chat_old").text);
  EXPECT_EQ(71u, chunks.count("chat_old"));
  idem::sqlite::ChunkStore again{db_};  // the recorded version holds from now on
  EXPECT_EQ(1, again.schema_version());
}

// docs/versioning.md's steps for moving a version-1 chunk table to version 2.
TEST_F(ChunkStoreTest, VersionOneTableMovedToVersionTwoKeepsItsChunks) {
  db_->write([](idem::sqlite::Transaction& tx) {
    tx.exec_script(
        "CREATE TABLE ai_stream_chunk (request_id VARCHAR(128) NOT NULL,"
        " chunk_offset BIGINT NOT NULL CHECK (chunk_offset >= 0), body BLOB NOT NULL,"
        " created_at BIGINT NOT NULL, UNIQUE (request_id, chunk_offset))");
  });
  {
    idem::sqlite::ChunkStore chunks{db_};
    ASSERT_EQ(1, chunks.schema_version());
    chunks.append("chat_m", 0, "Hello, ");
    chunks.append("chat_m", 7, "world");
  }
  db_->write([](idem::sqlite::Transaction& tx) {
    tx.exec_script(
        "CREATE TABLE ai_stream_chunk_v2 (request_id VARCHAR(128) NOT NULL,"
        "  chunk_offset BIGINT NOT NULL CHECK (chunk_offset >= 0), body BLOB NOT NULL,"
        "  created_at BIGINT NOT NULL,"
        "  PRIMARY KEY (request_id, chunk_offset)) WITHOUT ROWID;"
        "INSERT INTO ai_stream_chunk_v2"
        "  SELECT request_id, chunk_offset, body, created_at FROM ai_stream_chunk;"
        "DROP TABLE ai_stream_chunk;"
        "ALTER TABLE ai_stream_chunk_v2 RENAME TO ai_stream_chunk;"
        "UPDATE idem_schema_version SET version = 2 WHERE name = 'ai_stream_chunk';");
  });
  idem::sqlite::ChunkStore chunks{db_};
  EXPECT_EQ(2, chunks.schema_version());
  EXPECT_NE(std::string::npos, table_sql(*db_, "ai_stream_chunk").find("WITHOUT ROWID"));
  EXPECT_FALSE(chunks.append("chat_m", 7, "world"));
  EXPECT_TRUE(chunks.append("chat_m", 12, "!"));
  EXPECT_EQ("Hello, world!", chunks.resume("chat_m").text);
}

TEST_F(ChunkStoreTest, ANewerRecordedVersionIsRefused) {
  { idem::sqlite::ChunkStore chunks{db_}; }
  db_->write([](idem::sqlite::Transaction& tx) {
    tx.exec("UPDATE idem_schema_version SET version = 3 WHERE name = 'ai_stream_chunk'");
  });
  EXPECT_THROW(idem::sqlite::ChunkStore{db_}, idem::StorageError);
}

TEST_F(ChunkStoreTest, RejectsABadTableName) {
  idem::sqlite::ChunkStoreOptions o;
  o.table = "x; DROP TABLE y";
  EXPECT_THROW(idem::sqlite::ChunkStore(db_, o), idem::UsageError);
}

}  // namespace
