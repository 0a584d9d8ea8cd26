// SPDX-License-Identifier: MIT
// idem::mysql::ChunkStore: streamed-output chunks stored once per (request_id, chunk_offset),
// on MySQL / MariaDB.
//
// File: mysql/stream_store.hpp
//
// The MySQL twin of idem::sqlite::ChunkStore (see sqlite/stream_store.hpp and docs/stream.md):
//
//   ai_stream_chunk (request_id varchar(128) ascii_bin, chunk_offset bigint, body longblob,
//                    created_at datetime(3) (UTC), UNIQUE (request_id, chunk_offset))  InnoDB
//
//   INSERT INTO ai_stream_chunk (request_id, chunk_offset, body, created_at)
//     VALUES (?, ?, ?, UTC_TIMESTAMP(3))        -- a stored chunk: error 1062, answered false
//
// MySQL has no ON CONFLICT DO NOTHING: a chunk stored before makes the INSERT fail with 1062,
// which rolls back that statement only, so `append(tx, ...)` composes with the guard's
// transaction (the chunk commits with the idempotency record). Concurrent writers of the same
// chunk: the second waits on the unique key until the first commits, then gets 1062; `append`
// answers true for exactly one of them. Bodies are bytes (bound as BLOB). Connections come from
// a MysqlStore's pool (share the one of your record store).
//
// @code
//   idem::mysql::MysqlStore store{"mysql://app:secret@db/chat"};
//   idem::mysql::ChunkStore chunks{store};
//   auto r = chunks.resume("chat_10001");                   // after a restart
//   idem::stream::ProducerDedup producer{"chat_10001", r.next_offset};
//   if (auto c = producer.admit(offset, text)) chunks.append("chat_10001", c->offset, c->body);
// @endcode
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/mysql/mysql_store.hpp"
#include "idem/sql.hpp"
#include "idem/stream.hpp"

namespace idem::mysql {

/// Options of a ChunkStore.
struct ChunkStoreOptions {
  /// Table holding the chunks (a validated SQL identifier, in the store's database).
  std::string table = "ai_stream_chunk";
  /// Create the table if missing (CREATE TABLE IF NOT EXISTS: concurrent processes are safe).
  bool migrate = true;
};

/// Where a stream stands in the durable table (idem/stream.hpp).
using StreamResume = stream::StreamResume;

/// Stores each (request_id, chunk_offset) once. Thread-safe (each call takes a pooled
/// connection). The store must outlive it.
class ChunkStore {
 public:
  /// @param store supplies connections (its pool).
  /// @param options the table and its columns
  /// @throws idem::UsageError for a bad table name; idem::StorageError subclasses when the
  ///         table cannot be created.
  explicit ChunkStore(MysqlStore& store, ChunkStoreOptions options = {})
      : store_(store), options_(std::move(options)) {
    const std::string t = "`" + check_sql_identifier("table", options_.table) + "`";
    insert_ = "INSERT INTO " + t +
              " (request_id, chunk_offset, body, created_at) VALUES (?, ?, ?, UTC_TIMESTAMP(3))";
    select_ = "SELECT chunk_offset, body FROM " + t + " WHERE request_id = ? ORDER BY chunk_offset";
    count_ = "SELECT count(*) FROM " + t + " WHERE request_id = ?";
    erase_ = "DELETE FROM " + t + " WHERE request_id = ?";
    if (options_.migrate) {
      store_.with_session([&](Session& s) {
        s.exec_text("CREATE TABLE IF NOT EXISTS " + t +
                    " (id bigint NOT NULL AUTO_INCREMENT PRIMARY KEY,"
                    " request_id varchar(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
                    " chunk_offset bigint NOT NULL,"
                    " body longblob NOT NULL,"
                    " created_at datetime(3) NOT NULL,"
                    " UNIQUE KEY uk_request_offset (request_id, chunk_offset)"
                    ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin");
      });
    }
  }

  /// Stores a chunk inside the caller's transaction (e.g. the guard's Transaction).
  /// @return true when this call stored it, false when (request_id, offset) was stored before.
  /// @throws idem::InvalidKey for a bad request id, idem::UsageError for an empty chunk
  ///         or one ending beyond BIGINT; idem::StorageError subclasses.
  bool append(Session& tx, std::string_view request_id, std::uint64_t offset,
              std::string_view body) {
    Key::validate_id(request_id);
    check_chunk(offset, body.size());
    try {
      return tx.exec(insert_, request_id, static_cast<std::int64_t>(offset), Blob{body}) == 1;
    } catch (const DuplicateKey&) {
      return false;  // stored before; only this statement was rolled back
    }
  }

  /// Stores a chunk in its own (autocommit) statement. @return as the transactional overload.
  bool append(std::string_view request_id, std::uint64_t offset, std::string_view body) {
    Key::validate_id(request_id);
    check_chunk(offset, body.size());
    return store_.with_session([&](Session& s) { return append(s, request_id, offset, body); });
  }

  /// The contiguous prefix stored for `request_id` and the offset to continue from. Rows that
  /// overlap the prefix (a chunk stored at other boundaries) contribute their unseen suffix.
  StreamResume resume(std::string_view request_id) {
    Key::validate_id(request_id);
    return store_.with_session([&](Session& s) {
      StreamResume r;
      for (const Row& row : s.query(select_, request_id)) {
        r.add(static_cast<std::uint64_t>(row[0].as_int64()), row[1].bytes());
      }
      return r;
    });
  }

  /// Rows stored for `request_id`.
  std::uint64_t count(std::string_view request_id) {
    Key::validate_id(request_id);
    return store_.with_session([&](Session& s) {
      return static_cast<std::uint64_t>(s.query_int64(count_, request_id).value_or(0));
    });
  }

  /// Deletes every chunk of `request_id` (the answer was delivered). @return rows deleted.
  std::uint64_t erase(std::string_view request_id) {
    Key::validate_id(request_id);
    return store_.with_session([&](Session& s) { return s.exec(erase_, request_id); });
  }

  /// The table in use.
  const std::string& table() const noexcept { return options_.table; }

 private:
  static void check_chunk(std::uint64_t offset, std::size_t size) {
    stream::detail::check_stored_chunk("idem::mysql::ChunkStore", offset, size);
  }

  MysqlStore& store_;
  ChunkStoreOptions options_;
  std::string insert_, select_, count_, erase_;
};

}  // namespace idem::mysql
