// SPDX-License-Identifier: MIT
// The durable store contract: what the guard asks of a durable store, checked by the compiler.
//
// File: durable_store.hpp
//
// A durable store (idem::sqlite::SqliteStore, idem::postgres::PostgresStore, the next one) is a
// class the guard is a template over, so that a transactional handler receives the store's own
// transaction type. It is not a virtual interface: its members are checked at compile time.
// `IdempotencyGuard<Store>` instantiates `detail::check_durable_store<Store>()`, and
// `IdempotencyGuard::run_batch` `detail::check_batch_store<Store>()`; a member that is missing or
// has another signature fails the build with a static_assert naming it.
//
// Every decision about a record (what a found record means to a claim, who may complete it,
// which status values are valid) comes from the rulebook, idem/detail/record_rules.hpp; a store
// only reads and writes. The durable conformance suite (tests/conformance/
// durable_store_conformance.hpp) is the behavioural half of this contract.
//
// @code
//   class MyStore {
//    public:
//     using Transaction = my::Transaction;       // what transactional handlers receive
//     std::string_view name() const noexcept;     // "mysql": logs and metrics labels
//
//     // Transactional mode. In ONE transaction: the record of `key` is claimed or found
//     // (detail::decide_claim); if claimed, `handler(tx)` runs and returns the encoded
//     // response, the record is written completed with it, and the transaction commits.
//     // Answers kCommitted (handler ran and committed), kReplayed, kBusy (held by another
//     // transaction beyond the store's lock wait, or a live two-phase lease), kMismatch. The
//     // handler may be called again if the store re-runs a transaction it rolled back
//     // (serialization failure). The handler throws: roll back, rethrow.
//     template <class Handler>
//     TransactionalResult run_transactional(const Key& key, std::string_view fingerprint,
//                                           const OwnerToken& owner,
//                                           std::chrono::seconds retention, Handler&& handler,
//                                           DurableHint hint = {});
//
//     // Two-phase mode, each call its own committed transaction; the same answers as
//     // FastStore's claim / complete / release / fail.
//     ClaimResult begin(const Key&, std::string_view fingerprint, const OwnerToken&,
//                       std::chrono::milliseconds lease, DurableHint hint = {});
//     bool complete(const Key&, const OwnerToken&, std::string_view response,
//                   std::chrono::seconds retention);
//     bool release(const Key&, const OwnerToken&);
//     bool fail(const Key&, const OwnerToken&, std::string_view reason,
//               std::chrono::seconds retention);          // a dead-lettered message
//
//     std::optional<Record> lookup(const Key&);
//     std::size_t purge_expired(std::size_t batch_size);   // completed / failed rows only
//
//     // Batch operations (IdempotencyGuard::run_batch, IdempotentConsumer::consume_batch):
//     template <class Fn> auto with_transaction(Fn&& fn);   // fn(Transaction&), then commit
//     // Inside `tx`: what a claim of `key` decides (rulebook). kClaimed: the caller may run
//     // its handler in `tx` and then calls record_in. The store may write an in-progress row
//     // here or nothing at all (the open transaction holding the key's lock is the lease).
//     ClaimResult decide_in(Transaction& tx, const Key&, std::string_view fingerprint,
//                           const OwnerToken&);
//     // Inside `tx`, after decide_in answered `decided` == kClaimed: the record completed with
//     // `response`. @throws LeaseLost if the record changed meanwhile.
//     void record_in(Transaction& tx, const Key&, std::string_view fingerprint,
//                    const OwnerToken&, std::string_view response,
//                    std::chrono::seconds retention, const ClaimResult& decided);
//     // Inside `tx`: each request's record written completed with `response` where no record
//     // of its key exists (answer i: written; false: decide it with decide_in). With
//     // `hint.expects_absent()` (the fast store granted every claim afresh, or every call
//     // said its key is likely new: records are very likely absent) the store may use a
//     // cheaper insert that fails on an existing record;
//     // if that leaves `tx` unusable it answers nullopt: the caller rolls back and runs the
//     // transaction again without the hint.
//     std::optional<std::vector<bool>> record_batch_in(Transaction& tx,
//                                                      const std::vector<ClaimRequest>&,
//                                                      std::string_view response,
//                                                      std::chrono::seconds retention,
//                                                      DurableHint hint);
//     // One savepoint level inside `tx`, so one message of a batch can fail alone. When a
//     // failed statement of a handler has ended `tx` (a driver that aborts the transaction on
//     // any error), rollback_to_savepoint throws a StorageError that is not retryable: the batch
//     // then runs again without that call.
//     void savepoint(Transaction& tx);
//     void rollback_to_savepoint(Transaction& tx);   // then release_savepoint
//     void release_savepoint(Transaction& tx);
//     // Optional: the idem error for an exception a handler's statement threw on `tx` (a
//     // driver's own exception type), so that the batch tells a retryable failure (a lock wait,
//     // a lost connection) from the message's own; `e` itself when there is none.
//     std::exception_ptr typed_error(std::exception_ptr e) const noexcept;
//   };
// @endcode
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/clock.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"

namespace idem {

/// What the guard knows when it turns to the durable store, passed as the last argument of
/// `run_transactional`, `begin` and `record_batch_in`. A hint may only make a store faster,
/// never change an answer (the durable conformance suite also runs with the hint forced on).
struct DurableHint {
  /// The fast store granted this attempt's claim (for a batch: every claim, none a takeover):
  /// the record is very likely absent, so a read-only precheck for a completed duplicate
  /// would almost always be wasted.
  bool fast_claimed = false;
  /// The caller said the key is very likely new (CallOptions::likely_new: a message's first
  /// delivery; for a batch without granted fast claims: every call's BatchCall::likely_new):
  /// as with a granted fast claim, a read-only precheck would almost always be wasted.
  bool likely_new = false;
  /// The bytes the handler's response will encode to, when the caller knows them before the
  /// handler runs (CallOptions::expected_response: IdempotentConsumer::consume's fixed marker).
  /// In `run_transactional` a store may then insert the record already completed with them, in
  /// the transaction the handler writes in, and leave out the completion statement when the
  /// handler's response matches (it writes the actual response when it does not). Nobody else
  /// sees the record before the COMMIT either way, so only the statement count changes.
  std::optional<std::string_view> expected_response = std::nullopt;
  /// Whether the record is expected to be absent (either of the above): a store may skip its
  /// read-only precheck for a completed duplicate and claim at once.
  constexpr bool expects_absent() const noexcept { return fast_claimed || likely_new; }
};

/// What a transactional run did.
enum class TransactionalStatus {
  kCommitted,  ///< the handler ran and its transaction committed with the completed record
  kReplayed,   ///< a completed (or failed) record was found: `response` holds its bytes
  kBusy,       ///< another attempt holds the key (a live lease, or a lock beyond the wait)
  kMismatch,   ///< the key exists with another fingerprint: a client error; nothing ran
};

/// Stable name: committed, replayed, busy, mismatch.
constexpr std::string_view transactional_status_name(TransactionalStatus s) noexcept {
  switch (s) {
    case TransactionalStatus::kCommitted: return "committed";
    case TransactionalStatus::kReplayed: return "replayed";
    case TransactionalStatus::kBusy: return "busy";
    case TransactionalStatus::kMismatch: return "mismatch";
  }
  return "unknown";
}

/// The answer of `run_transactional`.
struct TransactionalResult {
  /// Committed, replayed, busy or mismatch.
  TransactionalStatus status = TransactionalStatus::kCommitted;
  /// kCommitted: the handler's encoded response; kReplayed: the stored response.
  std::string response;
  /// kCommitted: an expired lease of another attempt (a crashed two-phase call) was taken over.
  bool took_over = false;
  /// kReplayed: the record ended as failed (a dead-lettered message); `response` is the reason.
  bool failed = false;
  /// kReplayed/kBusy/kMismatch: the owner token of the record's attempt (empty if unknown).
  std::string holder;
  /// kReplayed/kBusy/kMismatch: when the record was first created (epoch if unknown).
  TimePoint first_seen{};
  /// kReplayed: when the record's retention ends (epoch if unknown).
  TimePoint expires_at{};

  /// A run that committed `response`.
  static TransactionalResult committed(std::string response, bool took_over = false) {
    TransactionalResult r;
    r.response = std::move(response);
    r.took_over = took_over;
    return r;
  }
  /// A run that found a record instead of running the handler: `found` is a claim's answer
  /// other than kClaimed (kDone -> kReplayed, kBusy, kMismatch).
  static TransactionalResult found(ClaimResult&& found) {
    TransactionalResult r;
    r.status = found.status == ClaimStatus::kDone       ? TransactionalStatus::kReplayed
               : found.status == ClaimStatus::kMismatch ? TransactionalStatus::kMismatch
                                                        : TransactionalStatus::kBusy;
    r.response = std::move(found.response);
    r.failed = found.failed;
    r.holder = std::move(found.holder);
    r.first_seen = found.first_seen;
    r.expires_at = found.expires_at;
    return r;
  }
};

/// Marker for a guard without a durable store (fast store only; best effort).
struct NoDurableStore {
  /// No transaction: handlers take no argument.
  using Transaction = void;
};

namespace detail {

// --- the compile-time checks ------------------------------------------------------------------

template <class D, class = void>
struct has_transaction_type : std::false_type {};
template <class D>
struct has_transaction_type<D, std::void_t<typename D::Transaction>> : std::true_type {};

// A handler as the guard passes it to run_transactional.
template <class Tx>
struct ProbeHandler {
  std::string operator()(Tx&) const;
};
template <class Tx>
struct ProbeBody {
  void operator()(Tx&) const;
};

#define IDEM_DETAIL_MEMBER_CHECK(trait, Result, expr)                                          \
  template <class D, class = void>                                                              \
  struct trait : std::false_type {};                                                            \
  template <class D>                                                                            \
  struct trait<D, std::void_t<decltype(expr)>>                                                  \
      : std::bool_constant<std::is_void_v<Result> ||                                            \
                           std::is_convertible_v<decltype(expr), Result>> {}

IDEM_DETAIL_MEMBER_CHECK(has_name, std::string_view, std::declval<const D&>().name());
IDEM_DETAIL_MEMBER_CHECK(has_run_transactional, TransactionalResult,
                         std::declval<D&>().run_transactional(
                             std::declval<const Key&>(), std::string_view{},
                             std::declval<const OwnerToken&>(), std::chrono::seconds{},
                             std::declval<ProbeHandler<typename D::Transaction>&>(),
                             DurableHint{}));
IDEM_DETAIL_MEMBER_CHECK(has_begin, ClaimResult,
                         std::declval<D&>().begin(std::declval<const Key&>(), std::string_view{},
                                                  std::declval<const OwnerToken&>(),
                                                  std::chrono::milliseconds{}, DurableHint{}));
IDEM_DETAIL_MEMBER_CHECK(has_complete, bool,
                         std::declval<D&>().complete(std::declval<const Key&>(),
                                                     std::declval<const OwnerToken&>(),
                                                     std::string_view{}, std::chrono::seconds{}));
IDEM_DETAIL_MEMBER_CHECK(has_release, bool,
                         std::declval<D&>().release(std::declval<const Key&>(),
                                                    std::declval<const OwnerToken&>()));
IDEM_DETAIL_MEMBER_CHECK(has_fail, bool,
                         std::declval<D&>().fail(std::declval<const Key&>(),
                                                 std::declval<const OwnerToken&>(),
                                                 std::string_view{}, std::chrono::seconds{}));
IDEM_DETAIL_MEMBER_CHECK(has_lookup, std::optional<Record>,
                         std::declval<D&>().lookup(std::declval<const Key&>()));
IDEM_DETAIL_MEMBER_CHECK(has_extend, bool,
                         std::declval<D&>().extend(std::declval<const Key&>(),
                                                   std::declval<const OwnerToken&>(),
                                                   std::chrono::milliseconds{}));
IDEM_DETAIL_MEMBER_CHECK(has_purge_expired, std::size_t,
                         std::declval<D&>().purge_expired(std::size_t{}));
IDEM_DETAIL_MEMBER_CHECK(has_with_transaction, void,
                         std::declval<D&>().with_transaction(
                             std::declval<ProbeBody<typename D::Transaction>&>()));
IDEM_DETAIL_MEMBER_CHECK(has_decide_in, ClaimResult,
                         std::declval<D&>().decide_in(std::declval<typename D::Transaction&>(),
                                                      std::declval<const Key&>(),
                                                      std::string_view{},
                                                      std::declval<const OwnerToken&>()));
IDEM_DETAIL_MEMBER_CHECK(has_record_in, void,
                         std::declval<D&>().record_in(
                             std::declval<typename D::Transaction&>(), std::declval<const Key&>(),
                             std::string_view{}, std::declval<const OwnerToken&>(),
                             std::string_view{}, std::chrono::seconds{},
                             std::declval<const ClaimResult&>()));
IDEM_DETAIL_MEMBER_CHECK(has_record_batch_in, std::optional<std::vector<bool>>,
                         std::declval<D&>().record_batch_in(
                             std::declval<typename D::Transaction&>(),
                             std::declval<const std::vector<ClaimRequest>&>(), std::string_view{},
                             std::chrono::seconds{}, DurableHint{}));
IDEM_DETAIL_MEMBER_CHECK(has_savepoint, void,
                         std::declval<D&>().savepoint(std::declval<typename D::Transaction&>()));
IDEM_DETAIL_MEMBER_CHECK(has_rollback_to_savepoint, void,
                         std::declval<D&>().rollback_to_savepoint(
                             std::declval<typename D::Transaction&>()));
IDEM_DETAIL_MEMBER_CHECK(has_release_savepoint, void,
                         std::declval<D&>().release_savepoint(
                             std::declval<typename D::Transaction&>()));

IDEM_DETAIL_MEMBER_CHECK(has_typed_error, std::exception_ptr,
                         std::declval<const D&>().typed_error(std::exception_ptr{}));

#undef IDEM_DETAIL_MEMBER_CHECK

/// Checks `D` against the durable store contract (see the file comment); each missing or
/// mis-typed member fails with a static_assert naming it. True for NoDurableStore.
template <class D>
constexpr bool check_durable_store() {
  if constexpr (std::is_same_v<D, NoDurableStore>) {
    return true;
  } else {
    static_assert(has_transaction_type<D>::value,
                  "idem durable store contract: missing `using Transaction = ...;` (the type "
                  "transactional handlers receive)");
    static_assert(has_name<D>::value,
                  "idem durable store contract: missing "
                  "`std::string_view name() const noexcept`");
    static_assert(has_run_transactional<D>::value,
                  "idem durable store contract: missing `template <class Handler> "
                  "TransactionalResult run_transactional(const Key&, std::string_view "
                  "fingerprint, const OwnerToken&, std::chrono::seconds retention, Handler&&, "
                  "DurableHint)`");
    static_assert(has_begin<D>::value,
                  "idem durable store contract: missing `ClaimResult begin(const Key&, "
                  "std::string_view fingerprint, const OwnerToken&, std::chrono::milliseconds "
                  "lease, DurableHint)`");
    static_assert(has_complete<D>::value,
                  "idem durable store contract: missing `bool complete(const Key&, const "
                  "OwnerToken&, std::string_view response, std::chrono::seconds retention)`");
    static_assert(has_release<D>::value,
                  "idem durable store contract: missing "
                  "`bool release(const Key&, const OwnerToken&)`");
    static_assert(has_fail<D>::value,
                  "idem durable store contract: missing `bool fail(const Key&, const "
                  "OwnerToken&, std::string_view reason, std::chrono::seconds retention)`");
    static_assert(has_lookup<D>::value,
                  "idem durable store contract: missing "
                  "`std::optional<Record> lookup(const Key&)`");
    static_assert(has_purge_expired<D>::value,
                  "idem durable store contract: missing "
                  "`std::size_t purge_expired(std::size_t batch_size)`");
    return true;
  }
}

/// Checks the batch operations of the contract (IdempotencyGuard::run_batch), each missing or
/// mis-typed member failing with a static_assert naming it.
template <class D>
constexpr bool check_batch_store() {
  static_assert(!std::is_same_v<D, NoDurableStore>,
                "idem: batch calls need a durable store (their records commit with the "
                "handlers' writes in one transaction)");
  if constexpr (!std::is_same_v<D, NoDurableStore>) {
    static_assert(check_durable_store<D>());
    static_assert(has_with_transaction<D>::value,
                  "idem durable store contract (batch): missing `template <class Fn> auto "
                  "with_transaction(Fn&&)` (runs fn(Transaction&), then commits)");
    static_assert(has_decide_in<D>::value,
                  "idem durable store contract (batch): missing `ClaimResult "
                  "decide_in(Transaction&, const Key&, std::string_view fingerprint, const "
                  "OwnerToken&)`");
    static_assert(has_record_in<D>::value,
                  "idem durable store contract (batch): missing `void record_in(Transaction&, "
                  "const Key&, std::string_view fingerprint, const OwnerToken&, "
                  "std::string_view response, std::chrono::seconds retention, const "
                  "ClaimResult& decided)`");
    static_assert(has_record_batch_in<D>::value,
                  "idem durable store contract (batch): missing `std::optional<std::vector<"
                  "bool>> record_batch_in(Transaction&, const std::vector<ClaimRequest>&, "
                  "std::string_view response, std::chrono::seconds retention, DurableHint)`");
    static_assert(has_savepoint<D>::value,
                  "idem durable store contract (batch): missing "
                  "`void savepoint(Transaction&)`");
    static_assert(has_rollback_to_savepoint<D>::value,
                  "idem durable store contract (batch): missing "
                  "`void rollback_to_savepoint(Transaction&)`");
    static_assert(has_release_savepoint<D>::value,
                  "idem durable store contract (batch): missing "
                  "`void release_savepoint(Transaction&)`");
  }
  return true;
}

}  // namespace detail
}  // namespace idem
