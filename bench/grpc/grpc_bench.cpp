// SPDX-License-Identifier: MIT
// idem::grpc over grpc++ against the same unary method without idempotency: one process, one
// channel, synchronous calls one after another, interleaved A/B rounds, medians.
//
//   replay:  the same idempotency-key every call (answered by the fast store: the stored reply
//            decoded and parsed) vs the method returning a constant reply
//   first:   a fresh key every call (claim + SQLite transaction with the record and the
//            business insert + complete) vs the method doing only the business insert in a
//            plain SQLite transaction
//
// The side is chosen by the client metadata `x-bench` (read on every path alike). Prints calls/s
// per round and `ratio <name> = <ours / baseline>` (higher is better).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "idem/memory_store.hpp"
#include "payment_service.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace pb = grpc_payment::pb;
using Tx = idem::sqlite::Transaction;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string side_of(const grpc::ServerContext& ctx) {
  auto it = ctx.client_metadata().find("x-bench");
  return it == ctx.client_metadata().end() ? std::string()
                                           : std::string(it->second.data(), it->second.size());
}

class BenchPayments final : public pb::Payments::Service {
 public:
  BenchPayments(idem::IdempotencyGuard<idem::sqlite::SqliteStore>& guard,
                idem::sqlite::SqliteStore& store)
      : store_(store), method_(guard, [] {
          idem::grpc::MethodOptions o;
          o.method = grpc_payment::kChargeMethod;
          return o;
        }()) {}

  grpc::Status Charge(grpc::ServerContext* ctx, const pb::ChargeRequest* req,
                      pb::ChargeReply* reply) override {
    std::string side = side_of(*ctx);
    if (side == "plain") {
      fill(*req, reply);
      return grpc::Status::OK;
    }
    if (side == "plain-insert") {
      store_.database().write([&](Tx& tx) { insert(tx, *req); });
      fill(*req, reply);
      return grpc::Status::OK;
    }
    return method_.handle(*ctx, *req, reply, [&](Tx& tx) {
      insert(tx, *req);
      fill(*req, reply);
      return grpc::Status::OK;
    });
  }

 private:
  static void insert(Tx& tx, const pb::ChargeRequest& req) {
    tx.exec("INSERT INTO payment (order_no, amount_cents) VALUES (?, ?)", req.order_no(),
            req.amount_cents());
  }
  static void fill(const pb::ChargeRequest& req, pb::ChargeReply* reply) {
    reply->set_payment_no("PAY-00000042");
    reply->set_account(req.account());
    reply->set_amount_cents(req.amount_cents());
    reply->set_balance_cents(98'750);
    reply->set_order_no(req.order_no());
  }

  idem::sqlite::SqliteStore& store_;
  idem::grpc::Method<idem::sqlite::SqliteStore> method_;
};

}  // namespace

int main(int argc, char** argv) {
  int rounds = argc > 1 ? std::atoi(argv[1]) : 11;
  int calls = argc > 2 ? std::atoi(argv[2]) : 1000;
  std::string path = "/tmp/idem_grpc_bench_" + std::to_string(::getpid()) + ".sqlite";

  idem::sqlite::SqliteStore durable{path};
  durable.database().write([](Tx& tx) {
    tx.exec(
        "CREATE TABLE IF NOT EXISTS payment (id INTEGER PRIMARY KEY, order_no TEXT NOT NULL,"
        " amount_cents INTEGER NOT NULL)");
  });
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, durable};
  BenchPayments service{guard, durable};
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "cannot start the server\n");
    return 1;
  }
  auto stub = pb::Payments::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));

  pb::ChargeRequest req;
  req.set_account("acct-0001");
  req.set_amount_cents(1'250);
  req.set_currency("EUR");
  req.set_order_no("ORD-20001");
  long long next_key = 0;
  auto run = [&](const char* side, int keys) {  // keys: 0 none, 1 fixed, 2 fresh
    auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) {
      grpc::ClientContext ctx;
      ctx.AddMetadata("x-bench", side);
      if (keys == 1) ctx.AddMetadata("idempotency-key", "fixed");
      if (keys == 2) ctx.AddMetadata("idempotency-key", "k" + std::to_string(next_key++));
      pb::ChargeReply reply;
      grpc::Status s = stub->Charge(&ctx, req, &reply);
      if (!s.ok() || reply.payment_no().empty()) {
        std::fprintf(stderr, "call %s failed: %s\n", side, s.error_message().c_str());
        std::exit(1);
      }
    }
    return calls / std::chrono::duration<double>(Clock::now() - t0).count();
  };

  run("guarded", 1);  // warm up, and complete the fixed key
  run("plain", 0);
  run("plain-insert", 0);
  // ABBA inside a round cancels a load drift; the ratio is the median of per-round ratios.
  std::vector<double> replay, plain, first, plain_insert, replay_ratio, first_ratio;
  for (int r = 0; r < rounds; ++r) {
    double a1 = run("guarded", 1), b1 = run("plain", 0), b2 = run("plain", 0),
           a2 = run("guarded", 1);
    double c1 = run("guarded", 2), d1 = run("plain-insert", 0), d2 = run("plain-insert", 0),
           c2 = run("guarded", 2);
    replay.push_back((a1 + a2) / 2);
    plain.push_back((b1 + b2) / 2);
    first.push_back((c1 + c2) / 2);
    plain_insert.push_back((d1 + d2) / 2);
    replay_ratio.push_back(replay.back() / plain.back());
    first_ratio.push_back(first.back() / plain_insert.back());
    std::printf(
        "round %d: replay %.0f calls/s, plain unary %.0f calls/s, first call %.0f calls/s, "
        "plain insert %.0f calls/s\n",
        r + 1, replay.back(), plain.back(), first.back(), plain_insert.back());
  }
  server->Shutdown();
  std::remove(path.c_str());
  std::remove((path + "-wal").c_str());
  std::remove((path + "-shm").c_str());

  double mr = median(replay), mp = median(plain), mf = median(first), mi = median(plain_insert);
  std::printf(
      "median: replay %.0f calls/s (%.1f us), plain unary %.0f calls/s (%.1f us), first "
      "call %.0f calls/s (%.1f us), plain insert %.0f calls/s (%.1f us) (%d rounds x %d "
      "calls, one channel, sync server, SQLite synchronous=NORMAL, MemoryStore in front)\n",
      mr, 1e6 / mr, mp, 1e6 / mp, mf, 1e6 / mf, mi, 1e6 / mi, rounds, calls);
  std::printf("ratio grpc_replay_vs_plain_unary = %.3f\n", median(replay_ratio));
  std::printf("ratio grpc_first_call_vs_plain_insert = %.3f\n", median(first_ratio));
  return 0;
}
