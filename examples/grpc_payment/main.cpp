// SPDX-License-Identifier: MIT
// examples/grpc_payment: Payments.Charge made idempotent with idem::grpc, on SQLite (embedded,
// the default) or PostgreSQL with Redis in front.
//
//   grpc_payment --serve [--port P] [store flags] [service flags]
//       serves until SIGINT/SIGTERM; prints "grpc_payment listening on 127.0.0.1:<port> (...)"
//   grpc_payment --call HOST:PORT --key K [--account A] [--amount N] [--principal P]
//                [--deadline-ms N]
//       one Charge with the client's retry policy, waiting for the server (for its connection
//       too) until the call's deadline (10 s); prints status, reply and trailers
//   grpc_payment --demo [--charges N] [--copies K] [--threads T] [store flags] [service flags]
//       an in-process server and clients sending every charge as K hedged copies at once (or a
//       double click, or a call whose answer is lost and retried); checks the books: PASS/FAIL
//
// --callback (with --serve or --demo): the service on grpc++'s callback API, through
// idem::async::AsyncGuard on an Asio loop thread (async_service.hpp): no gRPC thread waits for
// idem; SQLite and the ledger on a worker pool; with --postgres the durable store is
// AsyncPostgresStore (its two-phase statements on the loop's libpq pipeline) and --redis is
// AsyncRedisStore.
//
// Store flags: --db PATH (SQLite, default grpc_payment.sqlite) | --postgres DSN [--schema S];
//              --redis URL (RedisStore in front instead of the in-process MemoryStore).
// Service flags: --accounts N --balance CENTS (opened when missing), --slow-ms N (the handler
//              sleeps first), --gateway-ms N (two-phase: a card gateway call of N ms),
//              --lease-ms N (the guard's lease), --pushback-ms N (grpc-retry-pushback-ms of "in
//              progress" answers: the client's retry policy waits that long, up to 4 times),
//              --log (duplicates etc. on stderr).
//
// Exit status: 0 ok / PASS, 1 a failed call or check, 2 bad flags, 3 an error.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "client.hpp"
#include "idem/log.hpp"
#include "idem/memory_store.hpp"
#include "payment_service.hpp"
#ifdef GRPC_PAYMENT_WITH_POSTGRES
#include "idem/redis/redis_store.hpp"
#include "payment_pg.hpp"
#endif
#ifdef GRPC_PAYMENT_WITH_ASYNC
#include "async_service.hpp"
#include "idem/async/pooled_durable.hpp"
#endif
#ifdef GRPC_PAYMENT_WITH_ASYNC_POSTGRES
#include "idem/async/postgres_store.hpp"
#include "idem/async/redis_store.hpp"
#endif

namespace {

using namespace std::chrono_literals;
using grpc_payment::pb::ChargeRequest;

struct Config {
  std::string mode;  // serve, call, demo
  int port = 0;
  std::string db = "grpc_payment.sqlite";
  std::string postgres, schema = "grpc_payment", redis;
  int accounts = 20;
  std::int64_t balance = 1'000'000;
  grpc_payment::ServiceOptions service;
  std::chrono::milliseconds lease{5'000};
  bool log = false;
  bool callback = false;  // the callback service on AsyncGuard
  // --call
  std::string address, key, account = "acct-0000", principal;
  std::int64_t amount = 1'250;
  std::chrono::milliseconds deadline{10'000};
  // --demo
  int charges = 400, copies = 5, threads = 8;
};

void usage(std::ostream& out) {
  out << "usage: grpc_payment --serve [--port P] | --call HOST:PORT --key K [--account A]\n"
         "         [--amount N] [--principal P] [--deadline-ms N]\n"
         "       | --demo [--charges N] [--copies K] [--threads T]\n"
         "       store: [--db PATH | --postgres DSN [--schema S]] [--redis URL]\n"
         "       service: [--accounts N] [--balance CENTS] [--slow-ms N] [--gateway-ms N]\n"
         "                [--lease-ms N] [--pushback-ms N] [--log] [--callback]\n";
}

long long number(const std::string& flag, const char* text, long long min) {
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v < min) {
    throw std::invalid_argument(flag + " needs an integer >= " + std::to_string(min) + ", got '" +
                                text + "'");
  }
  return v;
}

Config parse(int argc, char** argv) {
  Config c;
  bool slow_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--serve" || flag == "--demo") {
      c.mode = flag.substr(2);
      continue;
    }
    if (flag == "--log") {
      c.log = true;
      continue;
    }
    if (flag == "--callback") {
      c.callback = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const char* v = argv[++i];
    if (flag == "--call")
      c.mode = "call", c.address = v;
    else if (flag == "--port")
      c.port = static_cast<int>(number(flag, v, 0));
    else if (flag == "--deadline-ms")
      c.deadline = std::chrono::milliseconds(number(flag, v, 1));
    else if (flag == "--db")
      c.db = v;
    else if (flag == "--postgres")
      c.postgres = v;
    else if (flag == "--schema")
      c.schema = v;
    else if (flag == "--redis")
      c.redis = v;
    else if (flag == "--accounts")
      c.accounts = static_cast<int>(number(flag, v, 1));
    else if (flag == "--balance")
      c.balance = number(flag, v, 0);
    else if (flag == "--slow-ms") {
      c.service.slow = std::chrono::milliseconds(number(flag, v, 0));
      slow_given = true;
    } else if (flag == "--gateway-ms")
      c.service.gateway = std::chrono::milliseconds(number(flag, v, 0));
    else if (flag == "--lease-ms")
      c.lease = std::chrono::milliseconds(number(flag, v, 1));
    else if (flag == "--pushback-ms")
      c.service.retry_pushback = std::chrono::milliseconds(number(flag, v, 0));
    else if (flag == "--key")
      c.key = v;
    else if (flag == "--account")
      c.account = v;
    else if (flag == "--amount")
      c.amount = number(flag, v, 1);
    else if (flag == "--principal")
      c.principal = v;
    else if (flag == "--charges")
      c.charges = static_cast<int>(number(flag, v, 1));
    else if (flag == "--copies")
      c.copies = static_cast<int>(number(flag, v, 1));
    else if (flag == "--threads")
      c.threads = static_cast<int>(number(flag, v, 1));
    else
      throw std::invalid_argument("unknown flag " + flag);
  }
  if (c.mode.empty()) throw std::invalid_argument("one of --serve, --call, --demo is required");
  // The demo's handler is slow enough by default for duplicates to overlap the first attempt.
  if (c.mode == "demo" && !slow_given) c.service.slow = 5ms;
  if (c.port > 65535) throw std::invalid_argument("--port must be 0..65535");
  if (c.mode == "call" && c.key.empty()) throw std::invalid_argument("--call needs --key");
  grpc_payment::require_metadata_value(c.key, "--key");
  if (c.postgres.empty() && !c.redis.empty()) {
    throw std::invalid_argument("--redis goes with --postgres");
  }
#ifndef GRPC_PAYMENT_WITH_POSTGRES
  if (!c.postgres.empty()) {
    throw std::invalid_argument("--postgres needs a build with idem::postgres and idem::redis");
  }
#endif
#ifndef GRPC_PAYMENT_WITH_ASYNC
  if (c.callback) throw std::invalid_argument("--callback needs a build with idem::async");
#endif
#ifndef GRPC_PAYMENT_WITH_ASYNC_POSTGRES
  if (c.callback && !c.postgres.empty()) {
    throw std::invalid_argument(
        "--callback --postgres needs a build with idem::async_postgres and idem::async_redis");
  }
#endif
  if (c.callback && c.mode == "call") throw std::invalid_argument("--callback is a server flag");
  return c;
}

std::string describe(const Config& c) {
  std::string store = c.postgres.empty() ? "sqlite " + c.db : "postgres schema " + c.schema;
  std::string fast = c.redis.empty() ? "memory" : "redis";
  std::string mode = c.service.gateway.count() >= 0
                         ? "two-phase, gateway " + std::to_string(c.service.gateway.count()) + " ms"
                         : "transactional";
  std::string api = c.callback ? ", callback API on AsyncGuard" : "";
  return store + ", fast store " + fast + ", " + mode + api;
}

int call_once(const Config& c) {
  auto channel = grpc_payment::make_channel(c.address);
  auto stub = grpc_payment::pb::Payments::NewStub(channel);
  ChargeRequest req;
  req.set_account(c.account);
  req.set_amount_cents(c.amount);
  req.set_currency("EUR");
  req.set_order_no("ORD-" + c.key);
  grpc_payment::Answer a = grpc_payment::charge(*stub, req, c.key, c.deadline, c.principal);
  std::cout << "status " << a.status.error_code() << " " << a.status.error_message() << "\n";
  // The call waits for the channel (wait_for_ready): say when it never connected.
  if (a.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
      channel->GetState(false) != GRPC_CHANNEL_READY) {
    std::cout << "no connection to " << c.address << " within the call's deadline ("
              << c.deadline.count() << " ms)\n";
  }
  if (a.status.ok()) std::cout << "reply " << a.reply.ShortDebugString() << "\n";
  for (const auto& [k, v] : a.trailers) std::cout << "trailer " << k << ": " << v << "\n";
  return a.status.ok() ? 0 : 1;
}

// --- demo ---------------------------------------------------------------------------------

struct Outcome {
  std::vector<grpc_payment::Answer> answers;
  bool overdraft = false;
  std::int64_t amount = 0;
};

struct Check {
  std::string name, detail;
  bool ok;
};

// Whether `G` counts what only an asynchronous call does (idem::async::AsyncGuard).
template <class G, class = void>
constexpr bool kHasAsyncStats = false;
template <class G>
constexpr bool kHasAsyncStats<G, std::void_t<decltype(std::declval<G&>().async_stats())>> = true;

// `Guard`: IdempotencyGuard or idem::async::AsyncGuard (both count in a GuardStats).
template <class Ledger, class Guard>
int demo(const Config& c, Ledger& ledger, Guard& guard, const std::string& address) {
  auto stats0 = guard.stats().snapshot();
  auto before = ledger.totals();
  const std::string run = idem::OwnerToken::generate().str().substr(0, 8);
  std::vector<Outcome> outcomes(static_cast<std::size_t>(c.charges));
  std::atomic<int> next{0}, lost{0};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < c.threads; ++t) {
    threads.emplace_back([&] {
      auto stub = grpc_payment::pb::Payments::NewStub(grpc_payment::make_channel(address));
      for (int i; (i = next++) < c.charges;) {
        Outcome& o = outcomes[static_cast<std::size_t>(i)];
        o.overdraft = i % 25 == 24;
        o.amount = o.overdraft ? c.balance * 10 : 100 + i % 400;
        ChargeRequest req;
        req.set_account(grpc_payment::SqliteLedger::account(i % c.accounts));
        req.set_amount_cents(o.amount);
        req.set_currency("EUR");
        req.set_order_no("ORD-" + std::to_string(i));
        (*req.mutable_labels())["run"] = run;
        std::string key = "demo-" + run + "-" + std::to_string(i);
        switch (i % 4) {
          case 0:
          case 1:  // a hedging client: copies at once, first OK answer
            o.answers.push_back(grpc_payment::hedged_charge(*stub, req, key, c.copies));
            break;
          case 2:  // a double click: two calls at once
          {
            grpc_payment::Answer second;
            std::thread other([&] { second = grpc_payment::charge(*stub, req, key); });
            o.answers.push_back(grpc_payment::charge(*stub, req, key));
            other.join();
            o.answers.push_back(second);
            break;
          }
          default: {  // the answer is lost (deadline before the handler ends), then a retry
            auto first = grpc_payment::charge(*stub, req, key, c.service.slow / 2 + 1ms);
            if (first.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
              ++lost;
            } else {
              o.answers.push_back(first);
            }
            // The retry policy waits out "in progress" (ABORTED + pushback) and gets the replay.
            o.answers.push_back(grpc_payment::charge(*stub, req, key));
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  auto elapsed =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  auto after = ledger.totals();
  // An asynchronous guard answers a cancelled call at once (the lost answers) and records its
  // work in the background: those keys were executed once too, counted apart (on the loop,
  // just after their record became readable: wait for the count to settle).
  auto background = [&guard] {
    if constexpr (kHasAsyncStats<Guard>) {
      return guard.async_stats().recorded_after_cancel.load();
    } else {
      return std::uint64_t{0};
    }
  };
  for (int i = 0; i < 100 && guard.stats().snapshot().executed - stats0.executed + background() <
                                 static_cast<std::uint64_t>(c.charges);
       ++i) {
    std::this_thread::sleep_for(20ms);
  }
  auto stats = guard.stats().snapshot();
  const std::uint64_t executed = stats.executed - stats0.executed + background();

  // The checks.
  int unanswered = 0, diverged = 0, declined_ok = 0, replayed = 0, wrong_row = 0;
  std::int64_t expected_charged = 0, expected_rows = 0;
  std::vector<std::string> samples;
  for (int i = 0; i < c.charges; ++i) {
    const Outcome& o = outcomes[static_cast<std::size_t>(i)];
    std::string key = "demo-" + run + "-" + std::to_string(i);
    std::string payment;
    for (const auto& a : o.answers) {
      if (a.replayed()) ++replayed;
      bool want = o.overdraft ? a.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
                                    a.trailer(grpc_payment::kDeclineTrailer) == "insufficient_funds"
                              : a.status.ok();
      if (!want) {
        ++unanswered;
        if (samples.size() < 5) {
          samples.push_back(key + ": status " + std::to_string(a.status.error_code()) + " " +
                            a.status.error_message() + " (" + a.trailer("idempotency-error") + ")");
        }
        continue;
      }
      if (o.overdraft) {
        ++declined_ok;
        continue;
      }
      if (payment.empty()) payment = a.reply.payment_no();
      if (a.reply.payment_no() != payment) ++diverged;
    }
    if (o.answers.empty()) ++unanswered;
    if (!o.overdraft) {
      expected_charged += o.amount;
      ++expected_rows;
      auto row = after.by_key.find(key);
      if (row == after.by_key.end() || (!payment.empty() && row->second != payment)) ++wrong_row;
    } else if (after.by_key.count(key) != 0) {
      ++wrong_row;
    }
  }
  std::vector<Check> checks;
  checks.push_back({"every charge answered: OK, or the stored decline for overdrafts",
                    std::to_string(unanswered) + " unanswered", unanswered == 0});
  checks.push_back({"every answer of a key carries the same payment number",
                    std::to_string(diverged) + " diverging", diverged == 0});
  checks.push_back({"one payment row per charged key, with the answered number",
                    std::to_string(after.payments - before.payments) + " rows for " +
                        std::to_string(expected_rows) + " charges, " + std::to_string(wrong_row) +
                        " wrong",
                    after.payments - before.payments == expected_rows && wrong_row == 0});
  checks.push_back({"money: balances went down by exactly the charged amounts",
                    std::to_string(before.balance_cents - after.balance_cents) +
                        " cents debited, " + std::to_string(expected_charged) + " charged",
                    before.balance_cents - after.balance_cents == expected_charged &&
                        after.charged_cents - before.charged_cents == expected_charged});
  checks.push_back({"the guard executed each key once",
                    std::to_string(executed) + " executed for " + std::to_string(c.charges) +
                        " keys (" + std::to_string(background()) +
                        " recorded after their caller had gone)",
                    executed == static_cast<std::uint64_t>(c.charges)});
  if (c.service.gateway.count() >= 0) {
    // Every charge reaches the gateway once (an overdraft too: the books then decline it).
    std::int64_t twice = 0;
    for (const auto& [k, n] : after.gateway_by_key) {
      auto b = before.gateway_by_key.find(k);
      if (n - (b == before.gateway_by_key.end() ? 0 : b->second) > 1) ++twice;
    }
    checks.push_back({"the gateway took each charge once",
                      std::to_string(after.gateway_charges - before.gateway_charges) +
                          " gateway charges for " + std::to_string(c.charges) + " keys, " +
                          std::to_string(twice) + " keys charged twice",
                      after.gateway_charges - before.gateway_charges == c.charges && twice == 0});
  }

  std::cout << "grpc payment demo: " << c.charges << " charges from " << c.threads
            << " client threads (" << describe(c) << ")\n";
  std::cout << "  traffic: hedged " << c.copies << " copies at once (1/2 of the charges), double "
            << "clicks (1/4), a lost answer then a retry (1/4: " << lost.load()
            << " answers lost) in " << elapsed.count() << " ms\n";
  std::cout << "  guard: " << stats.calls - stats0.calls << " calls, "
            << stats.executed - stats0.executed << " executed, " << stats.replayed - stats0.replayed
            << " replayed, " << stats.in_progress - stats0.in_progress
            << " in progress (ABORTED + pushback); " << replayed << " replayed answers taken, "
            << declined_ok << " stored declines answered\n";
  bool ok = true;
  for (const auto& ch : checks) {
    std::cout << "  check " << (ch.ok ? "ok  " : "FAIL") << "  " << ch.name << " (" << ch.detail
              << ")\n";
    ok = ok && ch.ok;
  }
  for (const auto& s : samples) std::cout << "    e.g. " << s << "\n";
  std::cout << (ok ? "PASS" : "FAIL") << std::endl;
  return ok ? 0 : 1;
}

// --- serve / demo on a backend -------------------------------------------------------------

template <class Ledger, class Guard, class Service>
int run_service(const Config& c, Ledger& ledger, Guard& guard, Service& service);

template <class Ledger>
int run(const Config& c, Ledger& ledger, idem::IdempotencyGuard<typename Ledger::Durable>& guard) {
  ledger.open_accounts(c.accounts, c.balance);
  grpc_payment::PaymentService<Ledger> service{guard, ledger, c.service};
  return run_service(c, ledger, guard, service);
}

// The server of `service` (synchronous or callback), then the demo or the wait for a signal.
template <class Ledger, class Guard, class Service>
int run_service(const Config& c, Ledger& ledger, Guard& guard, Service& service) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(c.port), grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "grpc_payment: cannot listen on 127.0.0.1:" << c.port << "\n";
    return 3;
  }
  std::string address = "127.0.0.1:" + std::to_string(port);
  int status = 0;
  if (c.mode == "demo") {
    status = demo(c, ledger, guard, address);
  } else {
    std::cout << "grpc_payment listening on " << address << " (" << describe(c) << ")" << std::endl;
    // SIGINT/SIGTERM were blocked in main before any thread started: wait for one here.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    int sig = 0;
    sigwait(&set, &sig);
  }
  server->Shutdown(std::chrono::system_clock::now() + 2s);
  if (c.mode == "serve") {
    auto s = guard.stats().snapshot();
    std::cout << "grpc_payment stopped: calls=" << s.calls << " executed=" << s.executed
              << " replayed=" << s.replayed << " in_progress=" << s.in_progress
              << " takeovers=" << s.takeovers << " degraded=" << s.degraded << std::endl;
  }
  return status;
}

#ifdef GRPC_PAYMENT_WITH_POSTGRES
// The record store's options from the flags: both services (synchronous and callback) use it.
idem::postgres::PostgresStoreOptions postgres_options(const Config& c, std::size_t pool_size) {
  idem::postgres::PostgresStoreOptions po;
  po.conninfo = c.postgres;
  po.schema = c.schema;
  po.pool_size = pool_size;
  return po;
}
#endif

idem::GuardOptions guard_options(const Config& c) {
  idem::GuardOptions o;
  o.lease = c.lease;
  if (c.log) {
    o.observer = std::make_shared<idem::LoggingObserver>([](idem::LogLevel, std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    });
  }
  return o;
}

#ifdef GRPC_PAYMENT_WITH_ASYNC
// --- the callback service on AsyncGuard -------------------------------------------------------

// The loop: one thread running an io_context until stopped.
struct LoopThread {
  LoopThread() : work(idem::async::net::make_work_guard(io)), thread([this] { io.run(); }) {}
  ~LoopThread() { stop(); }
  // Stops the loop and joins its thread. The io_context stays until the LoopThread goes (the
  // asynchronous stores close their connections on it).
  void stop() {
    if (!thread.joinable()) return;
    work.reset();
    io.stop();
    thread.join();
  }
  idem::async::net::io_context io;
  idem::async::net::executor_work_guard<idem::async::net::io_context::executor_type> work;
  std::thread thread;
};

// The shutdown order of docs/async.md, whatever way the service returns: the loop stopped, then
// the worker pool's queued work done (it uses the service, the guard, the stores and the
// ledger), before those are destroyed. Declared after the service.
struct ShutDown {
  ~ShutDown() {
    loop.stop();
    pool.reset();
  }
  LoopThread& loop;
  std::optional<idem::async::WorkerPool>& pool;
};

template <class Ledger, class Durable>
int run_callback(const Config& c, Ledger& ledger, idem::async::AsyncGuard<Durable>& guard,
                 LoopThread& loop, std::optional<idem::async::WorkerPool>& pool) {
  ledger.open_accounts(c.accounts, c.balance);
  grpc_payment::AsyncPaymentService<Ledger, Durable> service{guard, ledger, *pool, c.service};
  ShutDown shut_down{loop, pool};  // before the service, the guard, the stores, the ledger go
  return run_service(c, ledger, guard, service);
}

int serve_callback(const Config& c) {
  idem::async::AsyncGuardOptions options;
  options.guard = guard_options(c);
  // The ledger's blocking work, transactions.
  std::optional<idem::async::WorkerPool> pool{idem::async::WorkerPoolOptions{8, 4096}};
  options.pool = &*pool;
  LoopThread loop;
  const idem::async::Executor ex = loop.io.get_executor();
#ifdef GRPC_PAYMENT_WITH_ASYNC_POSTGRES
  if (!c.postgres.empty()) {
    idem::postgres::PostgresStore sync{postgres_options(c, 16)};
    grpc_payment::PostgresLedger ledger{sync, c.schema};
    idem::async::AsyncPostgresStore durable{ex, sync, *pool};
    idem::MemoryStore memory;
    std::unique_ptr<idem::async::AsyncFastStore> fast;
    if (c.redis.empty()) {
      fast = std::make_unique<idem::async::InlineFastStore>(memory);
    } else {
      idem::async::AsyncRedisStoreOptions ro;
      ro.uri = c.redis;
      ro.key_prefix = "idem:" + c.schema + ":";
      fast = std::make_unique<idem::async::AsyncRedisStore>(ex, ro);
    }
    idem::async::AsyncGuard guard{ex, *fast, durable, options};
    return run_callback(c, ledger, guard, loop, pool);
  }
#endif
  idem::sqlite::SqliteStore sqlite{c.db};
  grpc_payment::SqliteLedger ledger{sqlite};
  idem::async::PooledDurable<idem::sqlite::SqliteStore> durable{sqlite, *pool};
  idem::MemoryStore memory;
  idem::async::InlineFastStore fast{memory};
  idem::async::AsyncGuard guard{ex, fast, durable, options};
  return run_callback(c, ledger, guard, loop, pool);
}
#endif

int serve(const Config& c) {
#ifdef GRPC_PAYMENT_WITH_ASYNC
  if (c.callback) return serve_callback(c);
#endif
  idem::GuardOptions options = guard_options(c);
#ifdef GRPC_PAYMENT_WITH_POSTGRES
  if (!c.postgres.empty()) {
    idem::postgres::PostgresStore durable{postgres_options(c, 32)};
    grpc_payment::PostgresLedger ledger{durable, c.schema};
    std::unique_ptr<idem::FastStore> fast;
    if (c.redis.empty()) {
      fast = std::make_unique<idem::MemoryStore>();
    } else {
      idem::redis::RedisStoreOptions ro;
      ro.uri = c.redis;
      ro.key_prefix = "idem:" + c.schema + ":";
      fast = std::make_unique<idem::redis::RedisStore>(ro);
    }
    idem::IdempotencyGuard guard{*fast, durable, options};
    return run(c, ledger, guard);
  }
#endif
  idem::sqlite::SqliteStore durable{c.db};
  grpc_payment::SqliteLedger ledger{durable};
  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, durable, options};
  return run(c, ledger, guard);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(std::cout);
      return 0;
    }
  }
  Config c;
  try {
    c = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "grpc_payment: " << e.what() << "\n";
    usage(std::cerr);
    return 2;
  }
  // Block the stop signals in every thread grpc++ will start; --serve waits for them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  if (c.mode == "serve") pthread_sigmask(SIG_BLOCK, &set, nullptr);
  try {
    if (c.mode == "call") return call_once(c);
    return serve(c);
  } catch (const idem::Error& e) {
    std::cerr << "grpc_payment: " << e.what() << " (" << idem::errc_name(e.code()) << ")\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "grpc_payment: " << e.what() << "\n";
    return 3;
  }
}
