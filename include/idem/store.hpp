// SPDX-License-Identifier: MIT
// The two storage roles of idem: a fast store (claim at the entrance) and a durable store
// (the relational backstop). Types shared by both.
//
// File: store.hpp
//
// A record moves through
//
//     absent --claim--> in_progress --complete--> completed (response kept for `retention`)
//                          |   ^
//                  release |   | takeover once the lease has expired (new owner token)
//                          v   |
//                        absent
//
// * Claim is atomic: of many concurrent claims of one absent key exactly one answers kClaimed.
// * Each claim carries the attempt's OwnerToken; complete and release act only while the token
//   still matches (compare-and-set), so an attempt whose lease expired cannot overwrite the
//   attempt that took over. They answer false ("lease lost") when it does not match.
// * The fingerprint check wins over everything: a claim with a different fingerprint than the
//   record's answers kMismatch, whether the record is in progress or completed.
// * lease: how long an in-progress claim is honoured; retention: how long a completed record
//   (and its response) is kept.
//
// FastStore is a small virtual interface (memory, Redis, Redis Cluster), chosen at run time.
// A durable store is a compile-time choice (the guard is a template over it) so the handler can
// receive the store's own transaction type; its contract, checked by the compiler, is
// idem/durable_store.hpp. What a record found by a store means is decided by the rulebook,
// idem/detail/record_rules.hpp, for every store alike.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/clock.hpp"
#include "idem/errors.hpp"
#include "idem/owner_token.hpp"
#include "idem/key.hpp"

namespace idem {

/// Default lease of an in-progress claim.
inline constexpr std::chrono::milliseconds kDefaultLease{30'000};
/// Default retention of a completed record.
inline constexpr std::chrono::seconds kDefaultRetention{24 * 3600};
/// The longest lease and retention idem accepts: 100 years (36,500 days), which every store
/// can represent as the time they end (MySQL's DATETIME ends in year 9999; "now" plus
/// `std::chrono::seconds::max()` overflows). Pass it for "keep forever"; a longer one is a
/// UsageError before anything runs.
inline constexpr std::chrono::seconds kMaxTerm{std::chrono::hours(24 * 36'500)};

namespace detail {
/// Refuses a lease or retention (`what`, as a message names it) longer than kMaxTerm.
/// @throws UsageError.
template <class Rep, class Period>
void check_not_longer(std::chrono::duration<Rep, Period> term, std::string_view what) {
  if (term > kMaxTerm) {
    throw UsageError(std::string(what) +
                     " is longer than idem::kMaxTerm (100 years): use kMaxTerm for 'forever'");
  }
}
/// Refuses a lease or retention that is not positive or longer than kMaxTerm.
/// @throws UsageError.
template <class Rep, class Period>
void check_term(std::chrono::duration<Rep, Period> term, std::string_view what) {
  if (term.count() <= 0) throw UsageError(std::string(what) + " must be positive");
  check_not_longer(term, what);
}
}  // namespace detail

/// What a claim found.
enum class ClaimStatus {
  kClaimed,   ///< this attempt now owns the key (fresh, or taken over after the lease expired)
  kBusy,      ///< another attempt holds a live lease: answer "in progress"
  kDone,      ///< completed earlier: `response` holds the stored bytes to replay
  kMismatch,  ///< the key exists with another fingerprint: a client error
};

/// Stable name of a claim status ("claimed", "busy", "done", "mismatch").
constexpr std::string_view claim_status_name(ClaimStatus s) noexcept {
  switch (s) {
    case ClaimStatus::kClaimed: return "claimed";
    case ClaimStatus::kBusy: return "busy";
    case ClaimStatus::kDone: return "done";
    case ClaimStatus::kMismatch: return "mismatch";
  }
  return "unknown";
}

/// What a fast store's claim hands on to the completion of the same attempt: ClaimResult::
/// ticket, given back to FastStore::complete_claimed (or CompleteRequest::ticket). Opaque to
/// the guard, which only carries it from the claim to the completion, on whatever thread
/// completes, so nothing passes between them through thread-local state. A store may use it to
/// complete faster (RedisStore: one native `SET ... XX` within the lease margin instead of a
/// script); an empty ticket, or one another store issued, completes as complete() does.
struct ClaimTicket {
  /// The store that issued it (a store ignores tickets of others); null when empty.
  const void* issuer = nullptr;
  /// The issuer's own state of the claim.
  std::shared_ptr<const void> state;
  /// True when the ticket holds a claim's state.
  explicit operator bool() const noexcept { return state != nullptr; }
};

/// The answer of a claim, with what is known of the first attempt (for duplicate logs).
struct ClaimResult {
  /// claimed, busy, done or mismatch.
  ClaimStatus status = ClaimStatus::kClaimed;
  /// kDone: the stored response bytes.
  std::string response;
  /// kClaimed: true when an expired lease of another attempt was taken over.
  bool took_over = false;
  /// kClaimed: the record was already this attempt's own in-progress claim (a claim retried
  /// after its answer was lost); nothing was written, the record stays as it was.
  bool kept = false;
  /// kDone: true when the record ended as failed (a poison MQ message); `response` holds the
  /// failure reason.
  bool failed = false;
  /// kBusy/kDone/kMismatch: the owner token of the attempt that holds or completed the record
  /// (empty when the store does not keep it).
  std::string holder;
  /// kBusy/kDone/kMismatch: when the record was first created (epoch when unknown).
  TimePoint first_seen{};
  /// kDone: when the record's retention ends (epoch when the store does not report it).
  TimePoint expires_at{};
  /// kClaimed by a fast store: what its completion may use (FastStore::complete_claimed).
  ClaimTicket ticket;
};

/// What the durable store reported of the first attempt of a record written back to the fast
/// store (FastStore::refill): its answer's ClaimResult::first_seen and ClaimResult::holder.
/// The view need only last for the call.
struct RecordOrigin {
  /// When the first attempt created the record (epoch when unknown: the write-back's time).
  TimePoint first_seen{};
  /// The owner token of the attempt that completed it (empty when unknown).
  std::string_view holder;
};

/// A record as a store keeps it (for lookup, operators and tests).
struct Record {
  /// The record's state.
  enum class Status { kInProgress, kCompleted, kFailed };
  Status status = Status::kInProgress;  ///< in progress, completed, or failed (final rejection)
  std::string fingerprint;              ///< the first attempt's payload fingerprint
  std::string owner;                    ///< the owner token of the attempt holding or completing it
  std::string response;                 ///< completed: the stored response bytes
  TimePoint lease_until{};              ///< in progress: when the lease ends
  TimePoint created_at{};               ///< when the first attempt created it
  TimePoint updated_at{};               ///< its last change
  /// Completed: when the record may be purged.
  TimePoint expires_at{};
};

/// Stable name of a record status as stored in SQL tables: in_progress, completed, failed.
constexpr std::string_view record_status_name(Record::Status s) noexcept {
  switch (s) {
    case Record::Status::kInProgress: return "in_progress";
    case Record::Status::kCompleted: return "completed";
    case Record::Status::kFailed: return "failed";
  }
  return "unknown";
}

/// One claim of a batch (FastStore::claim_batch). The pointed-to key and owner must outlive the
/// call.
struct ClaimRequest {
  /// The key to claim.
  const Key* key = nullptr;
  /// Compared exactly with the record's (a difference answers kMismatch).
  std::string_view fingerprint;
  /// The attempt's owner token.
  const OwnerToken* owner = nullptr;
};

/// One completion of a batch (FastStore::complete_batch). Pointers must outlive the call.
struct CompleteRequest {
  /// The key to complete.
  const Key* key = nullptr;
  /// The owner token its claim was made with.
  const OwnerToken* owner = nullptr;
  /// The response bytes to keep.
  std::string_view response;
  /// The ticket of the claim being completed (ClaimResult::ticket), or null.
  const ClaimTicket* ticket = nullptr;
};

/// Fast store: the claim at the entrance (one round trip where the backend allows).
/// Implementations must be thread-safe.
///
/// Every method throws idem::StorageError (or a subclass) when the backend fails; to the guard,
/// a fast-store failure means "go on with the durable store and count the call as degraded".
class FastStore {
 public:
  virtual ~FastStore() = default;

  /// Atomically claims `key` for `lease` on behalf of `owner`, or reports who holds it.
  /// @param key         the operation's key
  /// @param fingerprint compared exactly with the record's; a difference answers kMismatch.
  /// @param owner       this attempt's token (complete and release must present it)
  /// @param lease       how long the claim is honoured before another attempt may take over
  virtual ClaimResult claim(const Key& key, std::string_view fingerprint,
                            const OwnerToken& owner, std::chrono::milliseconds lease) = 0;

  /// Marks `key` completed with `response`, kept for `retention`, if `owner` still holds it.
  /// @return false when the lease was lost (expired and taken over, released, or absent).
  virtual bool complete(const Key& key, const OwnerToken& owner, std::string_view response,
                        std::chrono::seconds retention) = 0;

  /// Completes the claim that answered with `ticket` (ClaimResult::ticket of this attempt's
  /// claim), as complete() does; a store that issues tickets may complete faster with it.
  /// This default ignores the ticket.
  /// @return false when the lease was lost (as complete).
  virtual bool complete_claimed(const Key& key, const OwnerToken& owner, const ClaimTicket& ticket,
                                std::string_view response, std::chrono::seconds retention) {
    (void)ticket;
    return complete(key, owner, response, retention);
  }

  /// Marks `owner`'s in-progress record failed, kept for `retention` with `reason` as its
  /// response (a poison MQ message handed to the dead-letter sink): claims then answer kDone
  /// with ClaimResult::failed and lookup reports Record::Status::kFailed.
  /// @return false when the lease was lost (as complete).
  virtual bool fail(const Key& key, const OwnerToken& owner, std::string_view reason,
                    std::chrono::seconds retention) = 0;

  /// Removes the in-progress claim of `owner` so a retry can run at once.
  /// @return false when `owner` did not hold it.
  virtual bool release(const Key& key, const OwnerToken& owner) = 0;

  /// Keeps `owner`'s in-progress claim of `key` alive: its lease ends `lease` from now (the
  /// guard's heartbeat for long handlers, GuardOptions::heartbeat). Only the claim's holder
  /// extends it, as `complete` only completes for it.
  /// @return false when `owner` no longer holds the claim (completed, released, or taken over
  ///         after its lease ended): the attempt is fenced.
  /// @throws idem::UsageError when the store cannot extend leases (this default);
  ///         idem::StorageError subclasses.
  virtual bool extend(const Key& key, const OwnerToken& owner, std::chrono::milliseconds lease) {
    (void)key;
    (void)owner;
    (void)lease;
    throw UsageError(std::string(name()) + ": this fast store cannot extend a lease");
  }

  /// Writes a completed record unconditionally (refill from the durable store after the fast
  /// store lost it). Overwrites whatever is there.
  virtual void fill(const Key& key, std::string_view fingerprint, std::string_view response,
                    std::chrono::seconds retention) = 0;

  /// Writes back a completed record the durable store replayed, as fill() does, keeping what
  /// the durable store reported of its first attempt (`origin`: its creation time and owner
  /// token) for the duplicates the fast store answers from it: they report when the first
  /// attempt began and who ran it, not when and by whom the record was written back. The
  /// guards write back with refill(). This default calls fill() (the record reports the time
  /// it was written back and no owner); MemoryStore keeps both, RedisStore the creation time
  /// (its completed records keep no owner).
  virtual void refill(const Key& key, std::string_view fingerprint, std::string_view response,
                      std::chrono::seconds retention, const RecordOrigin& origin) {
    (void)origin;
    fill(key, fingerprint, response, retention);
  }

  /// Reads a record without changing it (operators, tests). nullopt when absent or expired.
  virtual std::optional<Record> lookup(const Key& key) = 0;

  /// A short name for logs and metrics labels ("memory", "redis").
  virtual std::string_view name() const noexcept = 0;

  /// Claims several keys: answer `i` is exactly what `claim(*requests[i].key, ...)` would have
  /// answered had the claims been made one after the other in order (a key twice in one batch:
  /// the second sees the first's claim). Stores that can, send them in one round trip (Redis
  /// pipelines them); this default calls claim() in a loop.
  /// @throws as claim; when it throws, some claims of the batch may have been granted (they
  ///         end with their lease).
  virtual std::vector<ClaimResult> claim_batch(const std::vector<ClaimRequest>& requests,
                                               std::chrono::milliseconds lease) {
    std::vector<ClaimResult> out;
    out.reserve(requests.size());
    for (const auto& r : requests) out.push_back(claim(*r.key, r.fingerprint, *r.owner, lease));
    return out;
  }

  /// Completes several claims: answer `i` is what `complete(*requests[i].key, ...)` would
  /// answer (false: that lease was lost). One round trip where the store can (Redis
  /// pipelines); this default calls complete_claimed() (complete() without a ticket) in a loop.
  /// @throws as complete; when it throws, some completions may have been applied.
  virtual std::vector<bool> complete_batch(const std::vector<CompleteRequest>& requests,
                                           std::chrono::seconds retention) {
    std::vector<bool> out;
    out.reserve(requests.size());
    for (const auto& r : requests) {
      out.push_back(r.ticket != nullptr
                        ? complete_claimed(*r.key, *r.owner, *r.ticket, r.response, retention)
                        : complete(*r.key, *r.owner, r.response, retention));
    }
    return out;
  }
};

}  // namespace idem
