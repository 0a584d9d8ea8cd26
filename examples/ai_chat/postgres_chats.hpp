// SPDX-License-Identifier: MIT
// The chats of examples/ai_chat on PostgreSQL: the same calls, state machine and fencing as
// SqliteChats (see sqlite_chats.hpp), over idem::postgres::ChunkStore and a `<schema>.ai_chat`
// table. Connections come from the PostgresStore's pool; `create` runs in the guard's
// pqxx::work, so the chat row commits with the idempotency record.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <pqxx/pqxx>
#include <string>
#include <string_view>
#include <vector>

#include "idem/postgres/postgres_store.hpp"
#include "idem/postgres/stream_store.hpp"
#include "sqlite_chats.hpp"  // ChatRecord, StoredChunk, now_ms

namespace ai_chat {

/// The chats table and the chunk table on PostgreSQL, in the store's schema. Thread-safe.
class PostgresChats {
 public:
  /// The guard's transaction, in which `create` runs.
  using Transaction = pqxx::work;

  explicit PostgresChats(idem::postgres::PostgresStore& store)
      : store_(store), chunks_(store), table_(store.options().schema + ".ai_chat") {
    store_.with_transaction([&](pqxx::work& tx) {
      // Two processes starting at once must not race on CREATE TABLE IF NOT EXISTS.
      tx.exec("SELECT pg_advisory_xact_lock(hashtext(" + tx.quote(table_) + "))");
      tx.exec("CREATE TABLE IF NOT EXISTS " + table_ +
              " (id bigserial PRIMARY KEY,"
              " request_id varchar(128) UNIQUE,"
              " principal text NOT NULL,"
              " prompt text NOT NULL,"
              " length bigint NOT NULL,"
              " retries boolean NOT NULL,"
              " status varchar(16) NOT NULL DEFAULT 'pending',"
              " owner text NOT NULL DEFAULT '',"
              " lease_until bigint NOT NULL DEFAULT 0,"
              " answer_length bigint NOT NULL DEFAULT 0,"
              " generations bigint NOT NULL DEFAULT 0,"
              " created_at timestamptz NOT NULL DEFAULT now())");
    });
    tail_ = "SELECT chunk_offset, body FROM " + chunks_.table() +
            " WHERE request_id = $1 AND chunk_offset > $2 ORDER BY chunk_offset LIMIT $3";
    head_ = "SELECT chunk_offset, body FROM " + chunks_.table() +
            " WHERE request_id = $1 AND chunk_offset <= $2 ORDER BY chunk_offset DESC LIMIT $3";
  }

  /// Inserts a pending chat in `tx` (the guard's transaction): request id `chat_<10000 + n>`.
  ChatRecord create(pqxx::work& tx, const std::string& principal, const std::string& prompt,
                    std::uint64_t length, bool retries) {
    auto row = tx.exec_params1("INSERT INTO " + table_ +
                                   " (request_id, principal, prompt, length, retries)"
                                   " SELECT 'chat_' || (10000 + n), $1, $2, $3, $4 FROM"
                                   " (SELECT nextval(pg_get_serial_sequence(" +
                                   tx.quote(table_) + ", 'id')) AS n) s RETURNING request_id",
                               principal, prompt, static_cast<std::int64_t>(length), retries);
    ChatRecord c;
    c.request_id = row[0].as<std::string>();
    c.prompt = prompt;
    c.length = length;
    c.retries = retries;
    c.status = "pending";
    return c;
  }

  /// The chat, or nullopt.
  std::optional<ChatRecord> find(std::string_view request_id) {
    return store_.with_transaction([&](pqxx::work& tx) -> std::optional<ChatRecord> {
      auto r = tx.exec_params(
          "SELECT request_id, prompt, length, retries, status, owner, lease_until,"
          " answer_length, generations FROM " +
              table_ + " WHERE request_id = $1",
          std::string(request_id));
      if (r.empty()) return std::nullopt;
      ChatRecord c;
      c.request_id = r[0][0].as<std::string>();
      c.prompt = r[0][1].as<std::string>();
      c.length = r[0][2].as<std::uint64_t>();
      c.retries = r[0][3].as<bool>();
      c.status = r[0][4].as<std::string>();
      c.owner = r[0][5].as<std::string>();
      c.lease_until_ms = r[0][6].as<std::int64_t>();
      c.answer_length = r[0][7].as<std::uint64_t>();
      c.generations = r[0][8].as<std::int64_t>();
      return c;
    });
  }

  /// As SqliteChats::claim.
  bool claim(std::string_view request_id, const std::string& owner,
             std::chrono::milliseconds lease) {
    const std::int64_t now = now_ms();
    return store_.with_transaction([&](pqxx::work& tx) {
      return tx.exec_params("UPDATE " + table_ +
                                " SET status = 'generating', owner = $1, lease_until = $2,"
                                " generations = generations + 1 WHERE request_id = $3 AND"
                                " (status = 'pending' OR (status = 'generating' AND"
                                " lease_until < $4))",
                            owner, now + lease.count(), std::string(request_id), now)
                 .affected_rows() == 1;
    });
  }

  /// As SqliteChats::append: the lease renewal (WHERE owner = $n) and the chunks commit
  /// together, and the row lock of the UPDATE orders this writer against a takeover.
  bool append(std::string_view request_id, const std::string& owner,
              std::chrono::milliseconds lease, const std::vector<StoredChunk>& batch) {
    return store_.with_transaction([&](pqxx::work& tx) {
      if (tx.exec_params("UPDATE " + table_ +
                             " SET lease_until = $1 WHERE request_id = $2 AND owner = $3"
                             " AND status = 'generating'",
                         now_ms() + lease.count(), std::string(request_id), owner)
              .affected_rows() != 1) {
        return false;
      }
      chunks_.append_all(tx, request_id, batch);
      return true;
    });
  }

  /// As SqliteChats::finish.
  bool finish(std::string_view request_id, const std::string& owner, std::uint64_t length) {
    return store_.with_transaction([&](pqxx::work& tx) {
      return tx.exec_params("UPDATE " + table_ +
                                " SET status = 'done', owner = '', answer_length = $1"
                                " WHERE request_id = $2 AND owner = $3 AND status = 'generating'",
                            static_cast<std::int64_t>(length), std::string(request_id), owner)
                 .affected_rows() == 1;
    });
  }

  /// As SqliteChats::after.
  std::vector<StoredChunk> after(std::string_view request_id, std::optional<std::uint64_t> after,
                                 std::size_t limit) {
    return query(tail_, request_id, after ? static_cast<std::int64_t>(*after) : std::int64_t{-1},
                 limit);
  }

  /// As SqliteChats::last_until.
  std::vector<StoredChunk> last_until(std::string_view request_id, std::uint64_t upto,
                                      std::size_t count) {
    auto out = query(head_, request_id, static_cast<std::int64_t>(upto), count);
    std::reverse(out.begin(), out.end());
    return out;
  }

  /// As SqliteChats::resume_offset.
  std::uint64_t resume_offset(std::string_view request_id) {
    return chunks_.resume(request_id).next_offset;
  }

  /// Stored chunk rows of a chat.
  std::uint64_t chunk_count(std::string_view request_id) { return chunks_.count(request_id); }

 private:
  std::vector<StoredChunk> query(const std::string& sql, std::string_view request_id,
                                 std::int64_t offset, std::size_t limit) {
    return store_.with_transaction([&](pqxx::work& tx) {
      std::vector<StoredChunk> out;
      for (const auto& row :
           tx.exec_params(sql, std::string(request_id), offset, static_cast<std::int64_t>(limit))) {
        pqxx::binarystring body(row[1]);
        out.push_back({row[0].as<std::uint64_t>(), body.str()});
      }
      return out;
    });
  }

  idem::postgres::PostgresStore& store_;
  idem::postgres::ChunkStore chunks_;
  std::string table_, tail_, head_;
};

}  // namespace ai_chat
