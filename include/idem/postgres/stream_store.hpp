// SPDX-License-Identifier: MIT
// idem::postgres::ChunkStore: streamed-output chunks stored once per (request_id, chunk_offset),
// on PostgreSQL.
//
// File: postgres/stream_store.hpp
//
// The PostgreSQL twin of idem::sqlite::ChunkStore (see sqlite/stream_store.hpp and
// docs/stream.md): the same table and statements, with `$n` placeholders and BYTEA bodies:
//
//   ai_stream_chunk (request_id varchar(128), chunk_offset bigint CHECK (chunk_offset >= 0),
//                    body bytea, created_at timestamptz DEFAULT now(),
//                    UNIQUE (request_id, chunk_offset))
//
//   INSERT INTO ai_stream_chunk (request_id, chunk_offset, body) VALUES ($1, $2, $3)
//     ON CONFLICT (request_id, chunk_offset) DO NOTHING
//
// A conflicting insert never aborts the caller's transaction, so `append(tx, ...)` composes
// with the guard's `pqxx::work` (the chunk commits with the idempotency record). Concurrent
// writers of the same chunk: the second waits on the unique index until the first commits,
// then inserts nothing; `append` answers true for exactly one of them. Connections come from a
// PostgresStore's pool (share the one of your record store).
//
// @code
//   idem::postgres::PostgresStore store{"postgresql://app@db/chat"};
//   idem::postgres::ChunkStore chunks{store};
//   auto r = chunks.resume("chat_10001");                   // after a restart
//   idem::stream::ProducerDedup producer{"chat_10001", r.next_offset};
//   if (auto c = producer.admit(offset, text)) chunks.append("chat_10001", c->offset, c->body);
// @endcode
#pragma once

#include <cstdint>
#include <pqxx/pqxx>
#include <string>
#include <string_view>
#include <utility>

#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "idem/sql.hpp"
#include "idem/stream.hpp"

namespace idem::postgres {

/// Options of a ChunkStore.
struct ChunkStoreOptions {
  /// Table holding the chunks (a validated SQL identifier, in the store's schema).
  std::string table = "ai_stream_chunk";
  /// Create the table if missing (under an advisory lock: concurrent processes are safe).
  bool migrate = true;
};

/// Where a stream stands in the durable table (idem/stream.hpp).
using StreamResume = stream::StreamResume;

/// Stores each (request_id, chunk_offset) once. Thread-safe (each call takes a pooled
/// connection). The store must outlive it.
class ChunkStore {
 public:
  /// @param store supplies connections (its pool) and the schema.
  /// @param options table name and whether to create it (ChunkStoreOptions)
  /// @throws idem::UsageError for a bad table name; idem::StorageError subclasses when the
  ///         table cannot be created.
  explicit ChunkStore(PostgresStore& store, ChunkStoreOptions options = {})
      : store_(store), options_(std::move(options)) {
    check_sql_identifier("table", options_.table);
    table_ = store_.options().schema + "." + options_.table;
    insert_ = "INSERT INTO " + table_ +
              " (request_id, chunk_offset, body) VALUES ($1, $2, $3)"
              " ON CONFLICT (request_id, chunk_offset) DO NOTHING";
    select_ =
        "SELECT chunk_offset, body FROM " + table_ + " WHERE request_id = $1 ORDER BY chunk_offset";
    count_ = "SELECT count(*) FROM " + table_ + " WHERE request_id = $1";
    erase_ = "DELETE FROM " + table_ + " WHERE request_id = $1";
    if (options_.migrate) {
      store_.with_transaction([&](pqxx::work& tx) {
        tx.exec("SELECT pg_advisory_xact_lock(hashtext(" + tx.quote(table_) + "))");
        tx.exec("CREATE TABLE IF NOT EXISTS " + table_ +
                " (request_id varchar(128) NOT NULL,"
                " chunk_offset bigint NOT NULL CHECK (chunk_offset >= 0),"
                " body bytea NOT NULL,"
                " created_at timestamptz NOT NULL DEFAULT now(),"
                " UNIQUE (request_id, chunk_offset))");
      });
    }
  }

  /// Stores a chunk inside the caller's transaction (e.g. the guard's `pqxx::work`).
  /// @return true when this call stored it, false when (request_id, offset) was stored before.
  /// @throws idem::InvalidKey for a bad request id, idem::UsageError for an empty chunk
  ///         or one ending beyond BIGINT; libpqxx errors of `tx` propagate (the caller's
  ///         transaction handles them).
  bool append(pqxx::work& tx, std::string_view request_id, std::uint64_t offset,
              std::string_view body) {
    Key::validate_id(request_id);
    check_chunk(offset, body.size());
    pqxx::binarystring bytes(body.data(), body.size());
    return tx.exec_params(insert_, std::string(request_id), static_cast<std::int64_t>(offset),
                          bytes)
               .affected_rows() == 1;
  }

  /// Stores several chunks of `request_id` inside the caller's transaction (one statement per
  /// chunk; the same call as idem::sqlite::ChunkStore::append_all).
  /// @param tx the caller's open transaction (the guard's)
  /// @param request_id the streamed request's id
  /// @param chunks a range of elements with `offset` and `body` members, as idem::stream::Chunk
  /// @return how many were stored (the others were stored before)
  template <class Chunks>
  std::uint64_t append_all(pqxx::work& tx, std::string_view request_id, const Chunks& chunks) {
    Key::validate_id(request_id);
    for (const auto& c : chunks) check_chunk(c.offset, c.body.size());
    std::uint64_t stored = 0;
    for (const auto& c : chunks) stored += append(tx, request_id, c.offset, c.body) ? 1 : 0;
    return stored;
  }

  /// Stores a chunk in its own transaction. @return as the transactional overload.
  /// @throws idem::StorageError subclasses.
  bool append(std::string_view request_id, std::uint64_t offset, std::string_view body) {
    Key::validate_id(request_id);
    check_chunk(offset, body.size());
    return store_.with_transaction(
        [&](pqxx::work& tx) { return append(tx, request_id, offset, body); });
  }

  /// The contiguous prefix stored for `request_id` and the offset to continue from. Rows that
  /// overlap the prefix (a chunk stored at other boundaries) contribute their unseen suffix.
  StreamResume resume(std::string_view request_id) {
    Key::validate_id(request_id);
    return store_.with_transaction([&](pqxx::work& tx) {
      StreamResume r;
      auto rows = tx.exec_params(select_, std::string(request_id));
      for (const auto& row : rows) {
        pqxx::binarystring raw(row[1]);
        r.add(static_cast<std::uint64_t>(row[0].as<std::int64_t>()), raw.str());
      }
      return r;
    });
  }

  /// Rows stored for `request_id`.
  std::uint64_t count(std::string_view request_id) {
    Key::validate_id(request_id);
    return store_.with_transaction([&](pqxx::work& tx) {
      return static_cast<std::uint64_t>(
          tx.exec_params1(count_, std::string(request_id))[0].as<std::int64_t>());
    });
  }

  /// Deletes every chunk of `request_id` (the answer was delivered). @return rows deleted.
  std::uint64_t erase(std::string_view request_id) {
    Key::validate_id(request_id);
    return store_.with_transaction([&](pqxx::work& tx) {
      const std::uint64_t rows = tx.exec_params(erase_, std::string(request_id)).affected_rows();
      return rows;
    });
  }

  /// `schema.table` in use.
  const std::string& table() const noexcept { return table_; }

 private:
  static void check_chunk(std::uint64_t offset, std::size_t size) {
    stream::detail::check_stored_chunk("idem::postgres::ChunkStore", offset, size);
  }

  PostgresStore& store_;
  ChunkStoreOptions options_;
  std::string table_, insert_, select_, count_, erase_;
};

}  // namespace idem::postgres
