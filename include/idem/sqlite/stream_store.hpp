// SPDX-License-Identifier: MIT
// idem::sqlite::ChunkStore: streamed-output chunks stored once per (request_id, chunk_offset).
//
// File: sqlite/stream_store.hpp
//
// The durable half of stream de-duplication (see idem/stream.hpp). The table
//
//   ai_stream_chunk (request_id VARCHAR(128), chunk_offset BIGINT, body BLOB,
//                    created_at BIGINT, PRIMARY KEY (request_id, chunk_offset)) WITHOUT ROWID
//
// (schema version 2, recorded in idem_schema_version as the record tables are: one b-tree keyed
// by the pair, so a row is one insert where a rowid table with a unique index takes two; a
// table of version 1, `UNIQUE (request_id, chunk_offset)` on a rowid table, created before or
// adopted by name, is used as it is) is written with `INSERT ... ON CONFLICT (request_id,
// chunk_offset) DO NOTHING`, so a server that writes a chunk twice (a retried request, two replicas
// racing) stores it once and learns which write was first (`append` answers true once). `resume`
// reads the stored chunks in offset order and returns the text up to the first hole and the offset
// to continue from: a restarted producer feeds it to ProducerDedup, a reconnecting client to
// Reassembler.
//
// The statements are plain SQL shared with PostgreSQL: only the placeholders (`?` here, `$n`
// there) and the body type (BLOB here, BYTEA there) differ, so the PostgreSQL version is the
// same class over a pqxx transaction.
//
// Header-only over idem::sqlite's Database and Transaction (link idem::sqlite).
//
// @code
//   auto db = std::make_shared<idem::sqlite::Database>("chat.db");
//   idem::sqlite::ChunkStore chunks{db};
//   auto resume = chunks.resume("chat_10001");          // after a restart
//   idem::stream::ProducerDedup producer{"chat_10001", resume.next_offset};
//   if (auto c = producer.admit(offset, text)) chunks.append("chat_10001", c->offset, c->body);
// @endcode
#pragma once

#include <cstdint>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "idem/clock.hpp"
#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/sql.hpp"
#include "idem/sqlite/sqlite_store.hpp"
#include "idem/stream.hpp"

namespace idem::sqlite {

/// Options of a ChunkStore.
struct ChunkStoreOptions {
  /// Table holding the chunks (a validated SQL identifier).
  std::string table = "ai_stream_chunk";
  /// Time source for created_at (empty means the system clock).
  Clock clock;
};

/// Where a stream stands in the durable table (idem/stream.hpp).
using StreamResume = stream::StreamResume;

/// Stores each (request_id, chunk_offset) once. Thread-safe (Database serialises writers).
class ChunkStore {
 public:
  /// Creates the table if missing (schema version 2), or adopts the existing one as it is.
  /// @throws idem::UsageError for a bad table name, idem::StorageError when SQLite fails or the
  ///         table's recorded schema version is newer than this idem's.
  explicit ChunkStore(std::shared_ptr<Database> database, ChunkStoreOptions options = {})
      : database_(std::move(database)), options_(std::move(options)) {
    if (!database_) throw UsageError("idem::sqlite::ChunkStore: null database");
    const auto& t = check_sql_identifier("table", options_.table);
    if (!options_.clock) options_.clock = system_now;
    insert_ = "INSERT INTO " + t +
              " (request_id, chunk_offset, body, created_at) VALUES (?, ?, ?, ?)"
              " ON CONFLICT (request_id, chunk_offset) DO NOTHING";
    // ?1 the request id and ?2 created_at, bound once; then offset and body of each row.
    insert_many_ = "INSERT INTO " + t + " (request_id, chunk_offset, body, created_at) VALUES ";
    for (std::size_t i = 0; i < kRowsPerInsert; ++i) {
      if (i != 0) insert_many_ += ',';
      insert_many_ +=
          "(?1,?" + std::to_string(3 + 2 * i) + ",?" + std::to_string(4 + 2 * i) + ",?2)";
    }
    insert_many_ += " ON CONFLICT (request_id, chunk_offset) DO NOTHING";
    select_ = "SELECT chunk_offset, body FROM " + t + " WHERE request_id = ? ORDER BY chunk_offset";
    count_ = "SELECT count(*) FROM " + t + " WHERE request_id = ?";
    erase_ = "DELETE FROM " + t + " WHERE request_id = ?";
    migrate();
  }

  /// Stores a chunk inside the caller's transaction (with other writes of the same commit).
  /// @return true when this call stored it, false when (request_id, offset) was stored before.
  /// @throws idem::InvalidKey for a bad request id, idem::StorageError.
  bool append(Transaction& tx, std::string_view request_id, std::uint64_t offset,
              std::string_view body) {
    Key::validate_id(request_id);
    check_chunk(offset, body.size());
    return tx.exec(insert_, request_id, static_cast<std::int64_t>(offset), Blob{body},
                   to_millis(options_.clock())) == 1;
  }

  /// Stores a chunk in its own transaction. @return as the transactional overload.
  bool append(std::string_view request_id, std::uint64_t offset, std::string_view body) {
    return database_->write([&](Transaction& tx) { return append(tx, request_id, offset, body); });
  }

  /// Stores several chunks of `request_id` inside the caller's transaction, 64 rows per
  /// statement (`INSERT ... VALUES (...), (...) ... ON CONFLICT DO NOTHING`): what a producer
  /// emitted between two commits, at about 3/4 of the cost of one append per chunk.
  /// @param tx the caller's open transaction (the guard's)
  /// @param request_id the streamed request's id
  /// @param chunks a range of elements with `offset` (unsigned) and `body` (bytes) members, as
  ///               idem::stream::Chunk
  /// @return how many were stored (the others were stored before)
  /// @throws idem::InvalidKey for a bad request id, idem::UsageError for an empty chunk
  ///         or one ending beyond BIGINT (nothing of the call is then written), idem::StorageError.
  template <class Chunks>
  std::uint64_t append_all(Transaction& tx, std::string_view request_id, const Chunks& chunks) {
    Key::validate_id(request_id);
    for (const auto& c : chunks) check_chunk(c.offset, c.body.size());
    const std::int64_t now = to_millis(options_.clock());
    std::uint64_t stored = 0;
    auto it = std::begin(chunks);
    const auto last = std::end(chunks);
    while (static_cast<std::size_t>(std::distance(it, last)) >= kRowsPerInsert) {
      Statement st = tx.prepare(insert_many_);
      st.borrow_values();  // the request id and the bodies outlive the statement's use
      st.bind(1, request_id);
      st.bind(2, now);
      for (int b = 3; b < 3 + 2 * static_cast<int>(kRowsPerInsert); b += 2, ++it) {
        st.bind(b, static_cast<std::int64_t>(it->offset));
        st.bind(b + 1, Blob{std::string_view(it->body)});
      }
      while (st.step()) {
      }
      stored += static_cast<std::uint64_t>(st.changes());
    }
    for (; it != last; ++it) {
      stored += static_cast<std::uint64_t>(tx.exec(insert_, request_id,
                                                   static_cast<std::int64_t>(it->offset),
                                                   Blob{std::string_view(it->body)}, now));
    }
    return stored;
  }

  /// The contiguous prefix stored for `request_id` and the offset to continue from.
  /// Rows that overlap the prefix (a chunk stored at other boundaries) contribute their
  /// unseen suffix only.
  StreamResume resume(std::string_view request_id) {
    Key::validate_id(request_id);
    return database_->read([&](Session& s) {
      StreamResume r;
      Statement st = s.prepare(select_);
      st.borrow_values().bind_all(request_id);  // the request id outlives the statement
      while (st.step()) {
        r.add(static_cast<std::uint64_t>(st.column_int64(0)), st.column_bytes(1));
      }
      return r;
    });
  }

  /// Rows stored for `request_id`.
  std::uint64_t count(std::string_view request_id) {
    Key::validate_id(request_id);
    return database_->read([&](Session& s) {
      return static_cast<std::uint64_t>(s.query_int64(count_, request_id).value_or(0));
    });
  }

  /// Deletes every chunk of `request_id` (the answer was delivered). @return rows deleted.
  std::uint64_t erase(std::string_view request_id) {
    Key::validate_id(request_id);
    return database_->write(
        [&](Transaction& tx) { return static_cast<std::uint64_t>(tx.exec(erase_, request_id)); });
  }

  /// The table name in use.
  const std::string& table() const noexcept { return options_.table; }

  /// The table's schema version: 2 (created by this idem: WITHOUT ROWID, keyed by
  /// (request_id, chunk_offset)) or 1 (a rowid table with a unique key on the pair, created
  /// before version 2 or adopted by name). Both are read and written the same way.
  int schema_version() const noexcept { return version_; }

  /// The schema version this idem creates.
  static constexpr int kSchemaVersion = 2;

 private:
  // Versioned and idempotent, as SqliteStore's migration: a table this idem has not recorded
  // in idem_schema_version is version 1 when it exists already (kept as it is), else it is
  // created as version 2.
  void migrate() {
    const auto& t = options_.table;
    database_->write([&](Transaction& tx) {
      tx.exec_script(
          "CREATE TABLE IF NOT EXISTS idem_schema_version ("
          " name TEXT PRIMARY KEY, version INTEGER NOT NULL, applied_at INTEGER NOT NULL)");
      auto version =
          tx.query_int64("SELECT version FROM idem_schema_version WHERE name = ?", t).value_or(0);
      if (version > kSchemaVersion) {
        throw StorageError("sqlite: chunk table '" + t + "' has schema version " +
                           std::to_string(version) + ", newer than this idem (" +
                           std::to_string(kSchemaVersion) + ")");
      }
      if (version == 0) {
        const bool exists =
            tx.query_int64("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
                           t)
                .value_or(0) > 0;
        if (exists) {
          version = 1;
        } else {
          tx.exec_script("CREATE TABLE " + t +
                         " (request_id VARCHAR(128) NOT NULL,"
                         " chunk_offset BIGINT NOT NULL CHECK (chunk_offset >= 0),"
                         " body BLOB NOT NULL,"
                         " created_at BIGINT NOT NULL,"
                         " PRIMARY KEY (request_id, chunk_offset)) WITHOUT ROWID");
          version = 2;
        }
        tx.exec(
            "INSERT OR REPLACE INTO idem_schema_version (name, version, applied_at)"
            " VALUES (?, ?, ?)",
            t, version, to_millis(options_.clock()));
      }
      version_ = static_cast<int>(version);
    });
  }

  static void check_chunk(std::uint64_t offset, std::size_t size) {
    stream::detail::check_stored_chunk("idem::sqlite::ChunkStore", offset, size);
  }

  static constexpr std::size_t kRowsPerInsert = 64;

  std::shared_ptr<Database> database_;
  ChunkStoreOptions options_;
  std::string insert_, insert_many_, select_, count_, erase_;
  int version_ = kSchemaVersion;
};

}  // namespace idem::sqlite
