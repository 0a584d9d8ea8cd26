// SPDX-License-Identifier: MIT
// idem::grpc over grpc++ against the same unary method without idempotency: synchronous client
// calls one after another on one channel, interleaved A/B rounds, medians.
//
//   replay:  the same idempotency-key every call (answered by the fast store: the stored reply
//            decoded and parsed) vs the method returning a constant reply
//   first:   a fresh key every call (claim + SQLite transaction with the record and the
//            business insert + complete) vs the method doing only the business insert in a
//            plain SQLite transaction
//
// Both comparisons run twice: on the synchronous server API (grpc::Service, one channel) and on
// the callback API (grpc::CallbackService finishing inline, another server and channel). The
// side is chosen by the client metadata `x-bench` (read on every path alike).
//
//   idem_grpc_bench [rounds] [calls per phase]
//   IDEM_GRPC_BENCH_SPLIT=S,C         two processes: the servers pinned to CPU S, the client to
//                                     CPU C (forked before gRPC starts; the client reaches the
//                                     servers over loopback TCP, as it would another host).
//                                     Without it, client and servers share one process.
//   IDEM_GRPC_BENCH_PLAIN_SPIN_US=N   the plain handlers busy-wait N us first (to show what a
//                                     few microseconds of handler work cost the sync server)
//   IDEM_GRPC_BENCH_PROFILE=1         no timing: the sync server answers 2 x [calls] replayed
//                                     calls (the first one executes), nothing else; for an
//                                     instruction count per call, the difference of two runs:
//     valgrind --tool=callgrind --toggle-collect='(anonymous namespace)::BenchCharge::charge(*'
//       idem_grpc_bench 1 N      (and 2N; the pattern must not match the lambdas' names)
//
// Prints calls/s per round and `ratio <name> = <ours / baseline>` (higher is better); the ratios
// of a one-process run end in `_one_process`.
#include <grpcpp/grpcpp.h>
#include <sched.h>
#include <sys/wait.h>
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
using Durable = idem::sqlite::SqliteStore;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Payments.Charge of the bench, whatever the server API.
class BenchCharge {
 public:
  BenchCharge(idem::IdempotencyGuard<Durable>& guard, Durable& store)
      : store_(store), method_(guard, [] {
          idem::grpc::MethodOptions o;
          o.method = grpc_payment::kChargeMethod;
          return o;
        }()) {
    if (const char* spin = std::getenv("IDEM_GRPC_BENCH_PLAIN_SPIN_US")) {
      spin_ = std::chrono::microseconds(std::atol(spin));
    }
  }

  grpc::Status charge(grpc::ServerContextBase& ctx, const pb::ChargeRequest& req,
                      pb::ChargeReply* reply) {
    auto it = ctx.client_metadata().find("x-bench");
    std::string side = it == ctx.client_metadata().end()
                           ? std::string()
                           : std::string(it->second.data(), it->second.size());
    if (side == "plain") {
      spin();
      fill(req, reply);
      return grpc::Status::OK;
    }
    if (side == "plain-insert") {
      spin();
      store_.database().write([&](Tx& tx) { insert(tx, req); });
      fill(req, reply);
      return grpc::Status::OK;
    }
    return method_.handle(ctx, req, reply, [&](Tx& tx) {
      insert(tx, req);
      fill(req, reply);
      return grpc::Status::OK;
    });
  }

 private:
  void spin() const {
    if (spin_.count() == 0) return;
    auto until = Clock::now() + spin_;
    while (Clock::now() < until) {
    }
  }
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

  Durable& store_;
  idem::grpc::Method<Durable> method_;
  std::chrono::microseconds spin_{0};
};

class SyncPayments final : public pb::Payments::Service {
 public:
  explicit SyncPayments(BenchCharge& c) : c_(c) {}
  grpc::Status Charge(grpc::ServerContext* ctx, const pb::ChargeRequest* req,
                      pb::ChargeReply* reply) override {
    return c_.charge(*ctx, *req, reply);
  }

 private:
  BenchCharge& c_;
};

// Finishes inline on grpc++'s callback thread (one sequential client: nothing waits behind it).
class CallbackPayments final : public pb::Payments::CallbackService {
 public:
  explicit CallbackPayments(BenchCharge& c) : c_(c) {}
  grpc::ServerUnaryReactor* Charge(grpc::CallbackServerContext* ctx, const pb::ChargeRequest* req,
                                   pb::ChargeReply* reply) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(c_.charge(*ctx, *req, reply));
    return reactor;
  }

 private:
  BenchCharge& c_;
};

struct Medians {
  double replay, plain, first, plain_insert, replay_ratio, first_ratio;
};

std::unique_ptr<grpc::Server> serve(const char* api, grpc::Service& service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "cannot start the %s server\n", api);
    std::exit(1);
  }
  return server;
}

// The interleaved rounds against the server on `port`, on one channel.
Medians compare(const char* api, int port, int rounds, int calls, bool profile) {
  auto stub = pb::Payments::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  pb::ChargeRequest req;
  req.set_account("acct-0001");
  req.set_amount_cents(1'250);
  req.set_currency("EUR");
  req.set_order_no("ORD-20001");
  static long long next_key = 0;
  const std::string fixed = std::string("fixed-") + api;
  auto run = [&](const char* side, int keys) {  // keys: 0 none, 1 fixed, 2 fresh
    auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) {
      grpc::ClientContext ctx;
      ctx.AddMetadata("x-bench", side);
      if (keys == 1) ctx.AddMetadata("idempotency-key", fixed);
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
  if (profile) {
    run("guarded", 1);
    return Medians{};
  }
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
        "%s round %d: replay %.0f calls/s, plain unary %.0f calls/s, first call %.0f "
        "calls/s, plain insert %.0f calls/s\n",
        api, r + 1, replay.back(), plain.back(), first.back(), plain_insert.back());
  }
  Medians m{median(replay),       median(plain),        median(first),
            median(plain_insert), median(replay_ratio), median(first_ratio)};
  std::printf(
      "%s median: replay %.0f calls/s (%.1f us), plain unary %.0f calls/s (%.1f us), "
      "first call %.0f calls/s (%.1f us), plain insert %.0f calls/s (%.1f us)\n",
      api, m.replay, 1e6 / m.replay, m.plain, 1e6 / m.plain, m.first, 1e6 / m.first, m.plain_insert,
      1e6 / m.plain_insert);
  std::fflush(stdout);
  return m;
}

void pin_to_cpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) {
    std::perror("sched_setaffinity");
    std::exit(1);
  }
}

// `suffix`: "" for the two-process run, "_one_process" when client and servers share one.
void print_ratios(const Medians& s, const Medians& c, const char* suffix) {
  std::printf("ratio grpc_replay_vs_plain_unary%s = %.3f\n", suffix, s.replay_ratio);
  std::printf("ratio grpc_first_call_vs_plain_insert%s = %.3f\n", suffix, s.first_ratio);
  std::printf("ratio grpc_replay_vs_plain_unary_callback_api%s = %.3f\n", suffix, c.replay_ratio);
  std::printf("ratio grpc_first_call_vs_plain_insert_callback_api%s = %.3f\n", suffix,
              c.first_ratio);
}

// Both server APIs, one after the other (the profile run: the sync server only).
void drive(const int (&ports)[2], int rounds, int calls, bool profile,
           const std::string& placement, const char* suffix) {
  std::printf(
      "%d rounds x %d calls per phase, one channel per server API, SQLite "
      "synchronous=NORMAL, MemoryStore in front; %s%s\n",
      rounds, calls, placement.c_str(),
      std::getenv("IDEM_GRPC_BENCH_PLAIN_SPIN_US") ? ", plain handlers spinning" : "");
  std::fflush(stdout);
  Medians s = compare("sync", ports[0], rounds, calls, profile);
  if (profile) return;
  Medians c = compare("callback", ports[1], rounds, calls, profile);
  print_ratios(s, c, suffix);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = argc > 1 ? std::atoi(argv[1]) : 11;
  int calls = argc > 2 ? std::atoi(argv[2]) : 1000;
  const bool profile = std::getenv("IDEM_GRPC_BENCH_PROFILE") != nullptr;
  int server_cpu = -1, client_cpu = -1;
  if (const char* split = std::getenv("IDEM_GRPC_BENCH_SPLIT")) {
    if (std::sscanf(split, "%d,%d", &server_cpu, &client_cpu) != 2 || server_cpu < 0 ||
        client_cpu < 0) {
      std::fprintf(stderr, "IDEM_GRPC_BENCH_SPLIT must be <server cpu>,<client cpu>, e.g. 0,1\n");
      return 2;
    }
  }
  // Split: fork before anything of gRPC exists; the child serves, the parent drives. The
  // ports travel on one pipe; the client closing the other tells the servers to stop.
  int ports_pipe[2] = {-1, -1}, stop_pipe[2] = {-1, -1};
  pid_t child = -1;
  if (server_cpu >= 0) {
    if (pipe(ports_pipe) != 0 || pipe(stop_pipe) != 0) {
      std::perror("pipe");
      return 1;
    }
    child = fork();
    if (child < 0) {
      std::perror("fork");
      return 1;
    }
    pin_to_cpu(child == 0 ? server_cpu : client_cpu);
  }
  const bool serves = child <= 0;  // one process, or the forked server
  const bool drives = child != 0;  // one process, or the parent
  std::string path = "/tmp/idem_grpc_bench_" + std::to_string(::getpid()) + ".sqlite";
  int ports[2] = {0, 0};  // sync, callback
  if (drives && !serves) {
    close(ports_pipe[1]);
    close(stop_pipe[0]);
    if (read(ports_pipe[0], ports, sizeof ports) != static_cast<ssize_t>(sizeof ports)) {
      std::fprintf(stderr, "the server process did not start\n");
      return 1;
    }
    drive(ports, rounds, calls, profile,
          "servers on CPU " + std::to_string(server_cpu) + ", client on CPU " +
              std::to_string(client_cpu) + " (two processes)",
          "");
    close(stop_pipe[1]);
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
  }
  {
    Durable durable{path};
    durable.database().write([](Tx& tx) {
      tx.exec(
          "CREATE TABLE IF NOT EXISTS payment (id INTEGER PRIMARY KEY, order_no TEXT NOT NULL,"
          " amount_cents INTEGER NOT NULL)");
    });
    idem::MemoryStore fast;
    idem::IdempotencyGuard guard{fast, durable};
    BenchCharge charge{guard, durable};
    SyncPayments sync{charge};
    CallbackPayments callback{charge};
    auto sync_server = serve("sync", sync, &ports[0]);
    auto callback_server = serve("callback", callback, &ports[1]);
    if (!drives) {
      close(ports_pipe[0]);
      close(stop_pipe[1]);
      if (write(ports_pipe[1], ports, sizeof ports) != static_cast<ssize_t>(sizeof ports)) {
        std::perror("write");
        return 1;
      }
      char byte;
      while (read(stop_pipe[0], &byte, 1) > 0) {
      }
    } else {
      drive(ports, rounds, calls, profile, "client and servers in one process", "_one_process");
    }
    sync_server->Shutdown();
    callback_server->Shutdown();
  }
  std::remove(path.c_str());
  std::remove((path + "-wal").c_str());
  std::remove((path + "-shm").c_str());
  return 0;
}
