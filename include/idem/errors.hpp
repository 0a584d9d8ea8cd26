// SPDX-License-Identifier: MIT
// idem's error vocabulary: one `idem::errc` enum, its std::error_category, and the exceptions.
//
// File: errors.hpp
//
// Expected results of an idempotent call (executed, replayed, in progress, fingerprint mismatch)
// are *values* (see outcome.hpp). What is thrown is a failure of the caller's input or of the
// infrastructure, and every such failure carries an `idem::errc`:
//
//   * a stable snake_case name (`errc_name`), for logs, metrics labels and problem+json `type`;
//   * an HTTP status (`http_status`) following the IETF Idempotency-Key draft
//     (400 invalid key, 403 unknown token, 409 in progress, 413 body too large, 422 payload
//     mismatch, 503 store unavailable), and a gRPC status code (`grpc_status_code`:
//     INVALID_ARGUMENT, ABORTED, FAILED_PRECONDITION, UNAVAILABLE);
//   * whether calling again with the same key is safe and may succeed (`is_retryable`).
//
// The exception hierarchy is small on purpose; the actionable question lives on the base class:
//
//   Error                      everything idem throws (std::runtime_error)
//   +-- UsageError             a caller bug: bad option, bad identifier
//   |   +-- InvalidKey         a key broke a named rule (rule()); nothing was stored
//   +-- StorageError           I/O, protocol, SQL; carries the backend's message
//   |   +-- StorageUnavailable can't reach the store (refused, pool exhausted, loading) [retryable]
//   |   +-- StorageTimeout     the store did not answer in time                      [retryable]
//   |   +-- OutcomeUnknown     a write may or may not have been applied (lost at COMMIT)
//   |                                                                                 [retryable]
//   |   +-- CorruptRecord      a value under an idem key that idem did not write
//   +-- LeaseLost              this attempt's lease was taken over; its completion was refused
//   +-- Cancelled              the caller cancelled an asynchronous call               [retryable]
//   +-- DeadlineExceeded       an asynchronous call ran past its deadline              [retryable]
//
// `OutcomeUnknown` is the reason idempotency exists: a client that cannot tell whether its
// payment committed retries with the same key, and the retry either replays the committed
// response or runs the operation for the first time. It is always safe to retry.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

#include "idem/export.hpp"

namespace idem {

/// Every failure idem reports. Values are stable: they appear in logs and dashboards.
enum class errc {
  kInvalidKey = 1,           ///< key broke a rule (charset, length, empty); 400
  kMissingKey = 2,           ///< a required Idempotency-Key was not sent; 400
  kInProgress = 3,           ///< another attempt holds the key; 409 (also an Outcome)
  kFingerprintMismatch = 4,  ///< same key, different payload; 422 (also an Outcome)
  kStoreUnavailable = 5,     ///< store unreachable (refused, pool exhausted, loading, full); 503
  kStoreTimeout = 6,         ///< store did not answer in time; 503
  kStorageError = 7,         ///< backend error (SQL, protocol, authentication); 500
  kOutcomeUnknown = 8,       ///< a write may have been applied; retry with the same key; 503
  kCorruptRecord = 9,        ///< a value under an idem key is not idem's; 500
  kLeaseLost = 10,           ///< another attempt took the lease over; retry replays it; 409
  kInvalidArgument = 11,     ///< a caller bug other than the key (options, identifiers); 500
  kUnknownToken = 12,        ///< the key is not a token this server issued (or it expired); 403
  kPayloadTooLarge = 13,     ///< a request body over the endpoint's limit; nothing stored; 413
  kCancelled = 14,         ///< the caller cancelled the call (idem::async); retry with the key; 499
  kDeadlineExceeded = 15,  ///< the call's deadline passed (idem::async); retry with the key; 504
};

/// Stable snake_case name of a code, e.g. "fingerprint_mismatch". Never changes once released.
constexpr std::string_view errc_name(errc e) noexcept {
  switch (e) {
    case errc::kInvalidKey:
      return "invalid_key";
    case errc::kMissingKey:
      return "missing_key";
    case errc::kInProgress:
      return "in_progress";
    case errc::kFingerprintMismatch:
      return "fingerprint_mismatch";
    case errc::kStoreUnavailable:
      return "store_unavailable";
    case errc::kStoreTimeout:
      return "store_timeout";
    case errc::kStorageError:
      return "storage_error";
    case errc::kOutcomeUnknown:
      return "outcome_unknown";
    case errc::kCorruptRecord:
      return "corrupt_record";
    case errc::kLeaseLost:
      return "lease_lost";
    case errc::kInvalidArgument:
      return "invalid_argument";
    case errc::kUnknownToken:
      return "unknown_token";
    case errc::kPayloadTooLarge:
      return "payload_too_large";
    case errc::kCancelled:
      return "cancelled";
    case errc::kDeadlineExceeded:
      return "deadline_exceeded";
  }
  return "unknown";
}

/// HTTP status a service should answer with for this code.
constexpr int http_status(errc e) noexcept {
  switch (e) {
    case errc::kInvalidKey:
    case errc::kMissingKey:
      return 400;
    case errc::kUnknownToken:
      return 403;
    case errc::kInProgress:
    case errc::kLeaseLost:
      return 409;
    case errc::kFingerprintMismatch:
      return 422;
    case errc::kPayloadTooLarge:
      return 413;
    case errc::kStoreUnavailable:
    case errc::kStoreTimeout:
    case errc::kOutcomeUnknown:
      return 503;
    case errc::kStorageError:
    case errc::kCorruptRecord:
    case errc::kInvalidArgument:
      return 500;
    case errc::kCancelled:
      return 499;  // "client closed request": nobody waits for the answer
    case errc::kDeadlineExceeded:
      return 504;
  }
  return 500;
}

/// gRPC status code (the numeric value of `grpc::StatusCode`, fixed by the gRPC protocol) a
/// service should answer with for this code: INVALID_ARGUMENT (3) for a bad or missing key,
/// ABORTED (10) for in progress and a lost lease (a retry with the same key replays),
/// FAILED_PRECONDITION (9) for a payload mismatch (the key's earlier use, not this request,
/// makes it fail), PERMISSION_DENIED (7) for a key that is not an issued token,
/// RESOURCE_EXHAUSTED (8) for a request over the size limit, CANCELLED (1) and
/// DEADLINE_EXCEEDED (4) for a cancelled or late asynchronous call, UNAVAILABLE (14) for every
/// retryable store failure (so client retry policies on UNAVAILABLE cover them), INTERNAL (13)
/// otherwise. idem::grpc answers with these.
constexpr int grpc_status_code(errc e) noexcept {
  switch (e) {
    case errc::kInvalidKey:
    case errc::kMissingKey:
      return 3;
    case errc::kInProgress:
    case errc::kLeaseLost:
      return 10;
    case errc::kFingerprintMismatch:
      return 9;
    case errc::kUnknownToken:
      return 7;
    case errc::kPayloadTooLarge:
      return 8;
    case errc::kCancelled:
      return 1;  // CANCELLED
    case errc::kDeadlineExceeded:
      return 4;  // DEADLINE_EXCEEDED
    case errc::kStoreUnavailable:
    case errc::kStoreTimeout:
    case errc::kOutcomeUnknown:
      return 14;
    case errc::kStorageError:
    case errc::kCorruptRecord:
    case errc::kInvalidArgument:
      return 13;
  }
  return 13;
}

/// True if calling again with the same key (after a pause) is safe and may succeed.
constexpr bool is_retryable(errc e) noexcept {
  switch (e) {
    case errc::kInProgress:
    case errc::kStoreUnavailable:
    case errc::kStoreTimeout:
    case errc::kOutcomeUnknown:
    case errc::kLeaseLost:
    case errc::kCancelled:
    case errc::kDeadlineExceeded:
      return true;
    default:
      return false;
  }
}

/// Human-readable message of a code (the `what()` of an exception adds the detail).
constexpr std::string_view errc_message(errc e) noexcept {
  switch (e) {
    case errc::kInvalidKey:
      return "the idempotency key is not valid";
    case errc::kMissingKey:
      return "an idempotency key is required and was not sent";
    case errc::kInProgress:
      return "a request with this key is still being processed";
    case errc::kFingerprintMismatch:
      return "this key was used with a different request payload";
    case errc::kStoreUnavailable:
      return "the idempotency store is unavailable";
    case errc::kStoreTimeout:
      return "the idempotency store did not answer in time";
    case errc::kStorageError:
      return "the idempotency store failed";
    case errc::kOutcomeUnknown:
      return "the outcome of a write is unknown; retry with the same key";
    case errc::kCorruptRecord:
      return "an idempotency record is corrupt or was not written by idem";
    case errc::kLeaseLost:
      return "the lease on this key was taken over by another attempt";
    case errc::kInvalidArgument:
      return "invalid argument";
    case errc::kUnknownToken:
      return "the idempotency key is not a token this server issued, or it expired";
    case errc::kPayloadTooLarge:
      return "the request body is larger than this endpoint accepts";
    case errc::kCancelled:
      return "the call was cancelled; retry with the same key";
    case errc::kDeadlineExceeded:
      return "the call's deadline passed; retry with the same key";
  }
  return "unknown idem error";
}

namespace detail {
class IDEM_EXPORT ErrorCategory final : public std::error_category {
 public:
  const char* name() const noexcept override { return "idem"; }
  std::string message(int ev) const override {
    return std::string(errc_message(static_cast<errc>(ev)));
  }
};
}  // namespace detail

/// The "idem" error category. One object per process, also with idem's shared libraries
/// (exported: error codes compare equal whichever library made them).
IDEM_EXPORT inline const std::error_category& error_category() noexcept {
  static const detail::ErrorCategory category;
  return category;
}

/// Makes `std::error_code ec = idem::errc::kInProgress;` work.
inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

/// Base of everything idem throws.
class IDEM_EXPORT Error : public std::runtime_error {
 public:
  /// @param code the failure's idem code; @param what the message (`what()`), with the detail
  Error(errc code, const std::string& what) : std::runtime_error(what), code_(code) {}
  /// The idem code of this failure.
  errc code() const noexcept { return code_; }
  /// The same as a std::error_code in the "idem" category.
  std::error_code error_code() const noexcept { return make_error_code(code_); }
  /// True if calling again with the same key is safe and may succeed.
  bool retryable() const noexcept { return is_retryable(code_); }
  /// The HTTP status to answer with.
  int http_status() const noexcept { return idem::http_status(code_); }

 private:
  errc code_;
};

/// A caller bug: a bad option, a bad identifier. Fix the code; retrying does not help.
class IDEM_EXPORT UsageError : public Error {
 public:
  /// errc::kInvalidArgument with `what` as the message.
  explicit UsageError(const std::string& what) : Error(errc::kInvalidArgument, what) {}

 protected:
  /// For subclasses with their own code (InvalidKey).
  UsageError(errc code, const std::string& what) : Error(code, what) {}
};

/// A key broke one of the rules in key.hpp. `rule()` names it, e.g. "scope.charset".
class IDEM_EXPORT InvalidKey : public UsageError {
 public:
  /// @param rule the rule that failed (see rule()); @param detail what was wrong, for what()
  InvalidKey(std::string rule, const std::string& detail)
      : UsageError(errc::kInvalidKey, "invalid idempotency key: " + rule + ": " + detail),
        rule_(std::move(rule)) {}
  /// The rule that failed: scope.empty, scope.too_long, scope.charset, id.empty, id.too_long,
  /// id.charset, key.separator. (A key not sent at all is errc::kMissingKey, not an
  /// InvalidKey.)
  const std::string& rule() const noexcept { return rule_; }

 private:
  std::string rule_;
};

/// A failure of a store: I/O, protocol, SQL. `what()` keeps the backend's message.
class IDEM_EXPORT StorageError : public Error {
 public:
  /// errc::kStorageError with `what` (the backend's message included) as the message.
  explicit StorageError(const std::string& what) : Error(errc::kStorageError, what) {}

 protected:
  /// For subclasses with their own code.
  StorageError(errc code, const std::string& what) : Error(code, what) {}
};

/// The store cannot be reached: connection refused, pool exhausted, server loading or down.
class IDEM_EXPORT StorageUnavailable : public StorageError {
 public:
  /// errc::kStoreUnavailable with `what` as the message.
  explicit StorageUnavailable(const std::string& what)
      : StorageError(errc::kStoreUnavailable, what) {}
};

/// The store did not answer within the configured time.
class IDEM_EXPORT StorageTimeout : public StorageError {
 public:
  /// errc::kStoreTimeout with `what` as the message.
  explicit StorageTimeout(const std::string& what) : StorageError(errc::kStoreTimeout, what) {}
};

/// A write may or may not have been applied (e.g. the connection died during COMMIT).
/// Retrying with the same key is always safe: it replays or runs for the first time.
class IDEM_EXPORT OutcomeUnknown : public StorageError {
 public:
  /// errc::kOutcomeUnknown with `what` as the message.
  explicit OutcomeUnknown(const std::string& what) : StorageError(errc::kOutcomeUnknown, what) {}
};

/// A value under an idem key that idem did not write, or that cannot be decoded.
class IDEM_EXPORT CorruptRecord : public StorageError {
 public:
  /// errc::kCorruptRecord with `what` as the message.
  explicit CorruptRecord(const std::string& what) : StorageError(errc::kCorruptRecord, what) {}
};

/// This attempt's lease expired and another attempt took the key over; this attempt's
/// completion was refused. Retrying with the same key replays the winner's response.
class IDEM_EXPORT LeaseLost : public Error {
 public:
  /// errc::kLeaseLost with `what` as the message.
  explicit LeaseLost(const std::string& what) : Error(errc::kLeaseLost, what) {}
};

/// An asynchronous call (idem::async) was cancelled by its caller. Nothing was reported as
/// done: the claim was released where no work had started, or is left to its lease where the
/// work's outcome is unknown. Retrying with the same key replays, waits, or runs.
class IDEM_EXPORT Cancelled : public Error {
 public:
  /// errc::kCancelled with `what` as the message.
  explicit Cancelled(const std::string& what) : Error(errc::kCancelled, what) {}
};

/// An asynchronous call (idem::async) ran past its deadline; what happened to its claim is as
/// for Cancelled. Retrying with the same key replays, waits, or runs.
class IDEM_EXPORT DeadlineExceeded : public Error {
 public:
  /// errc::kDeadlineExceeded with `what` as the message.
  explicit DeadlineExceeded(const std::string& what) : Error(errc::kDeadlineExceeded, what) {}
};

}  // namespace idem

namespace std {
template <>
struct is_error_code_enum<idem::errc> : true_type {};
}  // namespace std
