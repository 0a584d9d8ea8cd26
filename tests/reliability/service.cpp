// SPDX-License-Identifier: MIT
// idem_rel_service: the payment service the reliability driver attacks. RedisStore in front of
// PostgresStore (or MysqlStore with --backend mysql), transactional mode: one transaction
// (pqxx::work, idem::mysql::Transaction) debits the account, inserts the payment row and holds
// idem's record; the response is the payment number ("pay_<row id>").
//
// Test-only failpoints (flags):
//   --crash-step <fast_claimed|durable_claimed|handler_returned|durable_committed>
//   --crash-nth N        _exit(137) the Nth time a call reaches that step (default 1)
//   --slow-ms MS         the handler sleeps MS for keys whose id contains "-slow-"
//   --handler-ms MS      the handler sleeps MS for every key (pool exhaustion)
//   --pg-pool N --pg-pool-wait-ms MS --redis-pool N --redis-pool-wait-ms MS
//   --lease-ms MS (1000) --redis-timeout-ms MS (300)
//   --backend postgres|mysql (postgres) --pg-dsn DSN --mysql-uri URI
//   --unguarded          no idem at all: every request pays (the driver's negative control,
//                        which proves its checks catch duplicate effects)
//   --mode transactional|two-phase   two-phase: the handler runs outside idem's record, in its
//        own transaction against a "gateway" that de-duplicates by key (rel_gateway), as
//        guard.hpp asks of external side effects; gateway_dedups counts the re-runs it absorbed
//
// Prints "LISTENING <port>" on stdout once it accepts connections (port 0: any free port).
// Protocol: wire.hpp. Every idem::Error is answered "ERR <errc_name>"; anything else thrown is
// answered "UNTYPED <what>", which the driver counts as a failure of the library's promise.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/postgres/postgres_store.hpp"
#include "idem/redis/redis_store.hpp"
#ifdef IDEM_REL_WITH_MYSQL
#include "idem/mysql/mysql_store.hpp"
#endif
#include "wire.hpp"

namespace {

using idem::reliability::hex_decode;
using idem::reliability::LineSocket;

struct Config {
  std::string redis_url = "redis://127.0.0.1:6379";
  std::string pg_dsn;
  std::string mysql_uri;
  bool mysql = false;
  std::string table = "rel_idempotency";
  int port = 0;
  long lease_ms = 1000;
  long redis_timeout_ms = 300;
  bool two_phase = false;
  bool unguarded = false;
  std::string crash_step;
  long crash_nth = 1;
  long slow_ms = 0;
  long handler_ms = 0;
  long pg_pool = 8;
  long pg_pool_wait_ms = 2000;
  long redis_pool = 8;
  long redis_pool_wait_ms = 100;
};

struct Counters {
  std::atomic<std::uint64_t> requests{0}, invalid_keys{0}, pg_pool_exhausted{0}, untyped{0},
      gateway_dedups{0};
  std::mutex mu;
  std::map<std::string, std::uint64_t> errors;  // errc_name -> count
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "idem_rel_service: " << why << "\n";
  std::exit(2);
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value after " + a);
      return argv[++i];
    };
    if (a == "--redis-url")
      c.redis_url = next();
    else if (a == "--pg-dsn")
      c.pg_dsn = next();
    else if (a == "--mysql-uri")
      c.mysql_uri = next();
    else if (a == "--backend") {
      std::string b = next();
      if (b != "postgres" && b != "mysql") usage("--backend postgres|mysql");
      c.mysql = b == "mysql";
    } else if (a == "--table")
      c.table = next();
    else if (a == "--port")
      c.port = std::stoi(next());
    else if (a == "--lease-ms")
      c.lease_ms = std::stol(next());
    else if (a == "--redis-timeout-ms")
      c.redis_timeout_ms = std::stol(next());
    else if (a == "--crash-step")
      c.crash_step = next();
    else if (a == "--unguarded")
      c.unguarded = true;
    else if (a == "--mode") {
      std::string m = next();
      if (m != "transactional" && m != "two-phase") usage("--mode transactional|two-phase");
      c.two_phase = m == "two-phase";
    } else if (a == "--crash-nth")
      c.crash_nth = std::stol(next());
    else if (a == "--slow-ms")
      c.slow_ms = std::stol(next());
    else if (a == "--handler-ms")
      c.handler_ms = std::stol(next());
    else if (a == "--pg-pool")
      c.pg_pool = std::stol(next());
    else if (a == "--pg-pool-wait-ms")
      c.pg_pool_wait_ms = std::stol(next());
    else if (a == "--redis-pool")
      c.redis_pool = std::stol(next());
    else if (a == "--redis-pool-wait-ms")
      c.redis_pool_wait_ms = std::stol(next());
    else
      usage("unknown flag " + a);
  }
  return c;
}

// The business statements of each durable store: the payment (debit + payment row, in the
// guard's transaction) and the two-phase mode's external party (its own transaction,
// de-duplicated by the key).
struct PostgresBackend {
  using Store = idem::postgres::PostgresStore;
  using Tx = pqxx::work;
  static idem::postgres::PostgresStoreOptions options(const Config& c) {
    idem::postgres::PostgresStoreOptions o;
    o.conninfo = c.pg_dsn;
    o.table = c.table;
    o.pool_size = static_cast<std::size_t>(c.pg_pool);
    o.pool_wait = std::chrono::milliseconds(c.pg_pool_wait_ms);
    return o;
  }
  static std::string pay(Tx& tx, const std::string& id, long account, long amount) {
    tx.exec_params("UPDATE rel_account SET balance = balance - $1 WHERE id = $2", amount, account);
    auto row = tx.exec_params1(
        "INSERT INTO rel_payment (idem_key, account, amount) VALUES ($1, $2, $3) RETURNING id", id,
        account, amount);
    return "pay_" + row[0].as<std::string>();
  }
  // The gateway's row for `id`: true when this call made it (a first payment).
  static bool gateway_claim(Tx& tx, const std::string& id) {
    return !tx.exec_params(
                  "INSERT INTO rel_gateway (idem_key) VALUES ($1) ON CONFLICT DO NOTHING "
                  "RETURNING idem_key",
                  id)
                .empty();
  }
  static std::string gateway_payment(Tx& tx, const std::string& id) {
    return tx.exec_params1("SELECT payment_id FROM rel_gateway WHERE idem_key = $1", id)[0]
        .as<std::string>();
  }
  static void gateway_done(Tx& tx, const std::string& id, long payment) {
    tx.exec_params("UPDATE rel_gateway SET payment_id = $1 WHERE idem_key = $2", payment, id);
  }
};

#ifdef IDEM_REL_WITH_MYSQL
struct MysqlBackend {
  using Store = idem::mysql::MysqlStore;
  using Tx = idem::mysql::Transaction;
  static idem::mysql::MysqlStoreOptions options(const Config& c) {
    idem::mysql::MysqlStoreOptions o;
    o.uri = c.mysql_uri;
    o.table = c.table;
    o.pool_size = static_cast<std::size_t>(c.pg_pool);
    o.pool_wait = std::chrono::milliseconds(c.pg_pool_wait_ms);
    return o;
  }
  static std::string pay(Tx& tx, const std::string& id, long account, long amount) {
    tx.exec("UPDATE rel_account SET balance = balance - ? WHERE id = ?", amount, account);
    tx.exec("INSERT INTO rel_payment (idem_key, account, amount) VALUES (?, ?, ?)", id, account,
            amount);
    return "pay_" + std::to_string(tx.last_insert_id());
  }
  static bool gateway_claim(Tx& tx, const std::string& id) {
    try {
      tx.exec("INSERT INTO rel_gateway (idem_key) VALUES (?)", id);
      return true;
    } catch (const idem::mysql::DuplicateKey&) {
      return false;  // MySQL rolled back this statement only
    }
  }
  static std::string gateway_payment(Tx& tx, const std::string& id) {
    // A locking read: REPEATABLE READ's snapshot could predate the first payment's commit.
    return tx
        .query_text("SELECT payment_id FROM rel_gateway WHERE idem_key = ? LOCK IN SHARE MODE", id)
        .value_or("");
  }
  static void gateway_done(Tx& tx, const std::string& id, long payment) {
    tx.exec("UPDATE rel_gateway SET payment_id = ? WHERE idem_key = ?", payment, id);
  }
};
#endif

class Handler {
 public:
  virtual ~Handler() = default;
  virtual std::string handle(const std::string& line) = 0;
};

template <class Backend>
class Service final : public Handler {
 public:
  using Store = typename Backend::Store;
  using Tx = typename Backend::Tx;
  explicit Service(const Config& c)
      : cfg_(c),
        fast_(redis_options(c)),
        durable_(Backend::options(c)),
        guard_(fast_, durable_, guard_options(c)) {}

  std::string handle(const std::string& line) override {
    std::istringstream in(line);
    std::string verb;
    in >> verb;
    if (verb == "STATS") return stats_line();
    if (verb != "PAY") return "UNTYPED bad_request";
    std::string hex_id;
    long account = 0, amount = 0;
    in >> hex_id >> account >> amount;
    counters_.requests.fetch_add(1);
    auto id = hex_decode(hex_id == "-" ? std::string_view{} : std::string_view{hex_id});
    if (!id) return "UNTYPED bad_hex";
    try {
      auto key = idem::Key::make("payment", *id);
      auto fp = idem::fingerprint("account=" + std::to_string(account) +
                                  ";amount=" + std::to_string(amount));
      auto pause = [&] {
        if (cfg_.handler_ms > 0) sleep_ms(cfg_.handler_ms);
        if (cfg_.slow_ms > 0 && id->find("-slow-") != std::string::npos) sleep_ms(cfg_.slow_ms);
      };
      auto pay = [&](Tx& tx) -> std::string { return Backend::pay(tx, *id, account, amount); };
      idem::GuardResult<std::string> r;
      if (cfg_.unguarded) {
        pause();
        return "OK executed " + durable_.with_transaction(pay);
      }
      if (!cfg_.two_phase) {
        r = guard_.run(key, fp, [&](Tx& tx) -> std::string {
          pause();
          return pay(tx);
        });
      } else {
        r = guard_.run(key, fp, [&]() -> std::string {
          if (cfg_.slow_ms > 0 && id->find("-slow-") != std::string::npos) sleep_ms(cfg_.slow_ms);
          // The external party: one transaction of its own, de-duplicated by the key. Its
          // connection comes from the store's pool, so --handler-ms holds one (as in
          // transactional mode) and a tiny pool runs out.
          return durable_.with_transaction([&](Tx& tx) -> std::string {
            if (cfg_.handler_ms > 0) sleep_ms(cfg_.handler_ms);
            if (!Backend::gateway_claim(tx, *id)) {
              counters_.gateway_dedups.fetch_add(1);
              return "pay_" + Backend::gateway_payment(tx, *id);
            }
            std::string no = pay(tx);
            Backend::gateway_done(tx, *id, std::stol(no.substr(4)));
            return no;
          });
        });
      }
      switch (r.outcome) {
        case idem::Outcome::kExecuted:
          return "OK executed " + *r.value;
        case idem::Outcome::kReplayed:
          return "OK replayed " + *r.value;
        case idem::Outcome::kInProgress:
          return "BUSY";
        case idem::Outcome::kFingerprintMismatch:
          return "MISMATCH";
      }
      return "UNTYPED unknown_outcome";
    } catch (const idem::Error& e) {
      std::string name(idem::errc_name(e.code()));
      if (e.code() == idem::errc::kInvalidKey) counters_.invalid_keys.fetch_add(1);
      if (std::strstr(e.what(), "pool exhausted") != nullptr)
        counters_.pg_pool_exhausted.fetch_add(1);
      {
        std::lock_guard<std::mutex> lock(counters_.mu);
        ++counters_.errors[name];
      }
      return "ERR " + name;
    } catch (const std::exception& e) {
      counters_.untyped.fetch_add(1);
      std::cerr << "idem_rel_service: untyped error: " << e.what() << "\n";
      std::string what = e.what();
      for (auto& ch : what) {
        if (ch == '\n' || ch == '\r') ch = ' ';
      }
      return "UNTYPED " + what.substr(0, 200);
    }
  }

 private:
  static void sleep_ms(long ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

  static idem::redis::RedisStoreOptions redis_options(const Config& c) {
    idem::redis::RedisStoreOptions o;
    o.uri = c.redis_url;
    o.key_prefix = "idemrel:";
    o.pool_size = static_cast<std::size_t>(c.redis_pool);
    o.pool_wait_timeout = std::chrono::milliseconds(c.redis_pool_wait_ms);
    o.command_timeout = std::chrono::milliseconds(c.redis_timeout_ms);
    o.connect_timeout = std::chrono::milliseconds(c.redis_timeout_ms);
    return o;
  }
  static idem::GuardOptions guard_options(const Config& c) {
    idem::GuardOptions o;
    o.lease = std::chrono::milliseconds(c.lease_ms);
    if (!c.crash_step.empty()) {
      auto seen = std::make_shared<std::atomic<long>>(0);
      std::string step = c.crash_step;
      long nth = c.crash_nth;
      o.step_hook = [seen, step, nth](idem::Step s, const idem::Key& key) {
        if (idem::step_name(s) != step) return;
        if (seen->fetch_add(1) + 1 == nth) {
          std::fprintf(stderr,
                       "idem_rel_service: failpoint %s hit (call %ld, key %s): _exit(137)\n",
                       step.c_str(), nth, key.str().c_str());
          std::fflush(stderr);
          ::_exit(137);
        }
      };
    }
    return o;
  }

  std::string stats_line() {
    auto g = guard_.stats().snapshot();
    auto rp = fast_.pool_stats();
    auto ps = durable_.stats();
    // The durable store's counters: pg_* for PostgreSQL, mysql_* for MySQL.
    const std::string db = cfg_.mysql ? " mysql_" : " pg_";
    std::ostringstream out;
    out << "STATS calls=" << g.calls << " executed=" << g.executed << " replayed=" << g.replayed
        << " in_progress=" << g.in_progress << " mismatched=" << g.mismatched
        << " handler_errors=" << g.handler_errors << " fast_hits=" << g.fast_hits
        << " durable_conflicts=" << g.durable_conflicts << " degraded=" << g.degraded
        << " takeovers=" << g.takeovers << " leases_lost=" << g.leases_lost
        << " fast_refills=" << g.fast_refills << " redis_exhausted=" << rp.exhausted
        << " redis_dropped=" << rp.dropped << db << "lock_timeouts=" << ps.lock_timeouts << db
        << "commits_resolved=" << ps.commits_resolved << db
        << "commits_unknown=" << ps.commits_unknown << db << "retries=" << ps.retries
        << " requests=" << counters_.requests.load()
        << " invalid_keys=" << counters_.invalid_keys.load() << db
        << "pool_exhausted=" << counters_.pg_pool_exhausted.load()
        << " untyped=" << counters_.untyped.load()
        << " gateway_dedups=" << counters_.gateway_dedups.load();
    std::lock_guard<std::mutex> lock(counters_.mu);
    for (auto& [name, n] : counters_.errors) out << " err_" << name << "=" << n;
    return out.str();
  }

  Config cfg_;
  idem::redis::RedisStore fast_;
  Store durable_;
  idem::IdempotencyGuard<Store> guard_;
  Counters counters_;
};

void serve_connection(Handler* svc, int fd) {
  LineSocket sock(fd);
  while (auto line = sock.read_line()) {
    if (!sock.write_line(svc->handle(*line))) break;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg = parse(argc, argv);
  std::unique_ptr<Handler> svc;
  try {
    if (cfg.mysql) {
#ifdef IDEM_REL_WITH_MYSQL
      svc = std::make_unique<Service<MysqlBackend>>(cfg);
#else
      usage("--backend mysql needs a build with idem::mysql");
#endif
    } else {
      svc = std::make_unique<Service<PostgresBackend>>(cfg);
    }
  } catch (const std::exception& e) {
    std::cerr << "idem_rel_service: cannot start: " << e.what() << "\n";
    return 3;
  }
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(cfg.port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(lfd, 128) != 0) {
    std::perror("idem_rel_service: bind/listen");
    return 3;
  }
  socklen_t len = sizeof addr;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len);
  std::printf("LISTENING %d\n", ntohs(addr.sin_port));
  std::fflush(stdout);
  for (;;) {
    int fd = ::accept(lfd, nullptr, nullptr);
    if (fd < 0) continue;
    std::thread(serve_connection, svc.get(), fd).detach();
  }
}
