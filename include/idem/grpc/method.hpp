// SPDX-License-Identifier: MIT
// idem::grpc::Method: an idempotent unary gRPC method (synchronous or callback API), safe under
// client retries and hedged attempts. Target idem::grpc (grpc++, protobuf).
//
// File: grpc/method.hpp
//
// Used inside the method's implementation:
//
// @code
//   idem::grpc::MethodOptions options;
//   options.method = "/payments.v1.Payments/Charge";
//   options.replay_trailers = {"payments-decline-code"};  // replayed with the stored status
//   idem::grpc::Method charge{guard, options};
//
//   grpc::Status Charge(grpc::ServerContext* ctx, const ChargeRequest* req,
//                       ChargeReply* reply) override {
//     return charge.handle(*ctx, *req, reply, [&](idem::sqlite::Transaction& tx) {
//       tx.exec("INSERT INTO payment ...");       // commits together with the record
//       reply->set_payment_no(...);
//       return grpc::Status::OK;                  // or a final business error: stored too
//     });
//   }
// @endcode
//
// What a call gets (the status codes are idem::grpc_status_code; every answer idem makes itself
// carries the trailing metadata `idempotency-error: <errc name>`):
//
//   no idempotency-key, key required (default)   INVALID_ARGUMENT   missing_key
//   more than one, or a value breaking the rules INVALID_ARGUMENT   invalid_key
//   first call with this key                     the handler's status, response and trailers
//   same key and request, first call completed   the stored status, message, details, response
//                                                bytes and the trailers named in
//                                                MethodOptions::replay_trailers, plus
//                                                `idempotent-replayed: true`
//   same key, first call still running           ABORTED + `grpc-retry-pushback-ms`
//   same key, different request                  FAILED_PRECONDITION fingerprint_mismatch
//   a lost lease (two-phase)                     ABORTED + `grpc-retry-pushback-ms`
//   an idem store failed                         UNAVAILABLE (unavailable, timeout, outcome
//                                                unknown: retryable) or INTERNAL
//
// The key the store sees is scoped: scope = MethodOptions::scope (by default the method's full
// name with '/' turned into '.'), id = SHA-256 of (principal, full method name, client key), so
// one caller never receives another caller's stored reply and two methods never share a key.
// The principal comes from the call's auth context (its authenticated peer identity) or from
// MethodOptions::principal.
//
// The fingerprint covers the full method name, the metadata named in
// MethodOptions::fingerprint_metadata and the request's *deterministic* protobuf serialization
// (map entries sorted by key; unknown fields included as received) or the bytes
// MethodOptions::fingerprint returns. docs/grpc.md lists what that does and does not cover.
//
// The handler is `R(Transaction&)` (transactional: its writes commit with the record) or `R()`
// (two-phase), as for IdempotencyGuard::run, where R is `grpc::Status` or idem::grpc::Reply
// (a status plus trailing metadata). It fills `*response`. Statuses that
// MethodOptions::store_status rejects (by default the transient ones: UNAVAILABLE, ABORTED,
// INTERNAL, ...) are answered to this caller but not stored: the transaction rolls back and the
// claim is released, so a retry runs again. A handler that throws: the claim is released and
// the exception propagates unchanged (grpc++ answers UNKNOWN), an idem::Error too, except a
// storage failure of the handler's own SQL (StorageError, LeaseLost), answered as one.
//
// Namespace note: this namespace is `idem::grpc`; inside namespace idem write `::grpc::` for
// grpc++'s names, and avoid `using namespace idem;` next to `grpc::...` (ambiguous).
#pragma once

#include <google/protobuf/message_lite.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <stdexcept>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/detail/handler_error.hpp"
#include "idem/errors.hpp"
#include "idem/export.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/key.hpp"

namespace idem::grpc {

/// The client metadata that carries the idempotency key, unless MethodOptions::key_metadata
/// names another.
inline constexpr std::string_view kKeyMetadata = "idempotency-key";
/// Trailing metadata added to replayed answers (value "true").
inline constexpr std::string_view kReplayedMetadata = "idempotent-replayed";
/// Trailing metadata naming the idem::errc of every answer idem makes itself (errc_name).
inline constexpr std::string_view kErrorMetadata = "idempotency-error";
/// Trailing metadata of ABORTED answers: how long a client retry policy waits (gRFC A6).
inline constexpr std::string_view kPushbackMetadata = "grpc-retry-pushback-ms";

/// One metadata entry: a lower-case name and its value (binary when the name ends in "-bin").
using Metadata = std::pair<std::string, std::string>;

/// What a handler answers: a status and trailing metadata. A handler may return a plain
/// `grpc::Status` instead (no trailing metadata).
struct Reply {
  /// The call's status (code, message, binary details).
  ::grpc::Status status;
  /// Trailing metadata sent with it. Those named in MethodOptions::replay_trailers are stored
  /// and replayed; the others reach this caller only. An entry gRPC would refuse (a name
  /// outside lower-case [0-9a-z_.-], or, for a name not ending in "-bin", a value with a byte
  /// outside printable ASCII 0x20-0x7E: a non-ASCII name, a line break) is dropped, neither
  /// sent nor stored (grpc++ aborts the process on it); send such values in a "-bin" entry.
  std::vector<Metadata> trailers;

  /// OK, no trailers.
  Reply() = default;
  /// `status`, no trailers (implicit, so a handler can return a grpc::Status).
  Reply(::grpc::Status s) : status(std::move(s)) {}  // NOLINT(google-explicit-constructor)
  /// `status` with trailing metadata.
  Reply(::grpc::Status s, std::vector<Metadata> t) : status(std::move(s)), trailers(std::move(t)) {}
};

/// The default MethodOptions::store_status: true for OK and for the codes that are a final
/// answer to this request (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED,
/// FAILED_PRECONDITION, OUT_OF_RANGE, UNAUTHENTICATED); false for the transient ones
/// (CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, UNIMPLEMENTED, INTERNAL,
/// UNAVAILABLE, DATA_LOSS), which a retry should run again.
bool is_final_status(::grpc::StatusCode code) noexcept;

/// The principal of a call as the default MethodOptions::principal derives it: for an
/// authenticated peer `<peer identity property name>=<value>[,<value>...]` (e.g. a verified TLS
/// client certificate's x509_subject_alternative_name), else "" (those callers share one
/// namespace). grpc++'s AuthContext belongs to the connection: identities an
/// AuthMetadataProcessor sets from one call's metadata stay for later calls on that connection,
/// so per-call credentials (bearer tokens) belong in MethodOptions::principal instead.
IDEM_EXPORT std::string peer_principal(const ::grpc::ServerContextBase& context);

/// The request bytes the default fingerprint covers: `message`'s deterministic serialization
/// (fields in field-number order, map entries sorted by key, unknown fields as received).
IDEM_EXPORT std::string deterministic_bytes(const google::protobuf::MessageLite& message);

/// What a call without the key metadata gets.
enum class MissingKey {
  kReject,       ///< INVALID_ARGUMENT missing_key (the default)
  kPassThrough,  ///< the handler runs under a fresh random key: executed every time
};

/// Options of a Method.
struct MethodOptions {
  /// The full method name, "/<package>.<Service>/<Method>" (as grpc::ClientContext and
  /// interceptors spell it). Required; part of every key and fingerprint.
  std::string method;
  /// The idem::Key scope (metrics and logs show it; 1..64 of [A-Za-z0-9._:-]). Empty: `method`
  /// without its leading '/' and with the other '/' as '.', e.g. "payments.v1.Payments.Charge".
  std::string scope;
  /// The client metadata holding the key (lower-case, not "-bin", not "grpc-...").
  std::string key_metadata = std::string(kKeyMetadata);
  /// A call without the key metadata.
  MissingKey missing_key = MissingKey::kReject;
  /// The caller's principal or tenant; empty means peer_principal().
  std::function<std::string(const ::grpc::ServerContextBase&)> principal;
  /// Client metadata covered by the fingerprint besides the method and the request (their
  /// values in the order received; absent and empty differ). Lower-case names.
  std::vector<std::string> fingerprint_metadata;
  /// Returns the request bytes the fingerprint covers, instead of deterministic_bytes(request)
  /// (e.g. a copy of the request with a client timestamp cleared). Empty means the default.
  std::function<std::string(const ::grpc::ServerContextBase&, const google::protobuf::MessageLite&)>
      fingerprint;
  /// Trailing metadata of a Reply that is stored with it and replayed (lower-case names; not
  /// "grpc-..." nor idem's own). Others reach the first caller only.
  std::vector<std::string> replay_trailers;
  /// Which handler statuses are stored and replayed. Empty means is_final_status.
  std::function<bool(::grpc::StatusCode)> store_status;
  /// The `grpc-retry-pushback-ms` of ABORTED answers (in progress, lease lost): how long a
  /// client retry policy waits before the next attempt. Must not be negative.
  std::chrono::milliseconds retry_pushback{200};
  /// A duplicate that finds its key in progress waits up to this long for the first call's
  /// result before answering ABORTED (CallOptions::wait_for_result). 0 (default): the guard's
  /// GuardOptions::wait_for_result. Either way the wait ends at the call's deadline: a client
  /// that has given up is not waited for (it gets DEADLINE_EXCEEDED from its own stack, or the
  /// ABORTED answer if that reaches it before its own timer fires).
  /// Must not be negative.
  std::chrono::milliseconds wait_for_result{0};
};

namespace detail {

/// A request read by MethodCore::prepare: the key and fingerprint, or the answer to give.
struct Prepared {
  std::optional<Key> key;
  char fingerprint_hex[::idem::detail::kSha256HexSize] = {};  ///< when key: SHA-256, hex
  ::grpc::Status refusal;                                     ///< when !key
  std::string_view fingerprint() const noexcept {
    return {fingerprint_hex, sizeof fingerprint_hex};
  }
};

// Thrown through the guard to keep a reply out of the store (rolled back, released). The
// guard counts it as a handler error; its text says why in the "idem handler error" line.
struct DoNotStore : std::runtime_error {
  explicit DoNotStore(int code)
      : std::runtime_error("idem::grpc: the handler's reply (status code " + std::to_string(code) +
                           ") is not stored: sent to this caller only, a retry runs the handler "
                           "again") {}
};

/// Everything of a Method that does not depend on the durable store (src/grpc/method.cpp).
class IDEM_EXPORT MethodCore {
 public:
  /// @throws idem::UsageError / idem::InvalidKey for bad options (see MethodOptions).
  explicit MethodCore(MethodOptions options);

  Prepared prepare(::grpc::ServerContextBase& context,
                   const google::protobuf::MessageLite& request) const;
  bool stores(::grpc::StatusCode code) const;
  /// Removes the trailers gRPC would refuse to send (grpc++ aborts the process on them): a
  /// name that is not a metadata name, an ASCII entry's value outside printable ASCII.
  /// @return how many were removed.
  static std::size_t drop_unsendable(Reply& reply);
  /// The stored form of a reply: status, stored trailers and (when OK) the response bytes.
  std::string encode(const Reply& reply, const google::protobuf::MessageLite& response) const;
  /// Sends the handler's own reply (every trailer).
  ::grpc::Status executed(::grpc::ServerContextBase& context, Reply& reply) const;
  /// Decodes a stored reply into `*response` and the context. @throws idem::CorruptRecord.
  ::grpc::Status replay(::grpc::ServerContextBase& context, std::string_view stored,
                        google::protobuf::MessageLite* response) const;
  /// idem's own answer for `code` (status, idempotency-error, pushback for ABORTED).
  ::grpc::Status refuse(::grpc::ServerContextBase& context, errc code) const;

  const MethodOptions& options() const noexcept { return options_; }

 private:
  ::grpc::Status refuse(::grpc::ServerContextBase& context, errc code, std::string message) const;

  MethodOptions options_;
  std::string pushback_;  // retry_pushback in decimal
};

}  // namespace detail

/// One idempotent unary method (see the file comment). Thread-safe; construct it once per
/// method and call handle() from every call.
/// @tparam Durable the guard's durable store type.
template <class Durable>
class IDEM_EXPORT Method {
 public:
  /// @param guard   the guard (must outlive the method)
  /// @param options the method's options
  /// @throws idem::UsageError when `options.method` is not "/<service>/<method>", a metadata
  ///         name is not valid, or retry_pushback or wait_for_result is negative;
  ///         idem::InvalidKey when the scope
  ///         (given or derived) breaks a scope rule.
  Method(IdempotencyGuard<Durable>& guard, MethodOptions options)
      : guard_(guard), core_(std::move(options)) {}

  /// Runs one call through the guard (see the file comment for every answer).
  /// @param context  the call's ServerContext or CallbackServerContext
  /// @param request  the request message
  /// @param response the response message the handler fills (replays parse into it)
  /// @param handler  `R(Transaction&)` or `R()`, R = grpc::Status or idem::grpc::Reply
  /// @return the status to return (sync API) or to pass to the reactor's Finish (callback API)
  /// @throws whatever the handler throws (after the claim was released)
  template <class Fn>
  ::grpc::Status handle(::grpc::ServerContextBase& context,
                        const google::protobuf::MessageLite& request,
                        google::protobuf::MessageLite* response, Fn&& handler) {
    detail::Prepared prepared = core_.prepare(context, request);
    if (!prepared.key) return prepared.refusal;
    CallOptions call;
    call.wait_for_result = wait_within_deadline(context);
    std::optional<Reply> first;  // the handler's full reply, for this caller
    auto keep = [&](Reply r) -> std::string {
      first = std::move(r);
      detail::MethodCore::drop_unsendable(*first);
      if (!core_.stores(first->status.error_code())) {
        throw detail::DoNotStore{static_cast<int>(first->status.error_code())};
      }
      return core_.encode(*first, *response);
    };
    try {
      using Tx = ::idem::detail::transaction_t<Durable>;
      GuardResult<std::string> r;
      if constexpr (::idem::detail::kTakesTransaction<std::decay_t<Fn>, Tx>) {
        r = guard_.run(*prepared.key, prepared.fingerprint(), call, [&](Tx& tx) {
          response->Clear();  // the store may run the transaction again
          return keep(::idem::detail::call_handler([&] { return Reply(handler(tx)); }));
        });
      } else {
        r = guard_.run(*prepared.key, prepared.fingerprint(), call, [&] {
          response->Clear();
          return keep(::idem::detail::call_handler([&] { return Reply(handler()); }));
        });
      }
      switch (r.outcome) {
        case Outcome::kExecuted:
          return core_.executed(context, *first);
        case Outcome::kReplayed:
          try {
            return core_.replay(context, *r.value, response);
          } catch (const CorruptRecord& e) {
            report_corrupt(*prepared.key, r.source, e);  // as the guard reports its own
            throw;
          }
        case Outcome::kInProgress:
          return core_.refuse(context, errc::kInProgress);
        case Outcome::kFingerprintMismatch:
          return core_.refuse(context, errc::kFingerprintMismatch);
      }
      return core_.refuse(context, errc::kStorageError);
    } catch (const detail::DoNotStore&) {
      return core_.executed(context, *first);
    } catch (const ::idem::detail::HandlerError& h) {
      std::rethrow_exception(h.error);  // the handler's own error, unchanged
    } catch (const Error& e) {
      // The exception's text (backend messages, internal key names) stays on the server; the
      // client gets the code and its public message.
      return core_.refuse(context, e.code());
    }
  }

  /// The options in force (with the derived scope filled in).
  const MethodOptions& options() const noexcept { return core_.options(); }

 private:
  // The wait of this call for a first call in progress: MethodOptions::wait_for_result (else
  // the guard's), cut to the time left before the call's deadline (none: not cut).
  std::chrono::milliseconds wait_within_deadline(const ::grpc::ServerContextBase& context) const {
    using std::chrono::milliseconds;
    milliseconds wait = core_.options().wait_for_result.count() > 0
                            ? core_.options().wait_for_result
                            : guard_.options().wait_for_result;
    if (wait.count() <= 0) return milliseconds{0};
    const auto deadline = context.deadline();
    if (deadline == std::chrono::system_clock::time_point::max()) return wait;
    const auto left =
        std::chrono::duration_cast<milliseconds>(deadline - std::chrono::system_clock::now());
    return std::max(milliseconds{0}, std::min(wait, left));
  }

  // A stored reply that cannot be decoded, told to the observer as a store's failure.
  void report_corrupt(const Key& key, Source source, const Error& e) const noexcept {
    Observer* o = guard_.options().observer.get();
    if (o == nullptr) return;
    const bool fast = source == Source::kFastStore;
    std::string_view name = "unknown";
    if (fast && guard_.fast_store() != nullptr) name = guard_.fast_store()->name();
    if constexpr (IdempotencyGuard<Durable>::kHasDurable) {
      if (!fast && guard_.durable_store() != nullptr) name = guard_.durable_store()->name();
    }
    try {
      o->on_store_error(
          StoreErrorEvent{&key, fast ? StoreRole::kFast : StoreRole::kDurable, name, e});
    } catch (...) {
      // An observer's failure changes no answer.
    }
  }

  IdempotencyGuard<Durable>& guard_;
  detail::MethodCore core_;
};

/// `Method method{guard, options}` deduces the durable store type.
template <class Durable>
Method(IdempotencyGuard<Durable>&, MethodOptions) -> Method<Durable>;

}  // namespace idem::grpc
