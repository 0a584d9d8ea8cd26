// SPDX-License-Identifier: MIT
// examples/grpc_payment: Payments.Charge on grpc++'s callback API, through idem::async::AsyncGuard
// on an Asio loop. No gRPC thread waits for idem: Charge() starts the guarded call and returns
// its reactor; the call's answer (executed, replayed, in progress, mismatch, an idem error)
// finishes the reactor from the loop.
//
//   transactional (default) ... the booking's transaction on the worker pool (its writes commit
//                               with the idempotency record)
//   two-phase (--gateway-ms) .. the card gateway call is a timer on the loop (an asynchronous
//                               client: no thread waits for it), then the booking on the pool;
//                               the handler answers through its idem::async::Reply
//
// The same key, fingerprint and replay rules as the synchronous service (idem::grpc's method
// core: the scoped key, the deterministic request bytes, the stored status, trailers and
// response). The library has no asynchronous idem::grpc::Method yet: this file is its few lines.
//
// A client that cancels, or whose deadline passes, cancels the guarded call (the reactor's
// OnCancel emits its CancelSignal; the deadline is the call's): the protocol ends safely in the
// background (docs/async.md). The handler never touches gRPC's objects: it fills a reply of its
// own, copied into the call's response when the reactor finishes.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "idem/async/guard.hpp"
#include "payment_service.hpp"

namespace grpc_payment {

/// Payments.Charge as a callback service on an AsyncGuard (see the file comment).
/// @tparam Ledger SqliteLedger or PostgresLedger
/// @tparam Durable the guard's durable store (PooledDurable<SqliteStore>, AsyncPostgresStore)
template <class Ledger, class Durable>
class AsyncPaymentService final : public pb::Payments::CallbackService {
 public:
  /// `guard` runs on `loop`; blocking ledger work runs on `pool`. All must outlive the service.
  AsyncPaymentService(idem::async::AsyncGuard<Durable>& guard, Ledger& ledger,
                      idem::async::WorkerPool& pool, ServiceOptions options = {})
      : guard_(guard),
        ledger_(ledger),
        pool_(pool),
        options_(options),
        core_(PaymentService<Ledger>::method_options(options.retry_pushback)) {}

  ::grpc::ServerUnaryReactor* Charge(::grpc::CallbackServerContext* ctx,
                                     const pb::ChargeRequest* req,
                                     pb::ChargeReply* response) override {
    auto* reactor = new Reactor();  // deletes itself in OnDone
    if (req->account().empty() || req->amount_cents() <= 0) {
      reactor->Finish(::grpc::Status(::grpc::StatusCode::INVALID_ARGUMENT,
                                     "account and a positive amount_cents are required"));
      return reactor;
    }
    idem::grpc::detail::Prepared prepared = core_.prepare(*ctx, *req);
    if (!prepared.key) {
      reactor->Finish(prepared.refusal);
      return reactor;
    }
    auto call = std::make_shared<Call>();
    call->ctx = ctx;
    call->request = *req;
    call->response = response;
    call->reactor = reactor;
    call->principal = bearer_principal(*ctx);
    call->key = client_key(*ctx);
    idem::async::CallOptions co;
    co.cancel = reactor->cancel;
    const auto deadline = ctx->deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      co.deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        deadline - std::chrono::system_clock::now());
    }
    auto done = [this, call](std::exception_ptr e, idem::GuardResult<std::string> r) {
      finish(*call, std::move(e), std::move(r));
    };
    if (options_.gateway.count() >= 0) {
      guard_.async_run(*prepared.key, prepared.fingerprint(), co,
                       idem::async::with_reply<std::string>(
                           [this, call](idem::async::Reply<std::string> reply) {
                             gateway(call, std::move(reply));
                           }),
                       std::move(done));
    } else {
      guard_.async_run(*prepared.key, prepared.fingerprint(), co,
                       [this, call](typename Ledger::Tx& tx) {
                         pause(options_.slow);
                         call->reply.Clear();  // the store may run the transaction again
                         return keep(*call, ledger_.charge(tx, call->principal, call->key,
                                                           call->request, &call->reply));
                       },
                       std::move(done));
    }
    return reactor;
  }

 private:
  // A unary reactor whose cancellation (client cancel, deadline) cancels the guarded call.
  class Reactor final : public ::grpc::ServerUnaryReactor {
   public:
    std::shared_ptr<idem::async::CancelSignal> cancel =
        std::make_shared<idem::async::CancelSignal>();
    void OnCancel() override { cancel->emit(); }
    void OnDone() override { delete this; }
  };

  // One call. gRPC's objects (ctx, response, reactor) are used only before Finish, by the
  // guard's completion; the handler works on copies.
  struct Call {
    ::grpc::CallbackServerContext* ctx = nullptr;
    pb::ChargeReply* response = nullptr;
    Reactor* reactor = nullptr;
    pb::ChargeRequest request;
    pb::ChargeReply reply;  // the handler's
    std::string principal, key;
    std::optional<idem::grpc::Reply> first;  // the handler's full reply, for this caller
  };

  // The stored form of the handler's reply, or DoNotStore (the guard releases the key).
  std::string keep(Call& call, idem::grpc::Reply r) {
    call.first = std::move(r);
    if (!core_.stores(call.first->status.error_code())) {
      throw idem::grpc::detail::DoNotStore{static_cast<int>(call.first->status.error_code())};
    }
    return core_.encode(*call.first, call.reply);
  }

  // Two-phase: the gateway (a timer on the loop: nothing waits), then the booking on the pool.
  void gateway(std::shared_ptr<Call> call, idem::async::Reply<std::string> reply) {
    auto timer = std::make_shared<idem::async::net::steady_timer>(guard_.executor());
    timer->expires_after(options_.slow + options_.gateway);
    timer->async_wait([this, call, timer, reply = std::move(reply)](
                          const idem::async::error_code&) mutable {
      pool_.submit(
          guard_.executor(),
          [this, call] {
            ledger_.gateway_charge(call->principal + "/" + call->key, call->request);
            call->reply.Clear();
            return ledger_.book(call->principal, call->key, call->request, &call->reply);
          },
          [this, call, reply = std::move(reply)](std::exception_ptr e,
                                                 std::optional<idem::grpc::Reply> r) mutable {
            if (e) return reply.fail(std::move(e));
            try {
              reply(keep(*call, std::move(*r)));
            } catch (...) {
              reply.fail(std::current_exception());
            }
          });
    });
  }

  // On the loop: the guard's answer becomes the reactor's status.
  void finish(Call& call, std::exception_ptr e, idem::GuardResult<std::string> r) {
    ::grpc::Status status;
    try {
      if (e) std::rethrow_exception(e);
      switch (r.outcome) {
        case idem::Outcome::kExecuted:
          *call.response = call.reply;
          status = core_.executed(*call.ctx, *call.first);
          break;
        case idem::Outcome::kReplayed:
          status = core_.replay(*call.ctx, *r.value, call.response);
          break;
        case idem::Outcome::kInProgress:
          status = core_.refuse(*call.ctx, idem::errc::kInProgress);
          break;
        case idem::Outcome::kFingerprintMismatch:
          status = core_.refuse(*call.ctx, idem::errc::kFingerprintMismatch);
          break;
      }
    } catch (const idem::grpc::detail::DoNotStore&) {
      *call.response = call.reply;
      status = core_.executed(*call.ctx, *call.first);
    } catch (const idem::Error& x) {
      // The exception's text stays on the server; the client gets the code.
      status = core_.refuse(*call.ctx, x.code());
    } catch (const std::exception& x) {
      status = ::grpc::Status(::grpc::StatusCode::UNKNOWN, x.what());
    }
    call.reactor->Finish(status);
  }

  static void pause(std::chrono::milliseconds d) {
    if (d.count() > 0) std::this_thread::sleep_for(d);
  }

  idem::async::AsyncGuard<Durable>& guard_;
  Ledger& ledger_;
  idem::async::WorkerPool& pool_;
  ServiceOptions options_;
  idem::grpc::detail::MethodCore core_;
};

}  // namespace grpc_payment
