// SPDX-License-Identifier: MIT
// idem::IdempotentConsumer: apply each MQ message's effect once, whatever the broker redelivers.
//
// File: consumer.hpp
//
// Brokers deliver at least once: a consumer that dies before its ack, an ack lost on the wire,
// a rebalance, or a producer that retried its publish all hand the same message to a consumer
// again. `consume` runs the handler through an IdempotencyGuard keyed
// (consumer group, message id) and tells the loop what to do with the delivery:
//
//   Verdict          meaning                                           the loop should
//   kAck             the handler ran now and committed                  ack
//   kAckDuplicate    consumed before (or dead-lettered before)          ack, nothing ran
//   kRetryLater      another consumer is on it right now, or the        not ack: the broker
//                    handler failed and attempts are left               redelivers it
//   kMismatch        same message id, different payload fingerprint:    park it (e.g. a parking
//                    a producer bug; nothing ran                        stream), then ack
//   kDeadLetter      a poison message: the handler failed               ack (the sink has it)
//                    `max_attempts` times; the dead-letter sink got it
//
// With a durable store the consume record lives in `mq_consume_record (message_id,
// consumer_group)` (SqliteStoreOptions::mq_consume_record(), GuardOptions::durable_source =
// DuplicateSource::kMqRecord) and a transactional handler `handler(Transaction&)` commits its
// business writes in the same transaction as the record: exactly-once effect for database-local
// side effects, also when the fast store (Redis) is down or lost the claim.
//
// Poison messages: each failed attempt is counted in an AttemptLedger. With a durable ledger
// (idem::sqlite::SqliteAttemptLedger) the count survives consumer restarts and is shared by the
// consumers of a group. When it reaches `max_attempts`, the consumer claims the record, hands
// the message to the dead-letter sink, and then marks the record failed; every later delivery
// of that message answers kAckDuplicate. If the sink throws, the claim is released, the
// exception propagates and the message stays with the broker.
//
// Redeliveries: a delivery whose broker delivery count is above 1 (Delivery::delivery_count,
// e.g. a message taken over with XAUTOCLAIM) is counted in ConsumerStats::redeliveries.
// Producer duplicates (same message id, new broker entry) are counted as duplicates instead.
//
// @code
//   idem::MemoryStore fast;
//   idem::sqlite::SqliteStore durable{"billing.db",
//   idem::sqlite::SqliteStoreOptions::mq_consume_record()}; idem::GuardOptions go;
//   go.durable_source = idem::DuplicateSource::kMqRecord;
//   idem::IdempotencyGuard guard{fast, durable, go};
//   idem::ConsumerOptions co;
//   co.attempts = std::make_shared<idem::sqlite::SqliteAttemptLedger>(durable.shared_database());
//   co.dead_letter = [&](const idem::DeadLetter& d) { dead_stream.add(d.message_id, d.payload); };
//   idem::IdempotentConsumer consumer{guard, "billing-consumer", co};
//   for (auto& msg : stream.read_group(batch)) {
//     auto verdict = consumer.consume({msg.id, idem::fingerprint(msg.body), msg.body},
//                                     [&](idem::sqlite::Transaction& tx) { apply(tx, msg); });
//     if (idem::should_ack(verdict)) stream.ack(msg.entry_id);
//   }
// @endcode
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/guard.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"

namespace idem {

/// What a consumer loop should do with a delivery (see the table in consumer.hpp).
enum class Verdict {
  kAck,           ///< the handler ran now and committed: ack
  kAckDuplicate,  ///< consumed (or dead-lettered) before; nothing ran: ack
  kRetryLater,    ///< in progress elsewhere, or failed with attempts left: do not ack
  kMismatch,      ///< same id, different payload (producer bug): park it, do not ack as done
  kDeadLetter,    ///< poison: handed to the dead-letter sink and recorded as failed: ack
};

/// Stable name: ack, ack_duplicate, retry_later, mismatch, dead_letter.
constexpr std::string_view verdict_name(Verdict v) noexcept {
  switch (v) {
    case Verdict::kAck: return "ack";
    case Verdict::kAckDuplicate: return "ack_duplicate";
    case Verdict::kRetryLater: return "retry_later";
    case Verdict::kMismatch: return "mismatch";
    case Verdict::kDeadLetter: return "dead_letter";
  }
  return "unknown";
}

/// True for the verdicts after which the broker entry may be acked right away (kAck,
/// kAckDuplicate, kDeadLetter). kMismatch is acked only after the message was parked.
constexpr bool should_ack(Verdict v) noexcept {
  return v == Verdict::kAck || v == Verdict::kAckDuplicate || v == Verdict::kDeadLetter;
}

/// One delivery of a message, as the consumer loop got it from the broker. The views are not
/// owned: consume / consume_batch copy the message id (into the key) and the fingerprint
/// before any handler runs, so a handler that rewrites those bytes changes nothing the records
/// store; the payload is read when a message is dead-lettered, so it must stay valid until
/// the call returns.
struct Delivery {
  /// The message's global id (not the broker's entry id): a producer retry keeps it. When the
  /// message has none, build one with idem::make_message_id(biz_no, event_type, version).
  std::string_view message_id;
  /// idem::fingerprint(payload), or "" to skip the payload check.
  std::string_view fingerprint;
  /// The payload, handed to the dead-letter sink (may be empty).
  std::string_view payload = {};
  /// The broker's delivery count (1 for a first delivery); above 1 counts as a redelivery.
  std::uint32_t delivery_count = 1;
};

/// A poison message, as the dead-letter sink receives it.
struct DeadLetter {
  /// The consumer group that gave up on the message.
  std::string group;
  /// The message's global id.
  std::string message_id;
  /// The payload as delivered (Delivery::payload).
  std::string payload;
  /// The last failure's what().
  std::string error;
  /// Failed attempts counted (>= max_attempts, or 0 for an invalid message id).
  std::uint32_t attempts = 0;
};

/// Counts failed attempts per message. Implementations must be thread-safe.
/// MemoryAttemptLedger forgets on restart; idem::sqlite::SqliteAttemptLedger does not.
class AttemptLedger {
 public:
  virtual ~AttemptLedger() = default;
  /// Adds one failure of `key` with its error. @return the failures counted so far (>= 1).
  virtual std::uint32_t record_failure(const Key& key, std::string_view error) = 0;
  /// Failures counted for `key` (0 when none).
  virtual std::uint32_t failures(const Key& key) = 0;
  /// Forgets `key` (after it succeeded or was dead-lettered).
  virtual void clear(const Key& key) = 0;
};

/// In-process AttemptLedger: counts are lost when the consumer restarts (a poison message then
/// gets up to max_attempts more tries). Use a durable ledger in production.
class MemoryAttemptLedger final : public AttemptLedger {
 public:
  /// Adds one failure of `key`. @return the failures counted so far.
  std::uint32_t record_failure(const Key& key, std::string_view) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return ++counts_[key.str()];
  }
  /// Failures counted for `key`.
  std::uint32_t failures(const Key& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = counts_.find(key.str());
    return it == counts_.end() ? 0 : it->second;
  }
  /// Forgets `key`.
  void clear(const Key& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    counts_.erase(key.str());
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, std::uint32_t> counts_;
};

/// Options of an IdempotentConsumer.
struct ConsumerOptions {
  /// Failed attempts after which a message is dead-lettered. Must be positive.
  std::uint32_t max_attempts = 5;
  /// Receives poison messages (and messages whose id is not a valid key). Called before the
  /// record is marked failed; if it throws, the message stays with the broker. May be empty.
  std::function<void(const DeadLetter&)> dead_letter;
  /// Where failed attempts are counted; null means a MemoryAttemptLedger.
  std::shared_ptr<AttemptLedger> attempts;
};

/// A snapshot of a consumer's counters.
struct ConsumerStatsSnapshot {
  std::uint64_t deliveries = 0;      ///< consume calls
  std::uint64_t acked = 0;           ///< kAck
  std::uint64_t duplicates = 0;      ///< kAckDuplicate
  std::uint64_t retry_later = 0;     ///< kRetryLater (busy or failed with attempts left)
  std::uint64_t mismatched = 0;      ///< kMismatch
  std::uint64_t dead_lettered = 0;   ///< kDeadLetter
  std::uint64_t failures = 0;        ///< handler exceptions
  std::uint64_t redeliveries = 0;    ///< deliveries with delivery_count > 1
  /// consume_batch transactions run a second time, with a savepoint per message, because a
  /// handler failed (or a record was locked elsewhere) in the first, savepoint-free run
  std::uint64_t batch_reruns = 0;
  /// consume_batch transactions run again with the tolerant record insert because the plain
  /// one (PostgreSQL, all claims fresh in the fast store) found a record of one of the keys
  std::uint64_t batch_record_conflicts = 0;
};

/// Always-on counters of a consumer.
class ConsumerStats {
 public:
  ///@{
  /// The counters, as in ConsumerStatsSnapshot.
  std::atomic<std::uint64_t> deliveries{0}, acked{0}, duplicates{0}, retry_later{0}, mismatched{0},
      dead_lettered{0}, failures{0}, redeliveries{0}, batch_reruns{0}, batch_record_conflicts{0};
  ///@}
  /// Each counter read once (relaxed).
  ConsumerStatsSnapshot snapshot() const noexcept {
    ConsumerStatsSnapshot s;
    s.deliveries = deliveries.load(std::memory_order_relaxed);
    s.acked = acked.load(std::memory_order_relaxed);
    s.duplicates = duplicates.load(std::memory_order_relaxed);
    s.retry_later = retry_later.load(std::memory_order_relaxed);
    s.mismatched = mismatched.load(std::memory_order_relaxed);
    s.dead_lettered = dead_lettered.load(std::memory_order_relaxed);
    s.failures = failures.load(std::memory_order_relaxed);
    s.redeliveries = redeliveries.load(std::memory_order_relaxed);
    s.batch_reruns = batch_reruns.load(std::memory_order_relaxed);
    s.batch_record_conflicts = batch_record_conflicts.load(std::memory_order_relaxed);
    return s;
  }
};

namespace detail {
/// Response bytes the consumer stores in the record (the handler's own result is not kept).
inline constexpr std::string_view kConsumedMarker = "idem-mq:consumed";
inline constexpr std::string_view kDeadMarker = "idem-mq:dead:";

// Thrown inside consume_batch's first transaction to roll it back and run the batch again with
// a savepoint per message. Never escapes consume_batch.
struct BatchRerun {};
// Thrown inside consume_batch's first transaction when the plain record insert found a record:
// the transaction rolls back and the first run starts again with the tolerant insert.
struct BatchRecordsExist {};

}  // namespace detail

/// Runs MQ message handlers once per (consumer group, message id). Thread-safe: one consumer
/// may serve several worker threads. The guard must outlive it.
///
/// @tparam Durable the guard's durable store (NoDurableStore for a fast-store-only consumer,
///         which is best effort: see guard.hpp).
template <class Durable = NoDurableStore>
class IdempotentConsumer {
 public:
  /// @param guard the guard (its lease must exceed the slowest handler).
  /// @param group the consumer group: the scope of the records (validated as a key scope).
  /// @param options attempts before a dead letter, lease and retention (ConsumerOptions).
  /// @throws idem::InvalidKey for a bad group, idem::UsageError for max_attempts 0.
  IdempotentConsumer(IdempotencyGuard<Durable>& guard, std::string group,
                     ConsumerOptions options = {})
      : guard_(&guard), group_(std::move(group)), options_(std::move(options)) {
    Key::validate_scope(group_);
    if (options_.max_attempts == 0) {
      throw UsageError("idem::IdempotentConsumer: max_attempts must be positive");
    }
    if (!options_.attempts) options_.attempts = std::make_shared<MemoryAttemptLedger>();
  }

  IdempotentConsumer(const IdempotentConsumer&) = delete;
  IdempotentConsumer& operator=(const IdempotentConsumer&) = delete;

  /// Consumes one delivery. `handler` is `void(Transaction&)` (transactional: its writes commit
  /// with the consume record) or `void()` (two-phase, for external side effects); a returned
  /// value is ignored.
  /// @return what the loop should do (see Verdict).
  /// @throws idem::StorageError subclasses when a store fails (do not ack: the broker
  ///         redelivers), whatever the dead-letter sink throws. Handler exceptions are not
  ///         rethrown: they count as failed attempts, except retryable idem errors (e.g. the
  ///         handler's own StorageTimeout), which propagate without counting.
  template <class Fn>
  Verdict consume(const Delivery& delivery, Fn&& handler) {
    stats_.deliveries.fetch_add(1, std::memory_order_relaxed);
    if (delivery.delivery_count > 1) stats_.redeliveries.fetch_add(1, std::memory_order_relaxed);
    std::optional<Key> maybe_key = make_key(delivery);
    if (!maybe_key) return count(Verdict::kDeadLetter);
    const Key& key = *maybe_key;
    if (delivery.delivery_count > 1) {
      if (auto v = exhausted(key, delivery)) return *v;
    }
    // The consumer's own fingerprint: dead-lettering after a failed handler must not read
    // bytes the handler rewrote (the key is already the consumer's own).
    const std::string fingerprint(delivery.fingerprint);
    Delivery own = delivery;
    own.fingerprint = fingerprint;

    std::exception_ptr handler_error;
    auto run = [&](auto&&... tx) -> std::string {
      try {
        handler(tx...);
      } catch (...) {
        handler_error = std::current_exception();
        throw;
      }
      return std::string(detail::kConsumedMarker);
    };
    GuardResult<std::string> r;
    try {
      if constexpr (detail::kTakesTransaction<std::decay_t<Fn>,
                                              detail::transaction_t<Durable>>) {
        r = guard_->run(key, fingerprint,
                        [&](detail::transaction_t<Durable>& tx) { return run(tx); });
      } else {
        r = guard_->run(key, fingerprint, [&]() { return run(); });
      }
    } catch (const Error& e) {
      // A store failed, or the handler hit a retryable idem failure (its own database timed
      // out): not the message's fault. Propagate; the broker redelivers.
      if (!handler_error || e.retryable()) throw;
      return failed(key, own, handler_error);
    } catch (...) {
      if (!handler_error) throw;
      return failed(key, own, handler_error);
    }
    switch (r.outcome) {
      case Outcome::kExecuted:
        if (delivery.delivery_count > 1) forget_failures(key);
        return count(Verdict::kAck);
      case Outcome::kReplayed: return count(Verdict::kAckDuplicate);
      case Outcome::kInProgress: return count(Verdict::kRetryLater);
      case Outcome::kFingerprintMismatch: return count(Verdict::kMismatch);
    }
    return count(Verdict::kRetryLater);
  }

  /// Consumes a first delivery of `message_id` (see the Delivery overload).
  template <class Fn>
  Verdict consume(std::string_view message_id, std::string_view fingerprint, Fn&& handler) {
    return consume(Delivery{message_id, fingerprint}, std::forward<Fn>(handler));
  }

  /// Consumes a whole batch with one fast-store round trip for all claims, ONE durable
  /// transaction (one commit instead of one per message), and one fast-store round trip for
  /// all completions:
  ///
  ///   1. `FastStore::claim_batch` for the batch's distinct message ids (Redis pipelines
  ///      them). A message the fast store answers as done, busy or mismatched is decided there
  ///      (kAckDuplicate / kRetryLater / kMismatch) and never reaches the database. If the
  ///      fast store fails, every message goes on to the durable store (degraded, as in
  ///      `consume`); a guard without a fast store sends them all there.
  ///   2. One durable transaction: the records of the remaining deliveries are written,
  ///      already completed, where none exists, in one call (SqliteStore: one INSERT ... ON
  ///      CONFLICT DO NOTHING per record; PostgresStore: ONE statement for the whole batch,
  ///      a plain INSERT when every fast-store claim was fresh, and if a record exists after
  ///      all the transaction runs again with the tolerant one, ConsumerStats::
  ///      batch_record_conflicts);
  ///      then, in order, `handler(tx, index)` runs for each delivery whose record was
  ///      written, and an existing record decides the others (done, mismatch, busy, or taken
  ///      over when its lease or retention ended). This first run has no savepoints. If a
  ///      handler throws (or, with PostgreSQL, a record is locked by another transaction past
  ///      lock_timeout), the transaction rolls back and the batch runs again with a savepoint
  ///      per delivery (ConsumerStats::batch_reruns): a failing handler then loses only its
  ///      own writes and counts as a failed attempt, exactly as in `consume`; the others
  ///      commit. So a transactional handler may run twice for one committed effect (its
  ///      first writes rolled back): keep its side effects in the transaction. Duplicates
  ///      inside the batch (a producer retry in the same read) run once: the record the first
  ///      wrote decides the second.
  ///   3. After the commit, `FastStore::complete_batch` for the claims that committed (or
  ///      found a committed record); claims that did not are released. A fast-store failure
  ///      here changes no verdict (the durable store replays and refills). Dead-lettering and
  ///      attempt counting run last, in their own transactions.
  ///
  /// The durable store decides every effect, so a lost or failed fast store never doubles
  /// one. Every delivery the protocol decided is counted in the guard's stats and told to its
  /// observer as guard.run() would count and tell it (IdempotencyGuard::report: outcome,
  /// source, fast claim; phase timings are the batch's, the handler time the delivery's own),
  /// so fast-store hit rate and unique-conflict metrics include batches.
  ///
  /// Requires a durable store with the batch operations of the durable store contract
  /// (idem/durable_store.hpp: with_transaction, decide_in, record_in, record_batch_in and the
  /// savepoints), as idem::sqlite::SqliteStore and idem::postgres::PostgresStore have.
  /// @return one verdict per delivery, in order.
  /// @throws idem::StorageError subclasses (nothing of the batch committed: do not ack; the
  ///         batch's fast claims are released), a retryable idem error thrown by a handler
  ///         (the whole batch rolls back), whatever the dead-letter sink throws.
  template <class Fn>
  std::vector<Verdict> consume_batch(const std::vector<Delivery>& batch, Fn&& handler) {
    static_assert(detail::check_batch_store<Durable>());
    Durable& durable = *guard_->durable_store();
    FastStore* fast = guard_->fast_store();
    const std::size_t n = batch.size();
    BatchState b{batch, n};
    std::unordered_set<std::string_view> seen;
    for (std::size_t i = 0; i < n; ++i) {
      const Delivery& d = batch[i];
      stats_.deliveries.fetch_add(1, std::memory_order_relaxed);
      if (d.delivery_count > 1) stats_.redeliveries.fetch_add(1, std::memory_order_relaxed);
      b.keys.push_back(make_key(d));
      if (!b.keys[i]) {
        b.verdicts[i] = Verdict::kDeadLetter;
        continue;
      }
      if (d.delivery_count > 1) {
        if (auto v = exhausted(*b.keys[i], d)) {
          b.verdicts[i] = *v;
          continue;
        }
      }
      b.to_durable[i] = 1;
      // Later copies of an id go neither to the fast store nor into the batch insert: the
      // record the first copy wrote decides them.
      b.first[i] = seen.insert(b.keys[i]->id()).second ? 1 : 0;
    }

    b.timed = guard_->observed();
    if (b.timed) {
      b.start = std::chrono::steady_clock::now();
      b.handler_time.assign(n, std::chrono::nanoseconds{0});
    }

    // 1. Fast store: one claim_batch for the first delivery of each message id.
    if (fast != nullptr) {
      claim_fast(*fast, b);
      if (b.timed) b.fast_claim = std::chrono::steady_clock::now() - b.start;
    }
    const auto durable_start =
        b.timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};

    // 2. One durable transaction for the rest: first without savepoints; if a handler fails,
    //    that transaction rolls back and the batch runs again with a savepoint per message.
    try {
      if (std::find(b.to_durable.begin(), b.to_durable.end(), 1) != b.to_durable.end()) {
        const std::vector<Verdict> before = b.verdicts;
        auto roll_back = [&] {
          b.verdicts = before;
          std::fill(b.durable_found.begin(), b.durable_found.end(), 0);
          for (auto& d : b.durable_done) d.clear();
          std::fill(b.took_over.begin(), b.took_over.end(), 0);
          std::fill(b.handler_time.begin(), b.handler_time.end(), std::chrono::nanoseconds{0});
          for (std::size_t i = 0; i < n; ++i) {
            if (b.source[i] != Source::kDurableStore) continue;
            b.source[i] = Source::kHandler;
            b.answer[i] = ClaimResult{};
          }
        };
        // The plain record insert when every claim was fresh in the fast store (no record is
        // expected); a record found anyway (fast store lost it, a redelivery) costs one rerun.
        b.new_records = b.fresh_claims;
        bool committed = false;
        for (bool again = true; again;) {
          again = false;
          try {
            durable.with_transaction(
                [&](typename Durable::Transaction& tx) { first_pass(durable, tx, b, handler); });
            committed = true;
          } catch (const detail::BatchRecordsExist&) {
            roll_back();  // nothing ran yet: the records are written first
            b.new_records = false;
            stats_.batch_record_conflicts.fetch_add(1, std::memory_order_relaxed);
            again = true;
          } catch (const detail::BatchRerun&) {
            // Rolled back: a handler failed (or a record was locked by another transaction).
          }
        }
        if (!committed) {
          roll_back();
          stats_.batch_reruns.fetch_add(1, std::memory_order_relaxed);
          durable.with_transaction(
              [&](typename Durable::Transaction& tx) { careful_pass(durable, tx, b, handler); });
        }
      }
    } catch (...) {
      if (fast != nullptr) {
        for (std::size_t i = 0; i < n; ++i) {
          if (b.fast_claimed[i] != 0) release_fast(*fast, *b.keys[i], b.owner);
        }
      }
      throw;
    }

    if (b.timed) b.transaction = std::chrono::steady_clock::now() - durable_start;

    // 3. Fast store: one complete_batch; release the claims that did not commit.
    if (fast != nullptr) finish_fast(*fast, b);

    std::vector<char> failed_at(n, 0);
    for (const auto& f : b.failures) failed_at[f.first] = 1;
    report_calls(b, failed_at);
    for (std::size_t i = 0; i < n; ++i) {
      if (failed_at[i] != 0) continue;
      if (b.verdicts[i] == Verdict::kAck && batch[i].delivery_count > 1) {
        forget_failures(*b.keys[i]);
      }
      count(b.verdicts[i]);
    }
    // After the commit: attempt counts and dead letters use their own transactions.
    for (const auto& [i, error] : b.failures) {
      Delivery d = batch[i];
      d.fingerprint = b.fingerprints[i];
      b.verdicts[i] = failed(*b.keys[i], d, error);
    }
    return std::move(b.verdicts);
  }

  /// True when the record of `message_id` says it was dead-lettered (for operators and tests).
  /// Needs a durable store with lookup().
  bool dead_lettered(std::string_view message_id) {
    static_assert(IdempotencyGuard<Durable>::kHasDurable, "needs a durable store");
    auto rec = guard_->durable_store()->lookup(Key::make(group_, message_id));
    return rec && rec->status == Record::Status::kFailed;
  }

  /// The consumer group (the records' scope).
  const std::string& group() const noexcept { return group_; }
  /// The consumer's counters.
  const ConsumerStats& stats() const noexcept { return stats_; }
  /// The options in force.
  const ConsumerOptions& options() const noexcept { return options_; }

 private:
  Verdict count(Verdict v) noexcept {
    switch (v) {
      case Verdict::kAck: stats_.acked.fetch_add(1, std::memory_order_relaxed); break;
      case Verdict::kAckDuplicate: stats_.duplicates.fetch_add(1, std::memory_order_relaxed); break;
      case Verdict::kRetryLater: stats_.retry_later.fetch_add(1, std::memory_order_relaxed); break;
      case Verdict::kMismatch: stats_.mismatched.fetch_add(1, std::memory_order_relaxed); break;
      case Verdict::kDeadLetter:
        stats_.dead_lettered.fetch_add(1, std::memory_order_relaxed);
        break;
    }
    return v;
  }

  // What consume_batch knows of one batch, per delivery.
  struct BatchState {
    BatchState(const std::vector<Delivery>& deliveries, std::size_t n)
        : batch(deliveries),
          verdicts(n, Verdict::kRetryLater),
          to_durable(n, 0),
          first(n, 0),
          fast_claimed(n, 0),
          durable_found(n, 0),
          durable_done(n),
          source(n, Source::kHandler),
          answer(n),
          took_over(n, 0) {
      keys.reserve(n);
      // The batch's own copy of every fingerprint, taken before any handler runs: a handler
      // that rewrites the bytes a Delivery views cannot change what the records store.
      std::size_t bytes = 0;
      for (const Delivery& d : deliveries) bytes += d.fingerprint.size();
      fingerprint_bytes.reserve(bytes);
      for (const Delivery& d : deliveries) fingerprint_bytes.append(d.fingerprint);
      fingerprints.reserve(n);
      std::size_t at = 0;
      for (const Delivery& d : deliveries) {
        fingerprints.emplace_back(fingerprint_bytes.data() + at, d.fingerprint.size());
        at += d.fingerprint.size();
      }
    }
    BatchState(const BatchState&) = delete;
    BatchState& operator=(const BatchState&) = delete;
    const std::vector<Delivery>& batch;
    std::string fingerprint_bytes;               // every delivery's fingerprint, in order
    std::vector<std::string_view> fingerprints;  // views into fingerprint_bytes
    std::vector<std::optional<Key>> keys;  // nullopt: the id is not a valid key
    // The batch is one attempt: its claims share one owner token (fencing is per key, so a
    // token only has to differ from other attempts on the same key).
    OwnerToken owner = OwnerToken::generate();
    std::vector<Verdict> verdicts;
    std::vector<char> to_durable;    // still to be decided by the durable store
    std::vector<char> first;         // the first delivery of its message id in the batch
    std::vector<char> fast_claimed;  // the fast store granted its claim
    std::vector<char> durable_found;          // a committed record was found...
    std::vector<std::string> durable_done;    // ...with this response
    std::vector<std::pair<std::size_t, std::exception_ptr>> failures;  // handlers that threw
    bool fresh_claims = false;  // the fast store granted every claim, none a takeover
    bool new_records = false;   // first_pass writes the records with the plain insert
    // For the guard's counters and observer (report_calls).
    std::vector<Source> source;       // who decided a duplicate (kHandler: not a duplicate)
    std::vector<ClaimResult> answer;  // a duplicate's first_seen and holder
    std::vector<char> took_over;      // the durable store took an expired lease over
    bool degraded = false;            // the fast store failed for this batch
    // Phase timings, only when an observer listens.
    bool timed = false;
    std::chrono::steady_clock::time_point start;
    std::chrono::nanoseconds fast_claim{0}, transaction{0};
    std::vector<std::chrono::nanoseconds> handler_time;
  };

  // Step 1 of consume_batch: one claim_batch for the first delivery of each message id. A
  // fast-store failure leaves every delivery to the durable store (degraded; claims the failed
  // round trip may have made end with their lease).
  void claim_fast(FastStore& fast, BatchState& b) {
    std::vector<ClaimRequest> requests;
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < b.batch.size(); ++i) {
      if (b.first[i] == 0) continue;
      requests.push_back(ClaimRequest{&*b.keys[i], b.fingerprints[i], &b.owner});
      index.push_back(i);
    }
    try {
      std::vector<ClaimResult> answers = fast.claim_batch(requests, guard_->options().lease);
      b.fresh_claims = true;
      for (std::size_t j = 0; j < index.size(); ++j) {
        const std::size_t i = index[j];
        if (answers[j].status == ClaimStatus::kClaimed) {
          b.fast_claimed[i] = 1;
          // A takeover or a redelivery may find a record its earlier holder committed.
          if (answers[j].took_over || b.batch[i].delivery_count > 1) b.fresh_claims = false;
          continue;
        }
        b.to_durable[i] = 0;
        b.verdicts[i] = answers[j].status == ClaimStatus::kDone       ? Verdict::kAckDuplicate
                        : answers[j].status == ClaimStatus::kMismatch ? Verdict::kMismatch
                                                                      : Verdict::kRetryLater;
        b.source[i] = Source::kFastStore;
        b.answer[i].first_seen = answers[j].first_seen;
        b.answer[i].holder = std::move(answers[j].holder);
      }
      guard_->report_fast_ok();
    } catch (const StorageError& e) {
      b.fresh_claims = false;
      b.degraded = true;
      if (!requests.empty()) guard_->report_fast_failure(*requests.front().key, e, requests.size());
    }
  }

  // Step 2 of consume_batch, first run, inside `tx`: the records of the first delivery of each
  // message id, written completed in one batch call; then, in order, each delivery's handler
  // (or, when a record existed, the record's answer). No savepoints: a failing handler (not
  // retryable) or a record locked by another transaction throws BatchRerun, which rolls `tx`
  // back. A retryable idem error thrown by a handler propagates (the batch rolls back).
  template <class Tx, class Fn>
  void first_pass(Durable& durable, Tx& tx, BatchState& b, Fn& handler) {
    const auto retention = guard_->options().retention;
    const std::size_t n = b.batch.size();
    std::vector<ClaimRequest> requests;
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < n; ++i) {
      if (b.to_durable[i] == 0 || b.first[i] == 0) continue;
      requests.push_back(ClaimRequest{&*b.keys[i], b.fingerprints[i], &b.owner});
      index.push_back(i);
    }
    std::vector<bool> written;
    try {
      DurableHint hint;
      hint.fast_claimed = b.new_records;
      std::optional<std::vector<bool>> w =
          durable.record_batch_in(tx, requests, detail::kConsumedMarker, retention, hint);
      if (!w) throw detail::BatchRecordsExist{};  // `tx` is aborted
      written = std::move(*w);
    } catch (const StorageTimeout&) {
      throw detail::BatchRerun{};  // a key locked by another transaction: decide one by one
    }
    std::vector<char> recorded(n, 0);
    for (std::size_t j = 0; j < index.size(); ++j) recorded[index[j]] = written[j] ? 1 : 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (b.to_durable[i] == 0) continue;
      ClaimResult c;
      if (recorded[i] == 0 && !claim_record(durable, tx, b, i, c)) continue;
      try {
        run_handler(b, handler, tx, i);
      } catch (...) {
        if (retryable(std::current_exception())) throw;
        throw detail::BatchRerun{};
      }
      if (recorded[i] == 0) {
        durable.record_in(tx, *b.keys[i], b.fingerprints[i], b.owner, detail::kConsumedMarker,
                          retention, c);
      }
      b.verdicts[i] = Verdict::kAck;
    }
  }

  // Step 2 of consume_batch, after a first run rolled back: a savepoint per delivery, so a
  // failing handler loses only its own writes (listed in `failures`) and the others commit.
  template <class Tx, class Fn>
  void careful_pass(Durable& durable, Tx& tx, BatchState& b, Fn& handler) {
    const auto retention = guard_->options().retention;
    for (std::size_t i = 0; i < b.batch.size(); ++i) {
      if (b.to_durable[i] == 0) continue;
      const Key& key = *b.keys[i];
      durable.savepoint(tx);
      ClaimResult c;
      if (!claim_record(durable, tx, b, i, c)) {
        durable.release_savepoint(tx);
        continue;
      }
      try {
        run_handler(b, handler, tx, i);
      } catch (...) {
        if (retryable(std::current_exception())) throw;  // rolls the whole batch back
        durable.rollback_to_savepoint(tx);
        durable.release_savepoint(tx);
        b.failures.emplace_back(i, std::current_exception());
        continue;
      }
      durable.record_in(tx, key, b.fingerprints[i], b.owner, detail::kConsumedMarker, retention, c);
      durable.release_savepoint(tx);
      b.verdicts[i] = Verdict::kAck;
    }
  }

  // handler(tx, i), timed when an observer listens.
  template <class Fn, class Tx>
  static void run_handler(BatchState& b, Fn& handler, Tx& tx, std::size_t i) {
    if (!b.timed) {
      handler(tx, i);
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      handler(tx, i);
    } catch (...) {
      b.handler_time[i] = std::chrono::steady_clock::now() - t0;
      throw;
    }
    b.handler_time[i] = std::chrono::steady_clock::now() - t0;
  }

  // After step 3 of consume_batch: each delivery the guard's protocol decided is counted in
  // the guard's stats and told to its observer, as guard.run() would have (Mode
  // kTransactional). A failed handler counts as a handler error; invalid ids count nothing.
  void report_calls(const BatchState& b, const std::vector<char>& failed_at) {
    const auto end =
        b.timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    std::chrono::nanoseconds handlers{0};
    if (b.timed) {
      for (const auto& h : b.handler_time) handlers += h;
    }
    const auto durable =
        b.transaction > handlers ? b.transaction - handlers : std::chrono::nanoseconds{0};
    for (std::size_t i = 0; i < b.batch.size(); ++i) {
      if (!b.keys[i]) continue;
      const Key& key = *b.keys[i];
      Outcome outcome = Outcome::kExecuted;
      switch (b.verdicts[i]) {
        case Verdict::kAck:
          outcome = Outcome::kExecuted;
          break;
        case Verdict::kAckDuplicate:
          outcome = Outcome::kReplayed;
          break;
        case Verdict::kMismatch:
          outcome = Outcome::kFingerprintMismatch;
          break;
        case Verdict::kRetryLater:
          outcome = Outcome::kInProgress;
          break;
        default:
          continue;
      }
      if (b.took_over[i] != 0 && failed_at[i] == 0) guard_->report_takeover(key, "durable");
      typename IdempotencyGuard<Durable>::ReportedCall c{key, outcome, b.source[i]};
      c.fast_claimed = b.fast_claimed[i] != 0;
      c.degraded = b.degraded;
      c.first_seen = b.answer[i].first_seen;
      c.holder = b.answer[i].holder;
      if (b.timed) {
        c.fast_claim = b.fast_claim;
        if (b.source[i] != Source::kFastStore) c.durable = durable;
        c.handler = b.handler_time[i];
        c.total = end - b.start;
      }
      if (failed_at[i] != 0) {
        guard_->report_handler_error(c);
      } else {
        guard_->report(c);
      }
    }
  }

  // The record check of delivery `i` inside `tx` (both passes of consume_batch): true when
  // the delivery may run (`c` holds the claim); false when an existing record decided it.
  template <class Tx>
  static bool claim_record(Durable& durable, Tx& tx, BatchState& b, std::size_t i, ClaimResult& c) {
    c = durable.decide_in(tx, *b.keys[i], b.fingerprints[i], b.owner);
    if (c.status != ClaimStatus::kClaimed) {
      settle(b, i, c);
      return false;
    }
    b.took_over[i] = c.took_over ? 1 : 0;
    return true;
  }

  // The verdict of a delivery whose record existed (done, mismatch or busy).
  static void settle(BatchState& b, std::size_t i, ClaimResult& c) {
    if (c.status == ClaimStatus::kDone) {
      b.durable_found[i] = 1;
      b.durable_done[i] = std::move(c.response);
    }
    b.source[i] = Source::kDurableStore;
    b.answer[i].first_seen = c.first_seen;
    b.answer[i].holder = std::move(c.holder);
    b.verdicts[i] = c.status == ClaimStatus::kDone       ? Verdict::kAckDuplicate
                    : c.status == ClaimStatus::kMismatch ? Verdict::kMismatch
                                                         : Verdict::kRetryLater;
  }

  // True for an idem error that says nothing about the message (e.g. the handler's own
  // StorageTimeout): it aborts the whole batch instead of counting as a failed attempt.
  static bool retryable(const std::exception_ptr& e) noexcept {
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      return err.retryable();
    } catch (...) {
      return false;
    }
  }

  static void release_fast(FastStore& fast, const Key& key, const OwnerToken& owner) noexcept {
    try {
      fast.release(key, owner);
    } catch (...) {
      // The claim ends with its lease.
    }
  }

  // Step 3 of consume_batch.
  void finish_fast(FastStore& fast, BatchState& b) {
    const auto retention = guard_->options().retention;
    std::vector<CompleteRequest> requests;
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < b.batch.size(); ++i) {
      if (b.fast_claimed[i] == 0) continue;
      if (b.verdicts[i] == Verdict::kAck) {
        requests.push_back(CompleteRequest{&*b.keys[i], &b.owner, detail::kConsumedMarker});
        index.push_back(i);
      } else if (b.durable_found[i] != 0) {
        // The fast store had lost a completed record: put the durable answer back.
        requests.push_back(CompleteRequest{&*b.keys[i], &b.owner, b.durable_done[i]});
        index.push_back(i);
      } else {
        release_fast(fast, *b.keys[i], b.owner);  // busy, mismatch or a failed handler
      }
    }
    if (requests.empty()) return;
    try {
      std::vector<bool> ok = fast.complete_batch(requests, retention);
      for (std::size_t j = 0; j < index.size(); ++j) {
        if (ok[j]) continue;
        // The claim expired meanwhile: the durable answer stands; overwrite the fast record.
        fast.fill(*requests[j].key, b.fingerprints[index[j]], requests[j].response, retention);
        guard_->report_fast_refill();
      }
    } catch (const StorageError& e) {
      // The durable store replays from now on; a later duplicate refills the fast store.
      b.degraded = true;
      guard_->report_fast_failure(*requests.front().key, e, requests.size());
    }
  }

  // A message id that is not a valid key id cannot be recorded: it goes straight to the sink
  // (nullopt: the caller answers kDeadLetter).
  std::optional<Key> make_key(const Delivery& d) {
    try {
      return Key::make(group_, d.message_id);
    } catch (const InvalidKey& e) {
      if (options_.dead_letter) {
        options_.dead_letter(DeadLetter{group_, std::string(d.message_id),
                                        std::string(d.payload), e.what(), 0});
      }
      return std::nullopt;
    }
  }

  static std::string describe(const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      return ex.what();
    } catch (...) {
      return "unknown exception";
    }
  }

  // A redelivered message whose attempts are already used up (its last failure was counted
  // but the hand-off to the dead-letter sink did not complete: the broker connection dropped)
  // is dead-lettered without running the handler again.
  std::optional<Verdict> exhausted(const Key& key, const Delivery& d) {
    const std::uint32_t n = options_.attempts->failures(key);
    if (n < options_.max_attempts) return std::nullopt;
    return dead_letter(key, d,
                       "failed " + std::to_string(n) +
                           " attempts; dead-lettered on a redelivery after an earlier "
                           "dead-letter hand-off did not complete",
                       n);
  }

  Verdict failed(const Key& key, const Delivery& d, const std::exception_ptr& error) {
    stats_.failures.fetch_add(1, std::memory_order_relaxed);
    std::string what = describe(error);
    std::uint32_t n = options_.attempts->record_failure(key, what);
    if (n < options_.max_attempts) return count(Verdict::kRetryLater);
    return dead_letter(key, d, std::move(what), n);
  }

  // Claims the record, hands the message to the sink, marks the record failed.
  Verdict dead_letter(const Key& key, const Delivery& d, std::string error,
                      std::uint32_t attempts) {
    const auto owner = OwnerToken::generate();
    const auto& go = guard_->options();
    const std::string reason = std::string(detail::kDeadMarker) + error;
    // The same steps on the durable store, or on the fast store of a fast-only consumer.
    auto apply = [&](auto& store, const ClaimResult& c, auto&& mark) {
      if (c.status == ClaimStatus::kBusy) return count(Verdict::kRetryLater);
      if (c.status == ClaimStatus::kMismatch) return count(Verdict::kMismatch);
      if (c.status == ClaimStatus::kDone) return count(Verdict::kAckDuplicate);
      try {
        sink(key, d, error, attempts);
      } catch (...) {
        store.release(key, owner);
        throw;
      }
      mark();
      forget_failures(key);
      return count(Verdict::kDeadLetter);
    };
    if constexpr (IdempotencyGuard<Durable>::kHasDurable) {
      Durable& durable = *guard_->durable_store();
      return apply(durable, durable.begin(key, d.fingerprint, owner, go.lease),
                   [&] { durable.fail(key, owner, reason, go.retention); });
    } else {
      FastStore& fast = *guard_->fast_store();
      return apply(fast, fast.claim(key, d.fingerprint, owner, go.lease),
                   [&] { fast.fail(key, owner, reason, go.retention); });
    }
  }

  void sink(const Key& key, const Delivery& d, const std::string& error,
            std::uint32_t attempts) {
    if (!options_.dead_letter) return;
    options_.dead_letter(
        DeadLetter{group_, key.id(), std::string(d.payload), error, attempts});
  }

  void forget_failures(const Key& key) noexcept {
    try {
      options_.attempts->clear(key);
    } catch (...) {
      // A stale count only makes a later failure of this id dead-letter sooner.
    }
  }

  IdempotencyGuard<Durable>* guard_;
  std::string group_;
  ConsumerOptions options_;
  ConsumerStats stats_;
};

}  // namespace idem
