// SPDX-License-Identifier: MIT
// examples/grpc_payment: the client side. A channel whose service config retries UNAVAILABLE
// and ABORTED (idem's "in progress", honouring grpc-retry-pushback-ms), one call, and a hedged
// call: the same request sent several times at once on one channel, first OK answer taken.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "payments.grpc.pb.h"

namespace grpc_payment {

namespace pb = ::idem::examples::payments::v1;

/// The client's service config: up to 5 attempts on UNAVAILABLE (store down, server
/// restarting) and ABORTED (idem: in progress / lease lost; the server's
/// grpc-retry-pushback-ms sets the wait), exponential backoff 50 ms .. 1 s. grpc++ (C-core)
/// implements this retryPolicy; it ignores a hedgingPolicy (docs/grpc.md).
inline constexpr const char* kRetryServiceConfig = R"({
  "methodConfig": [{
    "name": [{"service": "idem.examples.payments.v1.Payments"}],
    "retryPolicy": {
      "maxAttempts": 5,
      "initialBackoff": "0.05s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]
    }
  }]
})";

/// The hedging policy a Java or .NET client would use for Charge (5 copies at once, ABORTED and
/// UNAVAILABLE non-fatal). grpc++ parses and ignores it (docs/grpc.md); hedged_charge() puts
/// the same traffic on the wire.
inline constexpr const char* kHedgingServiceConfig = R"({
  "methodConfig": [{
    "name": [{"service": "idem.examples.payments.v1.Payments"}],
    "hedgingPolicy": {
      "maxAttempts": 5,
      "hedgingDelay": "0s",
      "nonFatalStatusCodes": ["UNAVAILABLE", "ABORTED"]
    }
  }]
})";

/// A channel to `address` (insecure, loopback demo) with `service_config` ("" for none).
inline std::shared_ptr<::grpc::Channel> make_channel(
    const std::string& address, const std::string& service_config = kRetryServiceConfig) {
  ::grpc::ChannelArguments args;
  if (!service_config.empty()) args.SetServiceConfigJSON(service_config);
  // Several channels to one server in one process: keep their connections apart.
  args.SetInt("grpc.use_local_subchannel_pool", 1);
  return ::grpc::CreateCustomChannel(address, ::grpc::InsecureChannelCredentials(), args);
}

/// What one attempt (or one call) got.
struct Answer {
  ::grpc::Status status;
  pb::ChargeReply reply;
  /// Trailing metadata, copied.
  std::multimap<std::string, std::string> trailers;
  /// Attempts sent for this answer (hedged_charge: copies).
  int attempts = 1;

  /// The first value of trailer `name`, or "".
  std::string trailer(const std::string& name) const {
    auto it = trailers.find(name);
    return it == trailers.end() ? std::string() : it->second;
  }
  /// True when the server replayed a stored answer.
  bool replayed() const { return trailer("idempotent-replayed") == "true"; }
};

inline void copy_trailers(const ::grpc::ClientContext& ctx, Answer& a) {
  for (const auto& [k, v] : ctx.GetServerTrailingMetadata()) {
    a.trailers.emplace(std::string(k.data(), k.size()), std::string(v.data(), v.size()));
  }
}

/// @throws std::invalid_argument naming `what` when `value` is no gRPC metadata value
/// (printable ASCII): grpc++ would abort the process on it.
inline void require_metadata_value(const std::string& value, const std::string& what) {
  for (char ch : value) {
    if (ch < 0x20 || ch > 0x7e) {
      throw std::invalid_argument(what + " must be printable ASCII (a gRPC metadata value)");
    }
  }
}

/// The metadata of a Charge call. The call waits for the channel to be ready (within its
/// deadline) instead of failing at once while the channel is reconnecting: after one failed
/// connection attempt grpc++ waits about a second before the next, and a fail-fast call (and
/// every retry the policy makes, 50 ms .. 1 s apart) would get UNAVAILABLE in that window. A
/// charge carries its idempotency key, so waiting and then sending it is safe.
/// @throws std::invalid_argument for a key or principal that is no metadata value
/// (require_metadata_value).
inline void prepare(::grpc::ClientContext& ctx, const std::string& key,
                    std::chrono::milliseconds timeout, const std::string& principal) {
  require_metadata_value(key, "the idempotency key");
  require_metadata_value(principal, "the principal");
  ctx.AddMetadata("idempotency-key", key);
  if (!principal.empty()) ctx.AddMetadata("authorization", "Bearer " + principal);
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  ctx.set_wait_for_ready(true);
}

/// One Charge call (the channel's retry policy applies).
inline Answer charge(pb::Payments::Stub& stub, const pb::ChargeRequest& req, const std::string& key,
                     std::chrono::milliseconds timeout = std::chrono::seconds(10),
                     const std::string& principal = "") {
  ::grpc::ClientContext ctx;
  prepare(ctx, key, timeout, principal);
  Answer a;
  a.status = stub.Charge(&ctx, req, &a.reply);
  copy_trailers(ctx, a);
  return a;
}

/// What a hedging client does (gRFC A6, hedgingDelay 0): sends `copies` attempts of the same
/// request with the same key at once on the stub's channel, answers with the first OK one
/// (others that end non-fatally, ABORTED or UNAVAILABLE, are waited out), cancels the rest. If
/// none is OK, answers with the first fatal status, else the last non-fatal one.
inline Answer hedged_charge(pb::Payments::Stub& stub, const pb::ChargeRequest& req,
                            const std::string& key, int copies,
                            std::chrono::milliseconds timeout = std::chrono::seconds(10),
                            const std::string& principal = "") {
  struct Attempt {
    ::grpc::ClientContext ctx;
    pb::ChargeReply reply;
  };
  std::vector<std::unique_ptr<Attempt>> attempts;
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  bool decided = false;
  Answer answer;
  answer.attempts = copies;
  for (int i = 0; i < copies; ++i) {
    attempts.push_back(std::make_unique<Attempt>());
    prepare(attempts.back()->ctx, key, timeout, principal);
  }
  for (int i = 0; i < copies; ++i) {
    Attempt* a = attempts[static_cast<std::size_t>(i)].get();
    stub.async()->Charge(&a->ctx, &req, &a->reply, [&, a](::grpc::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      ++finished;
      auto code = s.error_code();
      bool non_fatal = code == ::grpc::StatusCode::ABORTED ||
                       code == ::grpc::StatusCode::UNAVAILABLE ||
                       code == ::grpc::StatusCode::CANCELLED;
      if (!decided && (s.ok() || !non_fatal || finished == copies)) {
        decided = true;
        answer.status = s;
        answer.reply = a->reply;
        copy_trailers(a->ctx, answer);
        for (auto& other : attempts) {
          if (other.get() != a) other->ctx.TryCancel();  // the hedging client's cancel
        }
      }
      cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return finished == copies; });
  return answer;
}

}  // namespace grpc_payment
