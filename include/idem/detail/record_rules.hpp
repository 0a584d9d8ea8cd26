// SPDX-License-Identifier: MIT
// The record rulebook: every decision a store takes about a record, written once for all stores.
//
// File: detail/record_rules.hpp (internal: store implementations include it, services do not)
//
// Every store keeps the same record (store.hpp) and must answer the same way, whatever it is
// built on. A store only *reads and writes*; what a record it found means is decided here:
//
//   1. It reads what it holds under the key and describes it as a `FoundRecord`: the status
//      (parsed with `parse_record_status`, a value it did not write being `CorruptRecord`), the
//      fingerprint, the owner token, the response, when it was created, and two facts only the
//      store's own clock can tell: whether an in-progress lease is still live, and whether the
//      record's retention has ended.
//   2. `decide_claim(found, fingerprint, owner)` answers what a claim by `owner` means, in this
//      order (the first rule that applies wins):
//
//        retention ended ............... kReplace  remove the record, claim as if it were absent
//        another fingerprint ........... kAnswer   kMismatch (a client error, never a replay)
//        completed / failed ............ kAnswer   kDone (failed: ClaimResult::failed), replay
//        in progress, this owner ....... kKeep     kClaimed + kept: the caller's own claim (a
//                                                  claim retried after its answer was lost);
//                                                  write nothing
//        in progress, lease live ....... kAnswer   kBusy
//        in progress, lease ended ...... kTakeOver kClaimed + took_over: replace the owner,
//                                                  fenced on the old one (write only where the
//                                                  record still has `found.owner`)
//
//      An absent key is always claimed (`ClaimResult{}`, nothing to decide).
//   3. complete, release and fail act only where `may_finish(status, stored owner, owner)`: the
//      record is in progress and still this attempt's. An expired lease that nobody took over
//      still belongs to its owner: finishing it is safe, nobody else can have run. In SQL this
//      is `WHERE <key> AND owner = <owner> AND status = 'in_progress'`.
//
// The status names are those of `record_status_name` (in_progress, completed, failed); a store
// that stores something shorter maps it through `record_status_from_letter` ('P', 'C', 'F').
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "idem/clock.hpp"
#include "idem/errors.hpp"
#include "idem/store.hpp"

namespace idem::detail {

/// A record a store found under a key, described for the rulebook. Views point into the
/// store's own buffers and must outlive the decide_claim call.
struct FoundRecord {
  /// The record's status.
  Record::Status status = Record::Status::kInProgress;
  /// The fingerprint it was claimed with.
  std::string_view fingerprint;
  /// The owner token of the attempt that holds (or completed) it; may be empty (a refilled
  /// record).
  std::string_view owner;
  /// Completed / failed: the stored response (failed: the reason).
  std::string_view response;
  /// When the record was first created (epoch when unknown).
  TimePoint created_at{};
  /// Completed / failed: when its retention ends (epoch when unknown).
  TimePoint expires_at{};
  /// In progress and its lease has not ended, by the store's clock.
  bool lease_live = false;
  /// The record has ended for the protocol, by the store's clock (completed or failed past its
  /// retention; a store may also age out an abandoned in-progress record): treat as absent.
  bool retention_over = false;
};

/// The same description from a record (a Record, or a store's own entry with the same field
/// names) whose liveness and expiry the store's clock decided (SQL stores compute both in the
/// statement that read the row).
template <class R>
FoundRecord found_by_store_clock(const R& r, bool lease_live, bool retention_over) noexcept {
  FoundRecord f;
  f.status = r.status;
  f.fingerprint = r.fingerprint;
  f.owner = r.owner;
  f.response = r.response;
  f.created_at = r.created_at;
  f.expires_at = r.expires_at;
  f.lease_live = lease_live;
  f.retention_over = retention_over;
  return f;
}

/// The same description from a Record read at `now` (stores that keep times as values).
inline FoundRecord found_at(const Record& r, TimePoint now) noexcept {
  return found_by_store_clock(r, r.status == Record::Status::kInProgress && r.lease_until > now,
                              r.status != Record::Status::kInProgress && r.expires_at <= now);
}

/// A claim's answer when another attempt holds the key and the store cannot say who (a lock
/// wait gave up, a uniqueness race was lost to a writer still in flight).
inline ClaimResult busy_claim() {
  ClaimResult c;
  c.status = ClaimStatus::kBusy;
  return c;
}

/// What a store does after a claim found a record (see the file comment).
enum class ClaimAction {
  kAnswer,    ///< write nothing; answer `ClaimDecision::result` (busy, done, mismatch)
  kKeep,      ///< the caller's own in-progress claim: write nothing; answer kClaimed
  kTakeOver,  ///< the lease ended: replace the owner where it is still `found.owner`; kClaimed
  kReplace,   ///< the record ended: remove it and claim as if the key were absent
};

/// The rulebook's answer to a claim that found a record.
struct ClaimDecision {
  /// What the store writes.
  ClaimAction action = ClaimAction::kAnswer;
  /// What the claim answers (for kReplace: a fresh claim's answer, once the store wrote it).
  ClaimResult result;
};

/// What a claim by `owner` with `fingerprint` decides on `found` (see the file comment).
inline ClaimDecision decide_claim(const FoundRecord& found, std::string_view fingerprint,
                                  std::string_view owner) {
  ClaimDecision d;
  if (found.retention_over) {
    d.action = ClaimAction::kReplace;
    return d;
  }
  ClaimResult& c = d.result;
  if (found.fingerprint != fingerprint) {
    c.status = ClaimStatus::kMismatch;
  } else if (found.status != Record::Status::kInProgress) {
    c.status = ClaimStatus::kDone;
    c.failed = found.status == Record::Status::kFailed;
    c.response.assign(found.response.data(), found.response.size());
    c.expires_at = found.expires_at;
  } else if (!owner.empty() && found.owner == owner) {
    d.action = ClaimAction::kKeep;  // claimed, not a takeover
    c.kept = true;
    return d;
  } else if (found.lease_live) {
    c.status = ClaimStatus::kBusy;
  } else {
    d.action = ClaimAction::kTakeOver;
    c.status = ClaimStatus::kClaimed;
    c.took_over = true;
    return d;
  }
  c.holder.assign(found.owner.data(), found.owner.size());
  c.first_seen = found.created_at;
  return d;
}

/// What a read-only check before any claim (a store's precheck) answers from `found`: a
/// replay (kDone) or a mismatch, which need no write; nullopt when only a claim can decide (the
/// retention ended, or the key is in progress with this payload).
inline std::optional<ClaimResult> decide_without_claim(const FoundRecord& found,
                                                       std::string_view fingerprint) {
  if (found.retention_over) return std::nullopt;
  if (found.fingerprint == fingerprint && found.status == Record::Status::kInProgress) {
    return std::nullopt;
  }
  return decide_claim(found, fingerprint, {}).result;
}

/// Whether complete / release / fail by `owner` may act on a record with `status` held by
/// `stored_owner`: in progress and still this attempt's.
constexpr bool may_finish(Record::Status status, std::string_view stored_owner,
                          std::string_view owner) noexcept {
  return status == Record::Status::kInProgress && stored_owner == owner;
}

/// The status named `text` (record_status_name), or nullopt for anything else.
constexpr std::optional<Record::Status> parse_record_status(std::string_view text) noexcept {
  if (text == record_status_name(Record::Status::kInProgress)) return Record::Status::kInProgress;
  if (text == record_status_name(Record::Status::kCompleted)) return Record::Status::kCompleted;
  if (text == record_status_name(Record::Status::kFailed)) return Record::Status::kFailed;
  return std::nullopt;
}

/// One-letter form of a status, for compact encodings: 'P', 'C', 'F'.
constexpr char record_status_letter(Record::Status s) noexcept {
  switch (s) {
    case Record::Status::kInProgress:
      return 'P';
    case Record::Status::kCompleted:
      return 'C';
    case Record::Status::kFailed:
      return 'F';
  }
  return '?';
}

/// The status of letter `c` (record_status_letter), or nullopt.
constexpr std::optional<Record::Status> record_status_from_letter(char c) noexcept {
  switch (c) {
    case 'P':
      return Record::Status::kInProgress;
    case 'C':
      return Record::Status::kCompleted;
    case 'F':
      return Record::Status::kFailed;
    default:
      return std::nullopt;
  }
}

/// The CorruptRecord every store throws for a value it did not write:
/// "<store>: record '<key>' is not an idem record: <what>".
inline CorruptRecord corrupt_record(std::string_view store, std::string_view key,
                                    std::string_view what) {
  std::string s;
  s.reserve(store.size() + key.size() + what.size() + 40);
  s.append(store).append(": record '").append(key).append("' is not an idem record: ");
  s.append(what);
  return CorruptRecord(s);
}

/// parse_record_status, or CorruptRecord naming the store, the key and the value.
inline Record::Status record_status_or_throw(std::string_view text, std::string_view store,
                                             std::string_view key) {
  if (auto s = parse_record_status(text)) return *s;
  std::string what = "unknown status '";
  what.append(text.substr(0, 32)).append("'");
  throw corrupt_record(store, key, what);
}

/// The same, naming `key`: its text is composed only for an unknown status (not on every read).
inline Record::Status record_status_or_throw(std::string_view text, std::string_view store,
                                             const Key& key) {
  if (auto s = parse_record_status(text)) return *s;
  return record_status_or_throw(text, store, key.str());
}

}  // namespace idem::detail
