// SPDX-License-Identifier: MIT
// gRPC test helpers: an in-process server on a free loopback port, a raw (ByteBuffer) call that
// shows the wire bytes, a scripted Payments service for handler behaviours, polling, free ports.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client.hpp"
#include "payment_service.hpp"

namespace idem::test::grpc_support {

namespace pb = ::grpc_payment::pb;
using namespace std::chrono_literals;

/// A loopback port nothing listens on right now: a server to start there, or a store address
/// that refuses connections. Drawn from 20000-31999, below the kernel's ephemeral range (32768
/// and up by default): between this check and the server's bind, the outgoing connection of
/// another test (a port the kernel picks from the ephemeral range) cannot take it.
inline int free_port() {
  static std::atomic<unsigned> next{std::random_device{}()};
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = 20000 + static_cast<int>(next.fetch_add(1) % 12000);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (free) return port;
  }
  throw std::runtime_error("grpc tests: no free loopback port in 20000-31999");
}

/// A grpc++ server on 127.0.0.1:`port` (0: a free port) hosting `services`; shut down on
/// destruction.
class Server {
 public:
  explicit Server(
      std::vector<::grpc::Service*> services,
      std::shared_ptr<::grpc::ServerCredentials> creds = ::grpc::InsecureServerCredentials(),
      int port = 0) {
    ::grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(port), std::move(creds), &port_);
    for (auto* s : services) builder.RegisterService(s);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port_ == 0)
      throw std::runtime_error("grpc test server did not start");
  }
  ~Server() { server_->Shutdown(std::chrono::system_clock::now() + 2s); }
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const noexcept { return port_; }

 private:
  int port_ = 0;
  std::unique_ptr<::grpc::Server> server_;
};

/// What a raw call got: the status, the response's bytes as they came off the wire, trailers.
struct RawAnswer {
  ::grpc::Status status;
  std::string bytes;
  std::multimap<std::string, std::string> trailers;
  std::string trailer(const std::string& name) const {
    auto it = trailers.find(name);
    return it == trailers.end() ? std::string() : it->second;
  }
};

/// Calls `method` with `request`'s bytes through grpc::GenericStub (no parsing on our side).
inline RawAnswer raw_call(const std::shared_ptr<::grpc::Channel>& channel,
                          const std::string& method, const google::protobuf::MessageLite& request,
                          const std::vector<std::pair<std::string, std::string>>& metadata) {
  ::grpc::GenericStub stub(channel);
  ::grpc::ClientContext ctx;
  for (const auto& [k, v] : metadata) ctx.AddMetadata(k, v);
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  std::string serialized = request.SerializeAsString();
  ::grpc::Slice slice(serialized);
  ::grpc::ByteBuffer in(&slice, 1), out;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  RawAnswer a;
  stub.UnaryCall(&ctx, method, ::grpc::StubOptions(), &in, &out, [&](::grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    a.status = std::move(s);
    done = true;
    cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  std::vector<::grpc::Slice> slices;
  if (a.status.ok() && out.Dump(&slices).ok()) {
    for (const auto& s : slices) a.bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  for (const auto& [k, v] : ctx.GetServerTrailingMetadata()) {
    a.trailers.emplace(std::string(k.data(), k.size()), std::string(v.data(), v.size()));
  }
  return a;
}

/// A charge request for `account`.
inline pb::ChargeRequest charge_request(const std::string& account, std::int64_t amount,
                                        const std::string& order_no = "ORD-1") {
  pb::ChargeRequest r;
  r.set_account(account);
  r.set_amount_cents(amount);
  r.set_currency("EUR");
  r.set_order_no(order_no);
  return r;
}

/// Polls `ready` every 5 ms for up to `limit`; true when it became true.
inline bool eventually(const std::function<bool()>& ready, std::chrono::milliseconds limit = 10s) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (ready()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return ready();
}

/// Payments.Charge whose behaviour a test scripts: the handler gets the call's number (1, 2,
/// ...), the request and the reply to fill; it runs through a Method with the test's options.
/// @tparam Durable the guard's durable store (its transaction is the handler's first argument)
template <class Durable>
class ScriptedPayments final : public pb::Payments::Service {
 public:
  using Tx = ::idem::detail::transaction_t<Durable>;
  using Handler =
      std::function<::idem::grpc::Reply(Tx*, int, const pb::ChargeRequest&, pb::ChargeReply*)>;

  ScriptedPayments(IdempotencyGuard<Durable>& guard, ::idem::grpc::MethodOptions options, Handler h,
                   bool transactional = true)
      : method_(guard, std::move(options)), handler_(std::move(h)), transactional_(transactional) {}

  ::grpc::Status Charge(::grpc::ServerContext* ctx, const pb::ChargeRequest* req,
                        pb::ChargeReply* reply) override {
    struct Answered {
      std::atomic<int>& n;
      ~Answered() { n.fetch_add(1); }
    } answered{answered_};
    if constexpr (IdempotencyGuard<Durable>::kHasDurable) {
      if (transactional_) {
        return method_.handle(*ctx, *req, reply,
                              [&](Tx& tx) { return handler_(&tx, ++runs_, *req, reply); });
      }
    }
    return method_.handle(*ctx, *req, reply,
                          [&] { return handler_(nullptr, ++runs_, *req, reply); });
  }

  /// Times the handler ran.
  int runs() const noexcept { return runs_.load(); }
  /// Calls whose Charge returned (answered or threw).
  int answered() const noexcept { return answered_.load(); }

 private:
  ::idem::grpc::Method<Durable> method_;
  Handler handler_;
  bool transactional_;
  std::atomic<int> runs_{0};
  std::atomic<int> answered_{0};
};

/// MethodOptions of Payments.Charge with nothing else set.
inline ::idem::grpc::MethodOptions charge_options() {
  ::idem::grpc::MethodOptions o;
  o.method = ::grpc_payment::kChargeMethod;
  return o;
}

}  // namespace idem::test::grpc_support
