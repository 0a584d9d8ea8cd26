// SPDX-License-Identifier: MIT
// MySQL / MariaDB side by side, one thread, interleaved rounds (A B B A ...), medians:
//   1. first execution: the guard (MemoryStore + MysqlStore, transactional, one business
//      INSERT) vs hand-written libmariadb issuing the minimum statements for the same guarantee,
//      in the two cases a service meets:
//      a. the response is known before the business write (an order number the request
//         carries): hand-written BEGIN; INSERT the record, completed; the business INSERT;
//         COMMIT (a duplicate is caught by 1062). The guard is told the response
//         (CallOptions::expected_response), as the hand-written code knows it;
//      b. the response is made by the business write (its generated id): hand-written BEGIN;
//         INSERT the record in progress; the business INSERT; UPDATE the record with the
//         response; COMMIT. The guard as called without options.
//      (b's guard against a's hand-written code is printed too: what not knowing the response
//      costs against code that knows it.)
//   2. (with IDEM_TEST_REDIS_URL) 1a with Redis in front: RedisStore vs hand-written hiredis +
//      libmariadb (SET key owner NX PX; the four MySQL statements; SET key response);
//   3. a duplicate with the fast store down (replayed from MySQL; the guard skips the down fast
//      store for a second after a failure, GuardOptions::fast_store_retry_after) vs one raw
//      prepared SELECT of the record; the guard trying the fast store on every call is timed
//      alongside.
// Prints per-call latencies, the driver's and the server's CPU time per call, statements per
// call (the server's `Questions` counter) and other SHOW GLOBAL STATUS counters, the commit
// flush setting, and `ratio <name> = <ours over baseline, higher is better>`.
//
// Env: IDEM_TEST_MYSQL_URI (required), IDEM_TEST_REDIS_URL (optional: part 2),
// IDEM_BENCH_ROUNDS (default 21), IDEM_BENCH_CALLS (per round and side, default 200),
// IDEM_BENCH_SERVER_PID (optional, set by run.sh: mariadbd's pid; the server's CPU time per
// call is then printed too, read from /proc/<pid>/task/*/schedstat: on a shared machine CPU
// times are steadier than wall times).
#include <dirent.h>
#include <mysql.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../common/per_call.hpp"
#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "idem/mysql/mysql_store.hpp"
#ifdef IDEM_BENCH_WITH_REDIS
#include "../common/raw_redis.hpp"
#include "idem/redis/redis_store.hpp"
#endif

namespace {

using Clock = std::chrono::steady_clock;
using idem::bench::cpu_now_us;
using idem::bench::DownFastStore;
using idem::bench::env_int;
using idem::bench::timed;
#ifdef IDEM_BENCH_WITH_REDIS
using idem::bench::RawRedis;
#endif

[[noreturn]] void die(const std::string& what, MYSQL* m) {
  throw std::runtime_error("bench: " + what + ": " + mysql_error(m));
}

// CPU time (ns) of every thread of process `pid` so far; 0 when unreadable.
double server_cpu_ns(int pid) {
  if (pid <= 0) return 0;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  double total = 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(dir + "/" + e->d_name + "/schedstat");
    double ns = 0;
    if (f >> ns) total += ns;
  }
  ::closedir(d);
  return total;
}

// The hand-written side: plain libmariadb, prepared statements bound with string values.
class Raw {
 public:
  explicit Raw(const idem::mysql::ConnectionOptions& o) : m_(mysql_init(nullptr)) {
    unsigned tcp = MYSQL_PROTOCOL_TCP;
    mysql_optionsv(m_, MYSQL_OPT_PROTOCOL, &tcp);
    mysql_optionsv(m_, MYSQL_SET_CHARSET_NAME, "utf8mb4");
    if (mysql_real_connect(m_, o.host.c_str(), o.user.c_str(), o.password.c_str(),
                           o.database.c_str(), o.port, nullptr, 0) == nullptr) {
      die("connect", m_);
    }
  }
  ~Raw() {
    for (auto* s : stmts_) mysql_stmt_close(s);
    mysql_close(m_);
  }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;

  MYSQL_STMT* prepare(const std::string& sql) {
    MYSQL_STMT* s = mysql_stmt_init(m_);
    if (mysql_stmt_prepare(s, sql.data(), sql.size()) != 0) die("prepare " + sql, m_);
    stmts_.push_back(s);
    return s;
  }
  // Executes `s` with string parameters. @return mysql_stmt_errno (0: ok).
  unsigned exec(MYSQL_STMT* s, const std::vector<std::string>& args, bool fetch = false) {
    std::vector<MYSQL_BIND> b(args.size());
    std::memset(b.data(), 0, sizeof(MYSQL_BIND) * b.size());
    std::vector<unsigned long> len(args.size());
    for (std::size_t i = 0; i < args.size(); ++i) {
      len[i] = args[i].size();
      b[i].buffer_type = MYSQL_TYPE_STRING;
      b[i].buffer = const_cast<char*>(args[i].data());
      b[i].buffer_length = len[i];
      b[i].length = &len[i];
    }
    if (!b.empty()) mysql_stmt_bind_param(s, b.data());
    if (mysql_stmt_execute(s) != 0) return mysql_stmt_errno(s);
    if (fetch) {
      // status, fingerprint, response_body: into fixed buffers (the minimum work to read them).
      char col[3][256];
      unsigned long l[3];
      my_bool null[3];
      MYSQL_BIND r[3];
      std::memset(r, 0, sizeof r);
      for (int i = 0; i < 3; ++i) {
        r[i].buffer_type = MYSQL_TYPE_STRING;
        r[i].buffer = col[i];
        r[i].buffer_length = sizeof col[i];
        r[i].length = &l[i];
        r[i].is_null = &null[i];
      }
      mysql_stmt_bind_result(s, r);
      int rows = 0;
      while (mysql_stmt_fetch(s) == 0) ++rows;
      mysql_stmt_free_result(s);
      if (rows != 1) throw std::runtime_error("bench: record missing");
    }
    return 0;
  }
  void query(const char* sql) {
    if (mysql_query(m_, sql) != 0) die(sql, m_);
  }
  void commit() {
    if (mysql_commit(m_) != 0) die("commit", m_);
  }
  long long scalar(const char* sql) {
    query(sql);
    MYSQL_RES* r = mysql_store_result(m_);
    MYSQL_ROW row = mysql_fetch_row(r);
    long long v = row != nullptr && row[1] != nullptr ? std::atoll(row[1]) : 0;
    mysql_free_result(r);
    return v;
  }
  MYSQL* handle() const noexcept { return m_; }

 private:
  MYSQL* m_;
  std::vector<MYSQL_STMT*> stmts_;
};

}  // namespace

int main() {
  const char* uri_env = std::getenv("IDEM_TEST_MYSQL_URI");
  if (uri_env == nullptr) {
    std::cerr << "IDEM_TEST_MYSQL_URI is not set\n";
    return 2;
  }
  const int rounds = env_int("IDEM_BENCH_ROUNDS", 21);
  const int calls = env_int("IDEM_BENCH_CALLS", 200);
  auto conn = idem::mysql::parse_uri(uri_env);
  const std::string db = "idem_bench_" + std::to_string(::getpid());
  {
    Raw admin(conn);
    admin.query(("CREATE DATABASE " + db).c_str());
    admin.query("SELECT VERSION()");
    MYSQL_RES* r = mysql_store_result(admin.handle());
    MYSQL_ROW row = mysql_fetch_row(r);
    std::printf("mysql: %s, innodb_flush_log_at_trx_commit=", row[0]);
    mysql_free_result(r);
    admin.query("SELECT @@innodb_flush_log_at_trx_commit");
    r = mysql_store_result(admin.handle());
    row = mysql_fetch_row(r);
    std::printf("%s (every COMMIT waits for its redo log flush)\n", row[0]);
    mysql_free_result(r);
  }
  conn.database = db;

  idem::mysql::MysqlStoreOptions o;
  o.connection = conn;
  o.pool_size = 2;  // one session per autocommit mode, one thread
  idem::mysql::MysqlStore store(o);
  // The baseline's record table: the same DDL, another name.
  auto raw_options = o;
  raw_options.table = "raw_idempotency";
  { idem::mysql::MysqlStore raw_table(raw_options); }
  store.with_session([](idem::mysql::Session& s) {
    s.exec_text(
        "CREATE TABLE payment (id bigint PRIMARY KEY AUTO_INCREMENT, order_no varchar(64) NOT "
        "NULL, amount bigint NOT NULL) ENGINE=InnoDB");
  });
  const std::string pay_sql = "INSERT INTO payment (order_no, amount) VALUES (?, ?)";

  idem::MemoryStore fast;
  idem::IdempotencyGuard guard{fast, store};
  DownFastStore down;
  // With the fast store down, the guard skips it for a second after each failure (what a
  // deployment with Redis in front sets: otherwise every call pays the failed attempt, an
  // exception here, a refused connection in production); the guard that tries it on every
  // call (the default) is timed alongside, for the record.
  idem::GuardOptions replay_options;
  replay_options.fast_store_retry_after = std::chrono::seconds(1);
  idem::IdempotencyGuard replay_guard{static_cast<idem::FastStore&>(down), store, replay_options};
  idem::IdempotencyGuard every_call_guard{static_cast<idem::FastStore&>(down), store};

  // Hand-written baseline: the minimum statements for the same guarantee.
  Raw raw(conn);
  Raw counter(conn);  // reads the server's statement counter
  MYSQL_STMT* raw_record = raw.prepare(
      "INSERT INTO raw_idempotency (idem_key, biz_type, status, fingerprint, owner,"
      " response_body, lease_until, expires_at, created_at, updated_at)"
      " VALUES (?, ?, 'completed', ?, ?, ?, UTC_TIMESTAMP(3),"
      " UTC_TIMESTAMP(3) + INTERVAL 1 DAY, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3))");
  MYSQL_STMT* raw_pay = raw.prepare(pay_sql);
  MYSQL_STMT* raw_select = raw.prepare(
      "SELECT status, fingerprint, response_body FROM raw_idempotency"
      " WHERE idem_key = ? AND biz_type = ?");

  // 1b's hand-written code: the record in progress first (a concurrent duplicate waits on its
  // unique key), completed once the business write made the response.
  MYSQL_STMT* raw_claim = raw.prepare(
      "INSERT INTO raw_idempotency (idem_key, biz_type, status, fingerprint, owner,"
      " lease_until, expires_at, created_at, updated_at)"
      " VALUES (?, ?, 'in_progress', ?, ?, UTC_TIMESTAMP(3) + INTERVAL 30 SECOND,"
      " UTC_TIMESTAMP(3) + INTERVAL 1 DAY, UTC_TIMESTAMP(3), UTC_TIMESTAMP(3))");
  MYSQL_STMT* raw_complete = raw.prepare(
      "UPDATE raw_idempotency SET status = 'completed', response_body = ?,"
      " updated_at = UTC_TIMESTAMP(3) WHERE idem_key = ? AND biz_type = ?");

  int seq = 0;
  std::vector<std::string> ours_keys, raw_keys;
  // 1a: the response known before the handler, on both sides.
  auto known_first = [&](int) {
    auto key = idem::Key::make("payment", "k" + std::to_string(++seq));
    const std::string response = "pay_" + key.id();
    idem::CallOptions call;
    call.expected_response = response;
    auto r = guard.run(key, "fp", call, [&](idem::mysql::Transaction& tx) {
      tx.exec(pay_sql, key.id(), 100);
      return response;
    });
    if (r.outcome != idem::Outcome::kExecuted) throw std::runtime_error("not executed");
  };
  auto raw_first = [&](int) {
    const std::string id = "r" + std::to_string(++seq);
    const std::string owner = idem::OwnerToken::generate().str();
    raw.query("BEGIN");
    if (raw.exec(raw_record, {id, "payment", "fp", owner, "pay_" + id}) != 0) {
      throw std::runtime_error("duplicate (1062)");  // the minimum: stop at the unique key
    }
    if (raw.exec(raw_pay, {id, "100"}) != 0) throw std::runtime_error("pay failed");
    raw.commit();
    raw_keys.push_back(id);
  };
  // 1b: the response made by the handler, on both sides.
  auto ours_first = [&](int) {
    auto key = idem::Key::make("payment", "o" + std::to_string(++seq));
    auto r = guard.run(key, "fp", [&](idem::mysql::Transaction& tx) {
      tx.exec(pay_sql, key.id(), 100);
      return "pay_" + key.id();
    });
    if (r.outcome != idem::Outcome::kExecuted) throw std::runtime_error("not executed");
    ours_keys.push_back(key.id());
  };
  auto raw_after = [&](int) {
    const std::string id = "a" + std::to_string(++seq);
    const std::string owner = idem::OwnerToken::generate().str();
    raw.query("BEGIN");
    if (raw.exec(raw_claim, {id, "payment", "fp", owner}) != 0) {
      throw std::runtime_error("duplicate (1062)");
    }
    if (raw.exec(raw_pay, {id, "100"}) != 0) throw std::runtime_error("pay failed");
    if (raw.exec(raw_complete, {"pay_" + id, id, "payment"}) != 0) {
      throw std::runtime_error("complete failed");
    }
    raw.commit();
  };
  // Statements the server counted for one call of fn (the counter's own query excluded).
  auto statements = [&](const std::function<void(int)>& fn) {
    long long before = counter.scalar("SHOW GLOBAL STATUS LIKE 'Questions'");
    fn(0);
    return counter.scalar("SHOW GLOBAL STATUS LIKE 'Questions'") - before - 1;
  };
  // What the server did per call of fn, over `n` calls: SHOW GLOBAL STATUS deltas, less what
  // two snapshots in a row count on their own.
  // (Innodb_lsn_current: bytes of redo log written.)
  const std::vector<std::string> work_names = {"Handler_write",
                                               "Handler_update",
                                               "Handler_read_key",
                                               "Innodb_buffer_pool_read_requests",
                                               "Innodb_buffer_pool_write_requests",
                                               "Innodb_lsn_current"};
  auto snapshot = [&] {
    std::vector<long long> v;
    for (const auto& name : work_names) {
      v.push_back(counter.scalar(("SHOW GLOBAL STATUS LIKE '" + name + "'").c_str()));
    }
    return v;
  };
  auto server_work = [&](const std::function<void(int)>& fn, int n) {
    auto a = snapshot();
    auto b = snapshot();
    for (int i = 0; i < n; ++i) fn(i);
    auto c = snapshot();
    std::string out;
    for (std::size_t i = 0; i < work_names.size(); ++i) {
      const double per = static_cast<double>((c[i] - b[i]) - (b[i] - a[i])) / n;
      char buf[96];
      std::snprintf(buf, sizeof buf, " %s=%.2f", work_names[i].c_str(), per);
      out += buf;
    }
    return out;
  };

  const int server_pid = env_int("IDEM_BENCH_SERVER_PID", 0);
  // timed(), and the server's CPU time per call appended to *server.
  auto timed_both = [&](int n, const std::function<void(int)>& fn, std::vector<double>* cpu,
                        std::vector<double>* server) {
    const double s0 = server_cpu_ns(server_pid);
    const double us = timed(n, fn, cpu);
    server->push_back((server_cpu_ns(server_pid) - s0) / 1000.0 / n);
    return us;
  };
  auto print_server = [&](const char* ours, const std::vector<double>& a, const char* base,
                          const std::vector<double>& b) {
    if (server_pid <= 0) return;
    std::printf("  server CPU per call: %s %.1f us, %s %.1f us\n", ours, idem::bench::median_of(a),
                base, idem::bench::median_of(b));
  };

  struct Side {
    Side(const char* l, std::function<void(int)> f) : label(l), fn(std::move(f)) {}
    const char* label;
    std::function<void(int)> fn;
    long long statements = 0;
    std::string work;
    std::vector<double> us, cpu, srv;
  };
  std::vector<Side> sides = {{"guard, told the response (expected_response)", known_first},
                             {"hand-written, response known", raw_first},
                             {"guard, response from the handler", ours_first},
                             {"hand-written, response from the business write", raw_after}};
  for (int i = 0; i < 50; ++i) {  // warm up: connections, prepared statements, caches
    for (auto& side : sides) side.fn(i);
  }
  for (auto& side : sides) side.statements = statements(side.fn);
  for (auto& side : sides) side.work = server_work(side.fn, 20);
  for (int r = 0; r < rounds; ++r) {  // the order reversed every other round
    for (std::size_t i = 0; i < sides.size(); ++i) {
      Side& side = sides[r % 2 == 0 ? i : sides.size() - 1 - i];
      side.us.push_back(timed_both(calls, side.fn, &side.cpu, &side.srv));
    }
  }
  std::printf("rounds=%d calls/round/side=%d (medians of per-round means)\n", rounds, calls);
  std::printf("first execution, one business INSERT, fast store 'memory' in front:\n");
  for (const auto& side : sides) {
    std::printf("  %-50s %8.1f us/call %6.0f calls/s | %lld statements | driver CPU %.1f us",
                side.label, idem::bench::median_of(side.us), 1e6 / idem::bench::median_of(side.us),
                side.statements, idem::bench::median_of(side.cpu));
    if (server_pid > 0) std::printf(" | server CPU %.1f us", idem::bench::median_of(side.srv));
    std::printf("\n      server counters per call:%s\n", side.work.c_str());
  }
  auto ratio = [&](const Side& ours, const Side& base) {
    return idem::bench::median_of(base.us) / idem::bench::median_of(ours.us);
  };
  std::printf("ratio mysql_first_execution = %.3f\n", ratio(sides[0], sides[1]));
  std::printf("ratio mysql_first_execution_response_after_handler = %.3f\n",
              ratio(sides[2], sides[3]));
  std::printf("ratio mysql_first_execution_response_after_handler_vs_response_known = %.3f\n",
              ratio(sides[2], sides[1]));

#ifdef IDEM_BENCH_WITH_REDIS
  const char* redis_env = std::getenv("IDEM_TEST_REDIS_URL");
  if (redis_env != nullptr) {
    idem::redis::RedisStoreOptions ro{redis_env};
    ro.key_prefix = "idem_bench_" + std::to_string(::getpid()) + ":";
    idem::redis::RedisStore redis_fast(ro);
    idem::IdempotencyGuard redis_guard{redis_fast, store};
    RawRedis rr(redis_env);
    const std::string raw_prefix = "idem_bench_raw_" + std::to_string(::getpid()) + ":";
    // Told the response, as the hand-written code knows it (1a); and not told (1b's guard).
    auto guard_redis = [&](bool told) {
      auto key = idem::Key::make("payment", "q" + std::to_string(++seq));
      const std::string response = "pay_" + key.id();
      idem::CallOptions call;
      if (told) call.expected_response = response;
      auto r = redis_guard.run(key, "fp", call, [&](idem::mysql::Transaction& tx) {
        tx.exec(pay_sql, key.id(), 100);
        return response;
      });
      if (r.outcome != idem::Outcome::kExecuted) throw std::runtime_error("not executed");
    };
    auto ours_redis = [&](int) { guard_redis(true); };
    auto untold_redis = [&](int) { guard_redis(false); };
    auto raw_redis = [&](int) {
      const std::string id = "s" + std::to_string(++seq);
      const std::string owner = idem::OwnerToken::generate().str();
      const std::string rkey = raw_prefix + "{payment|" + id + "}";
      // Claim in Redis (an in-flight or completed duplicate stops here) ...
      if (!rr.command({"SET", rkey, "p:" + owner, "NX", "PX", "30000"})) {
        throw std::runtime_error("duplicate");
      }
      // ... the durable record and the business row in one transaction ...
      raw.query("BEGIN");
      if (raw.exec(raw_record, {id, "payment", "fp", owner, "pay_" + id}) != 0) {
        throw std::runtime_error("duplicate (1062)");
      }
      if (raw.exec(raw_pay, {id, "100"}) != 0) throw std::runtime_error("pay failed");
      raw.commit();
      // ... and the response in Redis for the duplicates (unconditional: MySQL fences).
      rr.command({"SET", rkey, "d:pay_" + id, "PX", "86400000"});
    };
    for (int i = 0; i < 50; ++i) {
      ours_redis(i);
      untold_redis(i);
      raw_redis(i);
    }
    const long long ours_st = statements(ours_redis), raw_st = statements(raw_redis);
    std::vector<double> a_us, b_us, a_cpu, b_cpu, a_srv, b_srv, u_us, u_cpu, u_srv;
    for (int r = 0; r < rounds; ++r) {
      if (r % 2 == 0) {
        a_us.push_back(timed_both(calls, ours_redis, &a_cpu, &a_srv));
        u_us.push_back(timed_both(calls, untold_redis, &u_cpu, &u_srv));
        b_us.push_back(timed_both(calls, raw_redis, &b_cpu, &b_srv));
      } else {
        b_us.push_back(timed_both(calls, raw_redis, &b_cpu, &b_srv));
        u_us.push_back(timed_both(calls, untold_redis, &u_cpu, &u_srv));
        a_us.push_back(timed_both(calls, ours_redis, &a_cpu, &a_srv));
      }
    }
    std::printf("first execution with Redis + MySQL:\n");
    std::printf(
        "  guard (RedisStore + MysqlStore, told the response) %8.1f us/call  %7.0f calls/s\n",
        idem::bench::median_of(a_us), 1e6 / idem::bench::median_of(a_us));
    std::printf("  hand-written hiredis + libmariadb   %8.1f us/call  %7.0f calls/s\n",
                idem::bench::median_of(b_us), 1e6 / idem::bench::median_of(b_us));
    std::printf("  driver CPU per call: guard %.1f us, hand-written %.1f us\n",
                idem::bench::median_of(a_cpu), idem::bench::median_of(b_cpu));
    std::printf(
        "  MySQL statements per call: guard %lld, hand-written %lld (+ 2 Redis round trips "
        "each)\n",
        ours_st, raw_st);
    print_server("guard", a_srv, "hand-written", b_srv);
    std::printf("  guard not told the response         %8.1f us/call  %7.0f calls/s\n",
                idem::bench::median_of(u_us), 1e6 / idem::bench::median_of(u_us));
    std::printf("ratio mysql_redis_first_execution = %.3f\n",
                idem::bench::median_of(b_us) / idem::bench::median_of(a_us));
    std::printf(
        "ratio mysql_redis_first_execution_response_after_handler_vs_response_known = %.3f\n",
        idem::bench::median_of(b_us) / idem::bench::median_of(u_us));
  } else {
    std::printf("(Redis comparison skipped: IDEM_TEST_REDIS_URL not set)\n");
  }
#endif

  // Replays: the fast store is down, every call goes to MySQL for a completed key.
  auto ours_replay = [&](int i) {
    auto key =
        idem::Key::make("payment", ours_keys[static_cast<std::size_t>(i) % ours_keys.size()]);
    auto r = replay_guard.run(key, "fp", [](idem::mysql::Transaction&) -> std::string {
      throw std::runtime_error("ran");
    });
    if (r.outcome != idem::Outcome::kReplayed) throw std::runtime_error("not replayed");
  };
  auto every_call_replay = [&](int i) {
    auto key =
        idem::Key::make("payment", ours_keys[static_cast<std::size_t>(i) % ours_keys.size()]);
    auto r = every_call_guard.run(key, "fp", [](idem::mysql::Transaction&) -> std::string {
      throw std::runtime_error("ran");
    });
    if (r.outcome != idem::Outcome::kReplayed) throw std::runtime_error("not replayed");
  };
  auto raw_replay = [&](int i) {
    raw.exec(raw_select, {raw_keys[static_cast<std::size_t>(i) % raw_keys.size()], "payment"},
             true);
  };
  ours_replay(0);
  const long long replay_statements = statements(ours_replay);
  every_call_replay(0);
  std::vector<double> rep_us, sel_us, rep_cpu, sel_cpu, rep_srv, sel_srv, all_us, all_cpu, all_srv;
  for (int r = 0; r < rounds; ++r) {
    if (r % 2 == 0) {
      rep_us.push_back(timed_both(calls, ours_replay, &rep_cpu, &rep_srv));
      sel_us.push_back(timed_both(calls, raw_replay, &sel_cpu, &sel_srv));
      all_us.push_back(timed_both(calls, every_call_replay, &all_cpu, &all_srv));
    } else {
      all_us.push_back(timed_both(calls, every_call_replay, &all_cpu, &all_srv));
      sel_us.push_back(timed_both(calls, raw_replay, &sel_cpu, &sel_srv));
      rep_us.push_back(timed_both(calls, ours_replay, &rep_cpu, &rep_srv));
    }
  }
  std::printf("duplicate, fast store down (replay from MySQL):\n");
  std::printf("  guard replay              %8.1f us/call  (%lld statements)\n",
              idem::bench::median_of(rep_us), replay_statements);
  std::printf("  raw SELECT by key         %8.1f us/call  (1 statement)\n",
              idem::bench::median_of(sel_us));
  std::printf(
      "  (guard trying the down fast store on every call: %.1f us/call, driver CPU "
      "%.1f us, server CPU %.1f us)\n",
      idem::bench::median_of(all_us), idem::bench::median_of(all_cpu),
      idem::bench::median_of(all_srv));
  std::printf("  driver CPU per call: guard %.1f us, raw SELECT %.1f us\n",
              idem::bench::median_of(rep_cpu), idem::bench::median_of(sel_cpu));
  print_server("guard", rep_srv, "raw SELECT", sel_srv);
  std::printf("  server counters per call, guard replay:%s\n",
              server_work(ours_replay, 20).c_str());
  std::printf("  server counters per call, raw SELECT:  %s\n", server_work(raw_replay, 20).c_str());
  std::printf("ratio mysql_replay_vs_select = %.3f\n",
              idem::bench::median_of(sel_us) / idem::bench::median_of(rep_us));

  Raw admin(conn);
  admin.query(("DROP DATABASE " + db).c_str());
  return 0;
}
