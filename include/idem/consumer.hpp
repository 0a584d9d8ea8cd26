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
//                                     idem::sqlite::SqliteStoreOptions::mq_consume_record()};
//   idem::GuardOptions go;
//   go.durable_source = idem::DuplicateSource::kMqRecord;
//   idem::IdempotencyGuard guard{fast, durable, go};
//   idem::ConsumerOptions co;
//   co.attempts = std::make_shared<idem::sqlite::SqliteAttemptLedger>(durable.shared_database());
//   co.dead_letter = [&](const idem::DeadLetter& d) { dead_stream.add(d.message_id, d.payload); };
//   idem::IdempotentConsumer consumer{guard, "billing-consumer", co};
//   for (auto& msg : stream.read_group(batch)) {
//     auto verdict = consumer.consume(
//         {msg.id, idem::fingerprint(msg.body), msg.body},
//         [&](idem::sqlite::Transaction& tx) { record_payment(tx, msg); });
//     if (idem::should_ack(verdict)) stream.ack(msg.entry_id);
//   }
// @endcode
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/attempt_ledger.hpp"
#include "idem/delivery.hpp"
#include "idem/errors.hpp"
#include "idem/guard.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"

namespace idem {

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
  /// one (PostgreSQL: all claims fresh in the fast store, or, without granted fast claims,
  /// every message a first delivery) found a record of one of the keys (a producer's duplicate)
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
    memory_ledger_ = dynamic_cast<MemoryAttemptLedger*>(options_.attempts.get()) != nullptr;
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
    std::optional<Key> maybe_key = start(delivery);
    if (!maybe_key) return Verdict::kDeadLetter;
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
    // A first delivery is very likely a new message: the durable store claims at once instead
    // of reading for a completed duplicate first (a producer's retry is still found, by the
    // claim). A redelivery reads first.
    CallOptions call;
    call.likely_new = delivery.delivery_count <= 1;
    // The handler's answer is the fixed marker: the durable store may write the record
    // completed when it claims, and skip the completion statement.
    call.expected_response = detail::kConsumedMarker;
    GuardResult<std::string> r;
    try {
      if constexpr (detail::kTakesTransaction<std::decay_t<Fn>,
                                              detail::transaction_t<Durable>>) {
        r = guard_->run(key, fingerprint, call,
                        [&](detail::transaction_t<Durable>& tx) { return run(tx); });
      } else {
        r = guard_->run(key, fingerprint, call, [&]() { return run(); });
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
    if (r.outcome == Outcome::kExecuted && may_have_failures(delivery)) forget_failures(key);
    return count(verdict_of(r.outcome));
  }

  /// Consumes a first delivery of `message_id` (see the Delivery overload).
  template <class Fn>
  Verdict consume(std::string_view message_id, std::string_view fingerprint, Fn&& handler) {
    return consume(Delivery{message_id, fingerprint}, std::forward<Fn>(handler));
  }

  /// Consumes a whole batch through IdempotencyGuard::run_batch: one fast-store round trip
  /// for all claims, ONE durable transaction (one commit instead of one per message) for the
  /// records and the handlers, one fast-store round trip for all completions (idem/batch.hpp
  /// and docs/mq.md say what each step does). `handler(tx, index)` runs for each delivery
  /// that may run, `index` being its place in `batch`. A message the fast store answers as
  /// done, busy or mismatched never reaches the database. A failing handler loses only its
  /// own writes and counts as a failed attempt, exactly as in `consume` (the transaction then
  /// runs again with a savepoint per delivery, ConsumerStats::batch_reruns: a transactional
  /// handler may run twice for one committed effect, so keep its side effects in the
  /// transaction). Duplicates inside the batch run once (the repeat of a delivery whose
  /// handler failed answers kRetryLater, not counted as a failure). Dead-lettering and attempt
  /// counting run last, in their own transactions.
  ///
  /// Requires a durable store with the batch operations of the durable store contract
  /// (idem/durable_store.hpp), as the SQLite, PostgreSQL and MySQL stores have.
  /// @return one verdict per delivery, in order.
  /// @throws idem::StorageError subclasses from the claims or the batch's transaction
  ///         (nothing of the batch committed, or with idem::OutcomeUnknown perhaps all of it:
  ///         do not ack either way, the redeliveries are answered from the records; the
  ///         batch's fast claims are released), a retryable idem error thrown by a handler (the
  ///         whole batch rolls back). After the commit, the failure counting and dead-lettering of
  ///         failed deliveries may throw too (a StorageError of their own transactions, whatever
  ///         the dead-letter sink throws): the batch's effects are then committed, so do not ack
  ///         and let the deliveries come back; the committed ones are answered as duplicates.
  template <class Fn>
  std::vector<Verdict> consume_batch(const std::vector<Delivery>& batch, Fn&& handler) {
    const std::size_t n = batch.size();
    std::vector<Verdict> verdicts(n, Verdict::kRetryLater);
    // The consumer's own copy of every message id and fingerprint: attempt counting and
    // dead-lettering read them after the handlers ran (and may have rewritten the deliveries).
    std::string own_bytes;
    for (const Delivery& d : batch) own_bytes.append(d.message_id).append(d.fingerprint);
    std::vector<BatchCall> calls;
    std::vector<std::size_t> index;  // calls[j] is batch[index[j]]
    std::vector<Delivery> own(batch);
    // Every delivery is counted before anything of the batch can throw (a store failing in
    // exhausted() or in the batch), as consume() counts its one.
    for (const Delivery& d : batch) arrive(d);
    for (std::size_t i = 0, at = 0; i < n; ++i) {
      Delivery& d = own[i];
      d.message_id = std::string_view(own_bytes.data() + at, d.message_id.size());
      at += d.message_id.size();
      d.fingerprint = std::string_view(own_bytes.data() + at, d.fingerprint.size());
      at += d.fingerprint.size();
      std::optional<Key> key = key_of(d);
      if (!key) {
        verdicts[i] = Verdict::kDeadLetter;
        continue;
      }
      if (d.delivery_count > 1) {
        if (auto v = exhausted(*key, d)) {
          verdicts[i] = *v;
          continue;
        }
      }
      // A first delivery is very likely a new message (as in consume()).
      calls.push_back(
          BatchCall{std::move(*key), d.fingerprint, d.delivery_count > 1, d.delivery_count <= 1});
      index.push_back(i);
    }
    if (calls.empty()) return verdicts;
    BatchResult r = guard_->run_batch(
        std::move(calls), detail::kConsumedMarker,
        [&](typename Durable::Transaction& tx, std::size_t j) { handler(tx, index[j]); });
    if (r.rerun) stats_.batch_reruns.fetch_add(1, std::memory_order_relaxed);
    if (r.records_existed) stats_.batch_record_conflicts.fetch_add(1, std::memory_order_relaxed);
    std::vector<std::size_t> failed_at;
    for (std::size_t j = 0; j < index.size(); ++j) {
      const std::size_t i = index[j];
      if (r.answers[j].error) {
        failed_at.push_back(j);
        continue;
      }
      verdicts[i] = count(verdict_of(r.answers[j].outcome));
      if (verdicts[i] == Verdict::kAck && may_have_failures(own[i])) {
        forget_failures(Key::make(group_, own[i].message_id));
      }
    }
    // After the commit: attempt counts and dead letters use their own transactions.
    for (std::size_t j : failed_at) {
      const std::size_t i = index[j];
      verdicts[i] = failed(Key::make(group_, own[i].message_id), own[i], r.answers[j].error);
    }
    return verdicts;
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

  static Verdict verdict_of(Outcome o) noexcept {
    switch (o) {
      case Outcome::kExecuted: return Verdict::kAck;
      case Outcome::kReplayed: return Verdict::kAckDuplicate;
      case Outcome::kInProgress: return Verdict::kRetryLater;
      case Outcome::kFingerprintMismatch: return Verdict::kMismatch;
    }
    return Verdict::kRetryLater;
  }

  // A delivery arrives: counted; its key, or nullopt (answer kDeadLetter) when the message id
  // is not a valid key id: it cannot be recorded and goes straight to the sink.
  std::optional<Key> start(const Delivery& d) {
    arrive(d);
    return key_of(d);
  }

  // A delivery arrives: counted (deliveries, redeliveries, the observer's on_redelivery).
  void arrive(const Delivery& d) {
    stats_.deliveries.fetch_add(1, std::memory_order_relaxed);
    if (d.delivery_count > 1) {
      stats_.redeliveries.fetch_add(1, std::memory_order_relaxed);
      if (Observer* o = guard_->options().observer.get()) {
        o->on_redelivery(RedeliveryEvent{group_, d.message_id, d.delivery_count});
      }
    }
  }

  // The delivery's key, or nullopt (counted as a dead letter) for an invalid message id.
  std::optional<Key> key_of(const Delivery& d) {
    std::optional<Key> key = make_key(d);
    if (!key) count(Verdict::kDeadLetter);
    return key;
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

  // Whether a success must clear the message's failures. A redelivery may have some. A first
  // delivery (as the transport counts: `consume(id, fp, handler)` and transports without a
  // delivery count say 1 every time) may too; the in-process ledger is cleared then as well,
  // at the cost of a map lookup, so that it does not keep a count for every message that once
  // failed. A durable ledger is not asked (a statement per message): docs/mq.md.
  bool may_have_failures(const Delivery& d) const noexcept {
    return d.delivery_count > 1 || memory_ledger_;
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
  bool memory_ledger_ = false;  // options_.attempts is a MemoryAttemptLedger
  ConsumerStats stats_;
};

}  // namespace idem
