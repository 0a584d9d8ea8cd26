// SPDX-License-Identifier: MIT
// The chats of examples/ai_chat on SQLite: one row per chat (its generation state) and the
// chunk table idem::sqlite::ChunkStore (`unique (request_id, chunk_offset)`). Several server
// processes share one database file.
//
// Generation is a small state machine on the chat row, with an owner token and a lease, as
// idem's records have:
//
//   pending --claim--> generating (owner, lease_until) --finish--> done (length)
//                         ^    |
//                         +----+ claim again once the lease ended (the owner process died)
//
// Chunks are appended in the same write transaction as a conditional UPDATE that renews the
// lease only while the writer still owns it, so an owner that lost its lease (stalled, then
// taken over) can never write another chunk: one writer at a time, and a new owner resumes
// from the stored contiguous prefix.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/clock.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "idem/sqlite/stream_store.hpp"

namespace ai_chat {

/// A chat as stored.
struct ChatRecord {
  std::string request_id;
  std::string prompt;
  /// Requested answer length (bytes, at most).
  std::uint64_t length = 0;
  /// Whether the generator retries ranges (overlapping output).
  bool retries = false;
  /// "pending", "generating" or "done".
  std::string status;
  /// Owner token of the generating process ("" unless generating).
  std::string owner;
  /// End of the owner's lease (epoch milliseconds).
  std::int64_t lease_until_ms = 0;
  /// Length of the finished answer (when done).
  std::uint64_t answer_length = 0;
  /// Times a process claimed the generation (1 normally; more after takeovers).
  std::int64_t generations = 0;
};

/// A stored chunk.
struct StoredChunk {
  std::uint64_t offset = 0;
  std::string body;
};

inline std::int64_t now_ms() { return idem::to_millis(idem::system_now()); }

/// The chats table and the chunk table on one SQLite database. Thread-safe.
class SqliteChats {
 public:
  /// The guard's transaction, in which `create` runs.
  using Transaction = idem::sqlite::Transaction;

  explicit SqliteChats(std::shared_ptr<idem::sqlite::Database> db)
      : db_(std::move(db)), chunks_(db_) {
    db_->write([](Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE IF NOT EXISTS ai_chat ("
          " id INTEGER PRIMARY KEY AUTOINCREMENT,"
          " request_id TEXT UNIQUE,"
          " principal TEXT NOT NULL,"
          " prompt TEXT NOT NULL,"
          " length INTEGER NOT NULL,"
          " retries INTEGER NOT NULL,"
          " status TEXT NOT NULL DEFAULT 'pending',"
          " owner TEXT NOT NULL DEFAULT '',"
          " lease_until INTEGER NOT NULL DEFAULT 0,"
          " answer_length INTEGER NOT NULL DEFAULT 0,"
          " generations INTEGER NOT NULL DEFAULT 0,"
          " created_at INTEGER NOT NULL)");
    });
    tail_ = "SELECT chunk_offset, body FROM " + chunks_.table() +
            " WHERE request_id = ? AND chunk_offset > ? ORDER BY chunk_offset LIMIT ?";
    head_ = "SELECT chunk_offset, body FROM " + chunks_.table() +
            " WHERE request_id = ? AND chunk_offset <= ? ORDER BY chunk_offset DESC LIMIT ?";
  }

  /// Inserts a pending chat in `tx` (the guard's transaction): request id `chat_<10000 + n>`.
  ChatRecord create(Transaction& tx, const std::string& principal, const std::string& prompt,
                    std::uint64_t length, bool retries) {
    tx.exec(
        "INSERT INTO ai_chat (principal, prompt, length, retries, created_at)"
        " VALUES (?, ?, ?, ?, ?)",
        principal, prompt, static_cast<std::int64_t>(length), retries ? 1 : 0, now_ms());
    auto id = tx.query_int64("SELECT last_insert_rowid()").value_or(0);
    ChatRecord c;
    c.request_id = "chat_" + std::to_string(10000 + id);
    tx.exec("UPDATE ai_chat SET request_id = ? WHERE id = ?", c.request_id, id);
    c.prompt = prompt;
    c.length = length;
    c.retries = retries;
    c.status = "pending";
    return c;
  }

  /// The chat, or nullopt.
  std::optional<ChatRecord> find(std::string_view request_id) {
    return db_->read([&](idem::sqlite::Session& s) -> std::optional<ChatRecord> {
      auto st = s.prepare(
          "SELECT request_id, prompt, length, retries, status, owner, lease_until,"
          " answer_length, generations FROM ai_chat WHERE request_id = ?");
      st.bind_all(request_id);
      if (!st.step()) return std::nullopt;
      ChatRecord c;
      c.request_id = st.column_bytes(0);
      c.prompt = st.column_bytes(1);
      c.length = static_cast<std::uint64_t>(st.column_int64(2));
      c.retries = st.column_int64(3) != 0;
      c.status = st.column_bytes(4);
      c.owner = st.column_bytes(5);
      c.lease_until_ms = st.column_int64(6);
      c.answer_length = static_cast<std::uint64_t>(st.column_int64(7));
      c.generations = st.column_int64(8);
      return c;
    });
  }

  /// Claims the generation for `owner` when the chat is pending, or generating under a lease
  /// that ended. @return true when this call claimed it (one conditional UPDATE).
  bool claim(std::string_view request_id, const std::string& owner,
             std::chrono::milliseconds lease) {
    const std::int64_t now = now_ms();
    return db_->write([&](Transaction& tx) {
      return tx.exec(
                 "UPDATE ai_chat SET status = 'generating', owner = ?, lease_until = ?,"
                 " generations = generations + 1 WHERE request_id = ? AND"
                 " (status = 'pending' OR (status = 'generating' AND lease_until < ?))",
                 owner, now + lease.count(), request_id, now) == 1;
    });
  }

  /// Appends chunks while `owner` holds the generation, renewing its lease, in one transaction.
  /// @return false when the lease was lost (nothing written).
  bool append(std::string_view request_id, const std::string& owner,
              std::chrono::milliseconds lease, const std::vector<StoredChunk>& batch) {
    return db_->write([&](Transaction& tx) {
      if (tx.exec("UPDATE ai_chat SET lease_until = ? WHERE request_id = ? AND owner = ?"
                  " AND status = 'generating'",
                  now_ms() + lease.count(), request_id, owner) != 1) {
        return false;
      }
      chunks_.append_all(tx, request_id, batch);
      return true;
    });
  }

  /// Marks the answer complete (`length` bytes). @return false when the lease was lost.
  bool finish(std::string_view request_id, const std::string& owner, std::uint64_t length) {
    return db_->write([&](Transaction& tx) {
      return tx.exec(
                 "UPDATE ai_chat SET status = 'done', owner = '', answer_length = ?"
                 " WHERE request_id = ? AND owner = ? AND status = 'generating'",
                 static_cast<std::int64_t>(length), request_id, owner) == 1;
    });
  }

  /// Up to `limit` chunks after the chunk at `after` (all from the start when nullopt), in
  /// offset order.
  std::vector<StoredChunk> after(std::string_view request_id, std::optional<std::uint64_t> after,
                                 std::size_t limit) {
    return db_->read([&](idem::sqlite::Session& s) {
      auto st = s.prepare(tail_);
      st.bind_all(request_id, after ? static_cast<std::int64_t>(*after) : std::int64_t{-1},
                  static_cast<std::int64_t>(limit));
      return rows(st);
    });
  }

  /// The last `count` chunks at or before offset `upto`, in offset order (for replays).
  std::vector<StoredChunk> last_until(std::string_view request_id, std::uint64_t upto,
                                      std::size_t count) {
    auto out = db_->read([&](idem::sqlite::Session& s) {
      auto st = s.prepare(head_);
      st.bind_all(request_id, static_cast<std::int64_t>(upto), static_cast<std::int64_t>(count));
      return rows(st);
    });
    std::reverse(out.begin(), out.end());
    return out;
  }

  /// Where a new owner continues: the end of the stored contiguous prefix.
  std::uint64_t resume_offset(std::string_view request_id) {
    return chunks_.resume(request_id).next_offset;
  }

  /// Stored chunk rows of a chat.
  std::uint64_t chunk_count(std::string_view request_id) { return chunks_.count(request_id); }

 private:
  static std::vector<StoredChunk> rows(idem::sqlite::Statement& st) {
    std::vector<StoredChunk> out;
    while (st.step()) {
      out.push_back({static_cast<std::uint64_t>(st.column_int64(0)), st.column_bytes(1)});
    }
    return out;
  }

  std::shared_ptr<idem::sqlite::Database> db_;
  idem::sqlite::ChunkStore chunks_;
  std::string tail_, head_;
};

}  // namespace ai_chat
