// SPDX-License-Identifier: MIT
// idem_rel_driver: the reliability suite's client. It is never killed. Per scenario it
//   1. resets the business tables (rel_account, rel_payment) and idem's record table,
//   2. starts idem_rel_service (restarting it whenever it dies; failpoint flags only for the
//      first starts of a crash scenario),
//   3. sends guarded payment requests: many keys, each several times, some in concurrent
//      bursts, from a seeded RNG (same --seed, same plan), while a fault schedule runs,
//   4. heals (Redis resumed and restarted, PostgreSQL started, the service restarted plainly),
//      waits past the lease, and retries every unresolved key until it resolves,
//   5. reads the ground truth from the database and checks: at most one effect per key and
//      balances that match the payments; every success answer equal to the stored response
//      and to the payment row; every key acknowledged as success has its payment; no key stuck
//      in progress; no answer outside idem's typed errors,
//   6. proves the fault fired (service counters, exit status, server start time).
// It prints one row per scenario and a summary line; exit 1 on any violation or unfired fault.
//
// Environment (as scripts/servers.sh prints it): IDEM_TEST_REDIS_URL, IDEM_TEST_POSTGRES_DSN
// (or IDEM_TEST_MYSQL_URI with --backend mysql), IDEM_SERVERS_SCRIPT, IDEM_SERVERS_DIR,
// IDEM_REDIS_PORT. Missing: exit 77 (skipped), or 1 when IDEM_REQUIRE_SERVERS=1.
//
// --backend mysql: the service runs on MysqlStore; the ground truth is read from MySQL, and
// the database fault is `mysql_kill` (kill -9 of mysqld, then a start: InnoDB crash recovery)
// instead of `pg_restart`.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <pqxx/pqxx>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifdef IDEM_REL_WITH_MYSQL
#include <mysql.h>
#endif

#include "wire.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using idem::reliability::hex_encode;
using idem::reliability::LineSocket;

void sleep_ms(long ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

std::string env_or(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}

// ---------------------------------------------------------------------------------------------
// Settings

struct Settings {
  std::string service_bin;
  std::string redis_url, pg_dsn, servers_script, servers_dir, redis_port;
  std::string backend = "postgres";  // or "mysql"
  std::string mysql_uri;
  std::uint64_t seed = 1;
  int keys = 60;
  int sends = 3;
  int workers = 6;
  long duration_ms = 4000;  // pacing: the load phase lasts about this long
  long lease_ms = 1000;
  std::vector<std::string> scenarios;
  std::vector<std::string> modes{"transactional", "two-phase"};
  /// Two-phase scenarios to run (empty: all). --smoke keeps the ones that differ most.
  std::vector<std::string> two_phase_only;
  bool verbose = false;
};

const std::vector<std::string> kAllScenarios = {"baseline",
                                                "redis_kill",
                                                "flushall",
                                                "redis_pause",
                                                "pg_restart",
                                                "crash_fast_claimed",
                                                "crash_durable_claimed",
                                                "crash_handler_returned",
                                                "crash_durable_committed",
                                                "slow_handler",
                                                "pool_exhaustion",
                                                "payload_mismatch",
                                                "hostile_keys",
                                                "control_unguarded"};

int run_shell(const std::string& cmd) {
  int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

// ---------------------------------------------------------------------------------------------
// The service process, restarted whenever it dies.

class Supervisor {
 public:
  Supervisor(std::string bin, std::vector<std::string> base_args)
      : bin_(std::move(bin)), base_(std::move(base_args)) {}
  ~Supervisor() { stop(); }

  /// Starts the service with `extra` args for the first `extra_starts` starts, then plain.
  void start(std::vector<std::string> extra, int extra_starts) {
    stop();
    extra_ = std::move(extra);
    extra_starts_ = extra_starts;
    starts_ = 0;
    crashes_ = 0;
    other_exits_ = 0;
    running_ = true;
    monitor_ = std::thread([this] { loop(); });
    wait_port(60'000);
  }

  /// Kills the service (SIGKILL) and stops restarting it.
  void stop() {
    if (!monitor_.joinable()) return;
    running_ = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pid_ > 0) ::kill(pid_, SIGKILL);
    }
    monitor_.join();
  }

  /// Port of the live service, 0 while it (re)starts.
  std::uint16_t port() const { return port_.load(); }
  /// Waits until the service listens (true) or `ms` passed.
  bool wait_port(long ms) {
    auto end = Clock::now() + std::chrono::milliseconds(ms);
    while (port_.load() == 0) {
      if (Clock::now() > end) return false;
      sleep_ms(10);
    }
    return true;
  }
  int crashes() const { return crashes_.load(); }
  int other_exits() const { return other_exits_.load(); }

 private:
  void loop() {
    while (running_) {
      std::vector<std::string> args = base_;
      if (starts_ < extra_starts_) args.insert(args.end(), extra_.begin(), extra_.end());
      ++starts_;
      int out[2];
      if (::pipe(out) != 0) return;
      pid_t pid = ::fork();
      if (pid == 0) {
        ::dup2(out[1], 1);
        ::close(out[0]);
        ::close(out[1]);
        std::vector<char*> argv;
        argv.push_back(const_cast<char*>(bin_.c_str()));
        for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
        argv.push_back(nullptr);
        ::execv(bin_.c_str(), argv.data());
        ::_exit(127);
      }
      ::close(out[1]);
      {
        std::lock_guard<std::mutex> lock(mu_);
        pid_ = pid;
        if (!running_) ::kill(pid, SIGKILL);  // stop() ran between its kill and this fork
      }
      // Read "LISTENING <port>".
      std::string line;
      char ch;
      while (::read(out[0], &ch, 1) == 1 && ch != '\n') line.push_back(ch);
      if (line.rfind("LISTENING ", 0) == 0)
        port_ = static_cast<std::uint16_t>(std::stoi(line.substr(10)));
      int status = 0;
      ::waitpid(pid, &status, 0);
      ::close(out[0]);
      port_ = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        pid_ = -1;
      }
      if (!running_) break;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 137) {
        ++crashes_;
      } else {
        ++other_exits_;  // e.g. 3: could not start (PostgreSQL down); try again shortly
        sleep_ms(200);
      }
    }
  }

  std::string bin_;
  std::vector<std::string> base_, extra_;
  int extra_starts_ = 0, starts_ = 0;
  std::atomic<bool> running_{false};
  std::atomic<std::uint16_t> port_{0};
  std::atomic<int> crashes_{0}, other_exits_{0};
  std::mutex mu_;
  pid_t pid_ = -1;
  std::thread monitor_;
};

// ---------------------------------------------------------------------------------------------
// Calls

enum class Kind { kOk, kBusy, kMismatch, kErr, kUntyped, kLost };

struct Answer {
  Kind kind = Kind::kLost;
  bool executed = false;
  std::string value;  // payment number (OK) or errc name (ERR) or text (UNTYPED)
  long amount = 0;    // the amount this request carried
};

Answer parse_answer(const std::string& line) {
  Answer a;
  std::istringstream in(line);
  std::string w;
  in >> w;
  if (w == "OK") {
    std::string how;
    in >> how >> a.value;
    a.kind = Kind::kOk;
    a.executed = how == "executed";
  } else if (w == "BUSY") {
    a.kind = Kind::kBusy;
  } else if (w == "MISMATCH") {
    a.kind = Kind::kMismatch;
  } else if (w == "ERR") {
    a.kind = Kind::kErr;
    in >> a.value;
  } else {
    a.kind = Kind::kUntyped;
    a.value = line;
  }
  return a;
}

/// One client connection that reconnects to the current service port.
class Client {
 public:
  explicit Client(const Supervisor& sup) : sup_(sup) {}
  /// Sends one line; the answer line, or nullopt when the connection broke (service died).
  std::optional<std::string> request(const std::string& line) {
    auto end = Clock::now() + std::chrono::seconds(60);
    while (!sock_) {
      auto port = sup_.port();
      if (port != 0) {
        int fd = LineSocket::connect_loopback(port, 20'000);
        if (fd >= 0) {
          sock_ = std::make_unique<LineSocket>(fd);
          break;
        }
      }
      if (Clock::now() > end) return std::nullopt;
      sleep_ms(10);
    }
    if (!sock_->write_line(line)) {
      sock_.reset();
      return std::nullopt;
    }
    auto ans = sock_->read_line();
    if (!ans) sock_.reset();
    return ans;
  }
  Answer pay(const std::string& id, long account, long amount) {
    auto line = request("PAY " + (id.empty() ? std::string("-") : hex_encode(id)) + " " +
                        std::to_string(account) + " " + std::to_string(amount));
    Answer a = line ? parse_answer(*line) : Answer{};
    a.amount = amount;
    return a;
  }
  std::map<std::string, long> stats() {
    std::map<std::string, long> out;
    for (int i = 0; i < 50; ++i) {
      auto line = request("STATS");
      if (!line) continue;
      std::istringstream in(*line);
      std::string w;
      in >> w;
      while (in >> w) {
        auto eq = w.find('=');
        if (eq != std::string::npos) out[w.substr(0, eq)] = std::stol(w.substr(eq + 1));
      }
      return out;
    }
    return out;
  }

 private:
  const Supervisor& sup_;
  std::unique_ptr<LineSocket> sock_;
};

// ---------------------------------------------------------------------------------------------
// The ground truth: the business tables and idem's record table, read outside idem.

struct Truth {
  struct Effect {
    long count = 0;
    long first_id = 0;
    long amount = 0;
  };
  std::map<std::string, Effect> effects;      // rel_payment by key
  std::map<std::string, std::string> stored;  // completed records: key id -> response
  long in_progress_rows = 0, idem_rows = 0, bad_accounts = 0;
};

constexpr long kAccounts = 16;
constexpr long kInitialBalance = 100'000'000;
// Accounts whose debits differ from their payments (any dialect).
constexpr const char* kBadAccounts =
    "SELECT count(*) FROM rel_account a WHERE a.initial - a.balance <> "
    "(SELECT coalesce(sum(p.amount), 0) FROM rel_payment p WHERE p.account = a.id)";

class Database {
 public:
  virtual ~Database() = default;
  virtual void setup_schema() = 0;
  /// Empties the business tables and the record table; refills the accounts.
  virtual void reset() = 0;
  virtual Truth truth() = 0;
  /// Names the running server process (changes when it restarts).
  virtual std::string server_identity() = 0;
};

class PgDatabase final : public Database {
 public:
  explicit PgDatabase(std::string dsn) : dsn_(std::move(dsn)) {}
  void setup_schema() override {
    pqxx::connection c(dsn_);
    pqxx::work tx(c);
    tx.exec(
        "CREATE TABLE IF NOT EXISTS rel_account (id bigint PRIMARY KEY, initial bigint NOT NULL,"
        " balance bigint NOT NULL)");
    // No unique constraint on idem_key: a duplicate effect must be visible, not prevented here.
    // The two-phase service's "external party": remembers each key's payment.
    tx.exec(
        "CREATE TABLE IF NOT EXISTS rel_gateway (idem_key text PRIMARY KEY, payment_id bigint)");
    tx.exec(
        "CREATE TABLE IF NOT EXISTS rel_payment (id bigserial PRIMARY KEY, idem_key text NOT NULL,"
        " account bigint NOT NULL, amount bigint NOT NULL)");
    tx.commit();
  }
  void reset() override {
    pqxx::connection c(dsn_);
    pqxx::work tx(c);
    tx.exec("TRUNCATE rel_payment, rel_gateway");
    tx.exec("DELETE FROM rel_account");
    tx.exec("INSERT INTO rel_account SELECT g, " + std::to_string(kInitialBalance) + ", " +
            std::to_string(kInitialBalance) + " FROM generate_series(0, " +
            std::to_string(kAccounts - 1) + ") g");
    if (tx.exec("SELECT to_regclass('rel_idempotency') IS NOT NULL").at(0).at(0).as<bool>()) {
      tx.exec("TRUNCATE rel_idempotency");
    }
    tx.commit();
  }
  Truth truth() override {
    Truth t;
    pqxx::connection c(dsn_);
    pqxx::work tx(c);
    for (auto r : tx.exec("SELECT idem_key, count(*), min(id), min(amount) FROM rel_payment GROUP "
                          "BY idem_key")) {
      t.effects[r[0].as<std::string>()] = {r[1].as<long>(), r[2].as<long>(), r[3].as<long>()};
    }
    for (auto r : tx.exec(
             "SELECT idem_key, status, convert_from(response_body, 'UTF8') FROM rel_idempotency")) {
      ++t.idem_rows;
      if (r[1].as<std::string>() == "completed")
        t.stored[r[0].as<std::string>()] = r[2].as<std::string>();
      else if (r[1].as<std::string>() == "in_progress")
        ++t.in_progress_rows;
    }
    t.bad_accounts = tx.exec(kBadAccounts).at(0).at(0).as<long>();
    return t;
  }
  std::string server_identity() override {
    for (int i = 0; i < 100; ++i) {
      try {
        pqxx::connection c(dsn_);
        pqxx::nontransaction tx(c);
        return tx.exec("SELECT pg_postmaster_start_time()::text").at(0).at(0).as<std::string>();
      } catch (const std::exception&) {
        sleep_ms(200);
      }
    }
    return "?";
  }

 private:
  std::string dsn_;
};

#ifdef IDEM_REL_WITH_MYSQL
// MySQL through the plain client library (text protocol), independent of idem's client.
class MysqlDatabase final : public Database {
 public:
  MysqlDatabase(std::string uri, std::string pid_file)
      : uri_(std::move(uri)), pid_file_(std::move(pid_file)) {}
  void setup_schema() override {
    Conn c(uri_);
    c.run(
        "CREATE TABLE IF NOT EXISTS rel_account (id bigint PRIMARY KEY,"
        " initial bigint NOT NULL, balance bigint NOT NULL) ENGINE=InnoDB");
    c.run(
        "CREATE TABLE IF NOT EXISTS rel_gateway (idem_key varchar(255) CHARACTER SET ascii"
        " COLLATE ascii_bin PRIMARY KEY, payment_id bigint NULL) ENGINE=InnoDB");
    c.run(
        "CREATE TABLE IF NOT EXISTS rel_payment (id bigint AUTO_INCREMENT PRIMARY KEY,"
        " idem_key varchar(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
        " account bigint NOT NULL, amount bigint NOT NULL) ENGINE=InnoDB");
  }
  void reset() override {
    Conn c(uri_);
    c.run("TRUNCATE rel_payment");
    c.run("TRUNCATE rel_gateway");
    c.run("DELETE FROM rel_account");
    std::string values;
    for (long a = 0; a < kAccounts; ++a) {
      values += (a == 0 ? "(" : ", (") + std::to_string(a) + ", " +
                std::to_string(kInitialBalance) + ", " + std::to_string(kInitialBalance) + ")";
    }
    c.run("INSERT INTO rel_account (id, initial, balance) VALUES " + values);
    if (!c.rows("SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
                " AND TABLE_NAME = 'rel_idempotency'")
             .empty()) {
      c.run("TRUNCATE rel_idempotency");
    }
  }
  Truth truth() override {
    Truth t;
    Conn c(uri_);
    for (auto& r : c.rows("SELECT idem_key, count(*), min(id), min(amount) FROM rel_payment"
                          " GROUP BY idem_key")) {
      t.effects[r[0]] = {std::stol(r[1]), std::stol(r[2]), std::stol(r[3])};
    }
    for (auto& r : c.rows("SELECT idem_key, status, response_body FROM rel_idempotency")) {
      ++t.idem_rows;
      if (r[1] == "completed")
        t.stored[r[0]] = r[2];
      else if (r[1] == "in_progress")
        ++t.in_progress_rows;
    }
    t.bad_accounts = std::stol(c.rows(kBadAccounts).at(0).at(0));
    return t;
  }
  std::string server_identity() override {
    for (int i = 0; i < 100; ++i) {
      std::ifstream f(pid_file_);
      std::string pid;
      if (f >> pid) return "pid " + pid;
      sleep_ms(200);
    }
    return "?";
  }

 private:
  // mysql://user:password@host:port/database (what scripts/servers.sh prints; no escapes).
  class Conn {
   public:
    explicit Conn(const std::string& uri) : m_(mysql_init(nullptr)) {
      std::string rest = uri.substr(uri.find("://") + 3);
      std::string user, password, host = "127.0.0.1", db;
      unsigned port = 3306;
      if (auto at = rest.rfind('@'); at != std::string::npos) {
        std::string auth = rest.substr(0, at);
        rest = rest.substr(at + 1);
        auto colon = auth.find(':');
        user = auth.substr(0, colon);
        if (colon != std::string::npos) password = auth.substr(colon + 1);
      }
      if (auto slash = rest.find('/'); slash != std::string::npos) {
        db = rest.substr(slash + 1, rest.find('?', slash) - slash - 1);
        rest = rest.substr(0, slash);
      }
      if (auto colon = rest.rfind(':'); colon != std::string::npos) {
        port = static_cast<unsigned>(std::stoul(rest.substr(colon + 1)));
        rest = rest.substr(0, colon);
      }
      if (!rest.empty()) host = rest;
      unsigned tcp = MYSQL_PROTOCOL_TCP;
      mysql_optionsv(m_, MYSQL_OPT_PROTOCOL, &tcp);
      for (int i = 0; i < 100; ++i) {  // the server may be starting (crash recovery)
        if (mysql_real_connect(m_, host.c_str(), user.c_str(), password.c_str(), db.c_str(), port,
                               nullptr, 0) != nullptr) {
          return;
        }
        sleep_ms(200);
      }
      std::string e = mysql_error(m_);
      mysql_close(m_);
      throw std::runtime_error("mysql: " + e);
    }
    ~Conn() { mysql_close(m_); }
    Conn(const Conn&) = delete;
    Conn& operator=(const Conn&) = delete;
    void run(const std::string& sql) { (void)rows(sql); }
    std::vector<std::vector<std::string>> rows(const std::string& sql) {
      if (mysql_real_query(m_, sql.data(), sql.size()) != 0) {
        throw std::runtime_error("mysql: " + std::string(mysql_error(m_)) + " in: " + sql);
      }
      std::vector<std::vector<std::string>> out;
      MYSQL_RES* r = mysql_store_result(m_);
      if (r == nullptr) return out;
      const unsigned n = mysql_num_fields(r);
      while (MYSQL_ROW row = mysql_fetch_row(r)) {
        unsigned long* len = mysql_fetch_lengths(r);
        std::vector<std::string> v;
        for (unsigned i = 0; i < n; ++i) {
          v.emplace_back(row[i] != nullptr ? std::string(row[i], len[i]) : std::string());
        }
        out.push_back(std::move(v));
      }
      mysql_free_result(r);
      return out;
    }

   private:
    MYSQL* m_;
  };

  std::string uri_, pid_file_;
};
#endif

// ---------------------------------------------------------------------------------------------
// Scenario

struct KeyInfo {
  std::string id;
  long account = 0;
  long amount = 0;
  long variant = 0;  // a different amount (payload_mismatch), 0 if none
};

struct Task {
  int key = 0;
  bool variant = false;
};

struct Row {
  std::string name;
  long requests = 0;
  long faults = 0;
  long duplicates = 0;
  long lost = 0;
  long divergent = 0;
  long stuck = 0;
  long untyped = 0;
  bool fired = false;
  bool control = false;  // negative control: its violations are expected, not counted
  std::string proof;
  double seconds = 0;
  bool bad() const {
    return !fired || (!control && (duplicates || lost || divergent || stuck || untyped));
  }
};

class Runner {
 public:
  explicit Runner(Settings s) : s_(std::move(s)) {
#ifdef IDEM_REL_WITH_MYSQL
    if (s_.backend == "mysql") {
      db_ = std::make_unique<MysqlDatabase>(s_.mysql_uri, s_.servers_dir + "/mysql/mariadb.pid");
      return;
    }
#endif
    db_ = std::make_unique<PgDatabase>(s_.pg_dsn);
  }

  void setup_schema() { db_->setup_schema(); }

  /// Empties both stores and the business tables, so a replay of the same seed (same keys)
  /// starts from nothing: the service's Redis records (prefix idemrel:) too.
  void reset_tables() {
    run_shell("redis-cli -h 127.0.0.1 -p " + s_.redis_port +
              " EVAL \"for _, k in ipairs(redis.call('KEYS', 'idemrel:*')) do "
              "redis.call('DEL', k) end\" 0 >/dev/null");
    for (int attempt = 0;; ++attempt) {
      try {
        db_->reset();
        return;
      } catch (const std::exception&) {
        if (attempt > 100) throw;
        sleep_ms(200);
      }
    }
  }

  std::vector<std::string> base_args() const {
    return {"--redis-url", s_.redis_url,  "--pg-dsn",   s_.pg_dsn,    "--backend",
            s_.backend,    "--mysql-uri", s_.mysql_uri, "--lease-ms", std::to_string(s_.lease_ms),
            "--mode",      mode_};
  }

  /// Selects the service's mode for the next runs: transactional or two-phase.
  void set_mode(const std::string& m) { mode_ = m; }

  Row run(const std::string& name);

 private:
  // Fault helpers ------------------------------------------------------------------------------
  int servers(const std::string& what) {
    return run_shell("\"" + s_.servers_script + "\" " + what + " >/dev/null 2>&1");
  }
  pid_t redis_pid() {
    std::ifstream f(s_.servers_dir + "/redis.pid");
    long pid = 0;
    f >> pid;
    return static_cast<pid_t>(pid);
  }
  void heal() {
    if (auto pid = redis_pid(); pid > 0) ::kill(pid, SIGCONT);
    servers("redis-start");
    servers(s_.backend == "mysql" ? "mysql-start" : "pg-start");
  }

  Settings s_;
  std::unique_ptr<Database> db_;
  std::string mode_ = "transactional";
};

Row Runner::run(const std::string& name) {
  auto t_start = Clock::now();
  Row row;
  row.name = mode_ == "two-phase" ? "2p:" + name : name;
  std::mt19937_64 rng(s_.seed ^ std::hash<std::string>{}(row.name));
  const bool hostile = name == "hostile_keys";
  const bool mismatch = name == "payload_mismatch";
  const bool slow = name == "slow_handler";

  // Keys --------------------------------------------------------------------------------------
  std::vector<KeyInfo> keys;
  std::string prefix =
      "s" + std::to_string(s_.seed) + "-" + (mode_ == "two-phase" ? "2p-" : "") + name + "-";
  if (hostile) {
    std::vector<std::string> ids = {"",                     // id.empty
                                    std::string(129, 'a'),  // id.too_long
                                    "has space",            // id.charset
                                    "tab\there",
                                    std::string("nul\0byte", 8),
                                    "crlf\r\nSET idemrel:x 1",
                                    "caf\xc3\xa9",  // non-ASCII
                                    std::string(1, '\x7f'),
                                    "\x1b[31mred",
                                    std::string(4096, 'k')};
    for (auto& id : ids) keys.push_back({id, 0, 1, 0});
  } else {
    std::uniform_int_distribution<long> acct(0, kAccounts - 1), amt(1, 500);
    for (int i = 0; i < s_.keys; ++i) {
      KeyInfo k;
      k.id = prefix + std::to_string(i);
      if (slow && i % 10 == 0) k.id = prefix + "slow-" + std::to_string(i);
      k.account = acct(rng);
      k.amount = amt(rng);
      if (mismatch) k.variant = k.amount + 1 + amt(rng);
      keys.push_back(k);
    }
  }

  // Plan: per key either one concurrent burst of all its sends or separate sends; blocks
  // shuffled. payload_mismatch: every key's first send goes first (phase 1), then the rest
  // with one variant per key (phase 2), so a variant can only meet a stored original.
  std::vector<std::vector<Task>> blocks;
  std::vector<Task> phase1;
  std::bernoulli_distribution burst(0.25);
  for (int i = 0; i < static_cast<int>(keys.size()); ++i) {
    int sends = s_.sends;
    if (mismatch) {
      phase1.push_back({i, false});
      blocks.push_back({{i, true}});
      sends -= 1;
    }
    if (burst(rng)) {
      blocks.emplace_back(static_cast<std::size_t>(sends), Task{i, false});
    } else {
      for (int j = 0; j < sends; ++j) blocks.push_back({{i, false}});
    }
  }
  std::shuffle(blocks.begin(), blocks.end(), rng);
  std::vector<Task> tasks = phase1;
  for (auto& b : blocks) tasks.insert(tasks.end(), b.begin(), b.end());

  // Service ------------------------------------------------------------------------------------
  std::vector<std::string> extra;
  int extra_starts = 0;
  int workers = s_.workers;
  if (name.rfind("crash_", 0) == 0) {
    extra = {"--crash-step", name.substr(6), "--crash-nth", "5"};
    extra_starts = 2;  // crash twice, then run plainly
  } else if (slow) {
    extra = {"--slow-ms", std::to_string(s_.lease_ms * 9 / 5)};
    extra_starts = 1 << 20;
  } else if (name == "control_unguarded") {
    extra = {"--unguarded"};
    extra_starts = 1 << 20;
  } else if (name == "pool_exhaustion") {
    extra = {"--pg-pool",    "2", "--pg-pool-wait-ms",    "30", "--handler-ms", "60",
             "--redis-pool", "2", "--redis-pool-wait-ms", "0"};
    extra_starts = 1 << 20;
    workers = std::max(workers, 8);
  }
  reset_tables();
  Supervisor sup(s_.service_bin, base_args());
  sup.start(extra, extra_starts);
  std::map<std::string, long> stats0;
  {
    Client c(sup);
    stats0 = c.stats();
  }

  // Load ---------------------------------------------------------------------------------------
  std::mutex mu;
  std::vector<std::vector<Answer>> answers(keys.size());
  std::atomic<std::size_t> next{0}, done{0};
  std::atomic<long> requests{0};
  const long pace_ms = std::max<long>(
      0, s_.duration_ms * workers / static_cast<long>(std::max<std::size_t>(1, tasks.size())) - 2);
  auto worker = [&] {
    Client c(sup);
    for (;;) {
      auto i = next.fetch_add(1);
      if (i >= tasks.size()) break;
      if (mismatch && i >= phase1.size()) {
        // phase 2 (variants and duplicates) starts once every original has been answered
        while (done.load() < phase1.size()) sleep_ms(5);
      }
      const Task& t = tasks[i];
      const KeyInfo& k = keys[static_cast<std::size_t>(t.key)];
      Answer a = c.pay(k.id, k.account, t.variant ? k.variant : k.amount);
      requests.fetch_add(1);
      {
        std::lock_guard<std::mutex> lock(mu);
        answers[static_cast<std::size_t>(t.key)].push_back(a);
      }
      done.fetch_add(1);
      if (pace_ms > 0) sleep_ms(pace_ms);
    }
  };

  // Fault schedule: fires once 30% of the plan is done.
  std::string pg_before, pg_after;
  std::string fault_note;
  bool fault_ok = true;
  auto fault = [&] {
    while (done.load() < tasks.size() * 3 / 10) sleep_ms(5);
    if (name == "redis_kill") {
      fault_ok = servers("redis-kill") == 0;
      row.faults += 1;
      sleep_ms(s_.duration_ms / 4);
      servers("redis-start");
    } else if (name == "flushall") {
      fault_ok = run_shell("redis-cli -h 127.0.0.1 -p " + s_.redis_port +
                           " FLUSHALL 2>&1 | grep -q OK") == 0;
      row.faults += 1;
    } else if (name == "redis_pause") {
      pid_t pid = redis_pid();
      fault_ok = pid > 0 && ::kill(pid, SIGSTOP) == 0;
      row.faults += 1;
      sleep_ms(s_.lease_ms * 5 / 2);
      if (pid > 0) ::kill(pid, SIGCONT);
    } else if (name == "pg_restart") {
      pg_before = db_->server_identity();
      fault_ok = servers("pg-restart immediate") == 0;
      row.faults += 1;
      pg_after = db_->server_identity();
    } else if (name == "mysql_kill") {
      // kill -9 of mysqld with transactions open; the start runs InnoDB crash recovery.
      pg_before = db_->server_identity();
      fault_ok = servers("mysql-kill") == 0;
      row.faults += 1;
      sleep_ms(s_.duration_ms / 8);
      fault_ok = servers("mysql-start") == 0 && fault_ok;
      pg_after = db_->server_identity();
    }
  };
  std::thread fault_thread(fault);
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) pool.emplace_back(worker);

  // slow_handler: for each slow key, a duplicate arrives after the lease ended (while the
  // first attempt still sleeps in its handler), so it takes over the fast-store claim.
  std::vector<std::thread> slow_threads;
  if (slow) {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].id.find("-slow-") == std::string::npos) continue;
      for (int dup = 0; dup < 2; ++dup) {
        slow_threads.emplace_back([&, i, dup] {
          if (dup == 1) sleep_ms(s_.lease_ms + s_.lease_ms / 4);
          Client c(sup);
          Answer a = c.pay(keys[i].id, keys[i].account, keys[i].amount);
          requests.fetch_add(1);
          std::lock_guard<std::mutex> lock(mu);
          answers[i].push_back(a);
        });
      }
      row.faults += 1;
    }
  }
  for (auto& t : pool) t.join();
  for (auto& t : slow_threads) t.join();
  fault_thread.join();

  std::map<std::string, long> stats1;
  {
    Client c(sup);
    stats1 = c.stats();
  }
  auto delta = [&](const std::string& k) { return stats1[k] - stats0[k]; };

  // Heal, restart the service plainly, wait past the lease, resolve every key -----------------
  heal();
  int crashes = sup.crashes();
  sup.stop();
  sup.start({}, 0);
  sleep_ms(s_.lease_ms + 500);
  std::vector<int> stuck_keys;
  if (!hostile) {
    std::atomic<std::size_t> ki{0};
    std::vector<std::thread> resolvers;
    for (int w = 0; w < workers; ++w) {
      resolvers.emplace_back([&] {
        Client c(sup);
        for (;;) {
          auto i = ki.fetch_add(1);
          if (i >= keys.size()) break;
          // Every key is asked once more (a replay must equal the stored response), and
          // retried until it answers OK: a key that never does is stuck.
          bool resolved = false;
          for (int attempt = 0; attempt < 60 && !resolved; ++attempt) {
            Answer a = c.pay(keys[i].id, keys[i].account, keys[i].amount);
            requests.fetch_add(1);
            resolved = a.kind == Kind::kOk;
            {
              std::lock_guard<std::mutex> lock(mu);
              answers[i].push_back(a);
            }
            if (!resolved) sleep_ms(100);
          }
          if (!resolved) {
            std::lock_guard<std::mutex> lock(mu);
            stuck_keys.push_back(static_cast<int>(i));
          }
        }
      });
    }
    for (auto& t : resolvers) t.join();
  }
  sup.stop();

  // Ground truth -------------------------------------------------------------------------------
  Truth ground = db_->truth();
  const auto& effects = ground.effects;
  const auto& stored = ground.stored;
  const long in_progress_rows = ground.in_progress_rows, idem_rows = ground.idem_rows,
             bad_accounts = ground.bad_accounts;

  // Checks -------------------------------------------------------------------------------------
  long mismatches_seen = 0, typed_storage_errors = 0, invalid_key_answers = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const KeyInfo& k = keys[i];
    auto eff = effects.find(k.id);
    bool has_effect = eff != effects.end();
    if (has_effect && eff->second.count > 1) ++row.duplicates;
    auto st = stored.find(k.id);
    if (has_effect && st == stored.end()) ++row.divergent;  // an effect without its record
    bool acked = false;
    for (const Answer& a : answers[i]) {
      switch (a.kind) {
        case Kind::kOk: {
          acked = true;
          std::string truth = has_effect ? "pay_" + std::to_string(eff->second.first_id) : "";
          bool same = has_effect && a.value == truth && st != stored.end() &&
                      st->second == a.value && eff->second.amount == a.amount;
          if (!same) ++row.divergent;
          break;
        }
        case Kind::kMismatch:
          ++mismatches_seen;
          break;
        case Kind::kErr:
          if (a.value == "invalid_key")
            ++invalid_key_answers;
          else if (hostile)
            ++row.untyped;  // a hostile key must be refused as invalid_key
          else
            ++typed_storage_errors;
          break;
        case Kind::kUntyped:
          ++row.untyped;
          std::cerr << "  untyped answer for " << k.id << ": " << a.value << "\n";
          break;
        case Kind::kBusy:
        case Kind::kLost:
          break;
      }
      if (hostile && a.kind != Kind::kErr && a.kind != Kind::kUntyped) ++row.untyped;
    }
    if (acked && !has_effect) ++row.lost;
  }
  row.duplicates += bad_accounts;
  row.stuck = static_cast<long>(stuck_keys.size()) + in_progress_rows;
  row.requests = requests.load();
  if (s_.verbose) {
    std::cerr << "  " << name << " stats:";
    for (auto& [k, v] : stats1) std::cerr << " " << k << "=" << v - stats0[k];
    std::cerr << " crashes=" << crashes << "\n";
  }

  // Did the fault fire? -------------------------------------------------------------------------
  std::ostringstream proof;
  if (name == "baseline") {
    row.fired = true;
    proof << "no fault; executed=" << delta("executed") << " replayed=" << delta("replayed");
  } else if (name == "redis_kill" || name == "redis_pause") {
    row.fired = fault_ok && delta("degraded") > 0;
    proof << "degraded=" << delta("degraded");
  } else if (name == "flushall") {
    row.fired = fault_ok && delta("durable_conflicts") > 0;
    proof << "durable_conflicts=" << delta("durable_conflicts");
  } else if (name == "pg_restart") {
    row.fired = fault_ok && pg_before != pg_after && typed_storage_errors > 0;
    proof << "postmaster restarted=" << (pg_before != pg_after ? "yes" : "no")
          << " typed_storage_errors=" << typed_storage_errors;
  } else if (name == "mysql_kill") {
    row.fired = fault_ok && pg_before != pg_after && typed_storage_errors > 0;
    proof << "mysqld killed and restarted=" << (pg_before != pg_after ? "yes" : "no")
          << " typed_storage_errors=" << typed_storage_errors
          << " commits_unknown=" << delta("mysql_commits_unknown");
  } else if (name.rfind("crash_", 0) == 0) {
    row.faults = crashes;
    row.fired = crashes > 0;
    proof << "exit(137) at " << name.substr(6) << " x" << crashes;
  } else if (slow) {
    // Redis drops an in-progress record when its lease (PX) ends, so the late duplicate gets a
    // fresh fast claim (not a counted takeover); the unique index then catches it
    // (durable_conflicts) and the slow first attempt finds its fast claim gone and refills the
    // record from the durable answer (fast_refills). Two-phase mode counts durable takeovers.
    row.fired =
        delta("takeovers") > 0 || (delta("durable_conflicts") > 0 && delta("fast_refills") > 0);
    proof << "takeovers=" << delta("takeovers")
          << " durable_conflicts=" << delta("durable_conflicts")
          << " fast_refills=" << delta("fast_refills");
  } else if (name == "control_unguarded") {
    // The same load without idem: the checks must find duplicate effects, or they prove nothing.
    row.control = true;
    row.faults = static_cast<long>(keys.size());
    row.fired = row.duplicates > 0;
    proof << "negative control (no idem): checks caught " << row.duplicates
          << " duplicate effects (expected > 0; not counted)";
  } else if (name == "pool_exhaustion") {
    const std::string db = s_.backend == "mysql" ? "mysql_" : "pg_";
    row.faults = delta(db + "pool_exhausted") + delta("redis_exhausted");
    row.fired = delta(db + "pool_exhausted") > 0;
    proof << db << "pool_exhausted=" << delta(db + "pool_exhausted")
          << " redis_exhausted=" << delta("redis_exhausted");
  } else if (mismatch) {
    row.faults = static_cast<long>(keys.size());
    row.fired = mismatches_seen > 0 && delta("mismatched") > 0;
    proof << "mismatch answers=" << mismatches_seen;
  } else if (hostile) {
    row.faults = static_cast<long>(row.requests);
    row.fired = invalid_key_answers == row.requests && delta("calls") == 0 && idem_rows == 0;
    proof << "invalid_key=" << invalid_key_answers << "/" << row.requests
          << " guard_calls=" << delta("calls") << " records=" << idem_rows;
  }
  if (delta("gateway_dedups") > 0) proof << " gateway_dedups=" << delta("gateway_dedups");
  if (delta("leases_lost") > 0) proof << " leases_lost=" << delta("leases_lost");
  row.proof = proof.str();
  row.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  return row;
}

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "idem_rel_driver: " << why
            << "\nusage: idem_rel_driver --service <path> [--smoke|--full] [--seed N] [--keys N]"
               " [--sends N] [--workers N] [--duration-ms N] [--scenarios a,b,...]"
               " [--modes transactional,two-phase] [--backend postgres|mysql] [--verbose]\n";
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::string scenarios;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value after " + a);
      return argv[++i];
    };
    if (a == "--service")
      s.service_bin = next();
    else if (a == "--seed")
      s.seed = std::stoull(next());
    else if (a == "--keys")
      s.keys = std::stoi(next());
    else if (a == "--sends")
      s.sends = std::stoi(next());
    else if (a == "--workers")
      s.workers = std::stoi(next());
    else if (a == "--duration-ms")
      s.duration_ms = std::stol(next());
    else if (a == "--scenarios")
      scenarios = next();
    else if (a == "--verbose")
      s.verbose = true;
    else if (a == "--backend") {
      s.backend = next();
      if (s.backend != "postgres" && s.backend != "mysql") usage("--backend postgres|mysql");
    } else if (a == "--modes") {
      s.modes.clear();
      std::stringstream in(next());
      std::string m;
      while (std::getline(in, m, ',')) {
        if (m != "transactional" && m != "two-phase") usage("unknown mode " + m);
        s.modes.push_back(m);
      }
    } else if (a == "--smoke") {
      s.keys = 40;
      s.sends = 3;
      s.workers = 6;
      s.duration_ms = 2500;
      s.two_phase_only = {"redis_kill", "crash_durable_claimed", "crash_handler_returned",
                          "slow_handler"};
    } else if (a == "--full") {
      s.keys = 400;
      s.sends = 4;
      s.workers = 8;
      s.duration_ms = 12000;
      s.two_phase_only.clear();
    } else
      usage("unknown flag " + a);
  }
  if (s.service_bin.empty()) usage("--service is required");
  s.redis_url = env_or("IDEM_TEST_REDIS_URL");
  s.pg_dsn = env_or("IDEM_TEST_POSTGRES_DSN");
  s.mysql_uri = env_or("IDEM_TEST_MYSQL_URI");
  s.servers_script = env_or("IDEM_SERVERS_SCRIPT");
  s.servers_dir = env_or("IDEM_SERVERS_DIR", "/tmp/idem-servers");
  s.redis_port = env_or("IDEM_REDIS_PORT", "16379");
  const bool mysql = s.backend == "mysql";
#ifndef IDEM_REL_WITH_MYSQL
  if (mysql) usage("--backend mysql needs a build with idem::mysql");
#endif
  if (s.redis_url.empty() || (mysql ? s.mysql_uri.empty() : s.pg_dsn.empty()) ||
      s.servers_script.empty()) {
    std::cerr << "idem_rel_driver: IDEM_TEST_REDIS_URL, "
              << (mysql ? "IDEM_TEST_MYSQL_URI" : "IDEM_TEST_POSTGRES_DSN")
              << " and IDEM_SERVERS_SCRIPT must be set (scripts/servers.sh prints them)\n";
    return env_or("IDEM_REQUIRE_SERVERS") == "1" ? 1 : 77;
  }
  // The database fault of the backend: pg_restart for PostgreSQL, mysql_kill for MySQL.
  std::vector<std::string> known = kAllScenarios;
  if (mysql) {
    std::replace(known.begin(), known.end(), std::string("pg_restart"), std::string("mysql_kill"));
  }
  if (scenarios.empty()) {
    s.scenarios = known;
  } else {
    std::stringstream in(scenarios);
    std::string n;
    while (std::getline(in, n, ',')) {
      if (std::find(known.begin(), known.end(), n) == known.end()) usage("unknown scenario " + n);
      s.scenarios.push_back(n);
    }
  }
  ::signal(SIGPIPE, SIG_IGN);

  Runner runner(s);
  try {
    runner.setup_schema();
  } catch (const std::exception& e) {
    std::cerr << "idem_rel_driver: cannot prepare the database: " << e.what() << "\n";
    return 1;
  }
  std::printf("%-24s %8s %6s %5s %5s %5s %5s %7s %5s %6s  %s\n", "scenario", "requests", "faults",
              "dup", "lost", "diverg", "stuck", "untyped", "fired", "secs", "proof");
  std::fflush(stdout);
  std::vector<Row> rows;
  std::vector<std::pair<std::string, std::string>> plan;
  for (auto& m : s.modes) {
    for (auto& n : s.scenarios) {
      // Keys are rejected before any mode applies; the control has no idem at all.
      if (m == "two-phase" && (n == "hostile_keys" || n == "control_unguarded")) continue;
      if (m == "two-phase" && !s.two_phase_only.empty() &&
          std::find(s.two_phase_only.begin(), s.two_phase_only.end(), n) ==
              s.two_phase_only.end()) {
        continue;
      }
      plan.emplace_back(m, n);
    }
  }
  for (auto& [mode, name] : plan) {
    Row r;
    runner.set_mode(mode);
    try {
      r = runner.run(name);
    } catch (const std::exception& e) {
      r.name = name;
      r.untyped = 1;
      r.proof = std::string("driver error: ") + e.what();
    }
    std::printf("%-24s %8ld %6ld %5ld %5ld %6ld %5ld %7ld %5s %6.1f  %s\n", r.name.c_str(),
                r.requests, r.faults, r.duplicates, r.lost, r.divergent, r.stuck, r.untyped,
                r.fired ? "yes" : "NO", r.seconds, r.proof.c_str());
    std::fflush(stdout);
    rows.push_back(r);
  }
  Row total;
  int unfired = 0;
  for (auto& r : rows) {
    total.requests += r.requests;
    if (!r.fired) ++unfired;
    if (r.control) continue;
    total.faults += r.faults;
    total.duplicates += r.duplicates;
    total.lost += r.lost;
    total.divergent += r.divergent;
    total.stuck += r.stuck;
    total.untyped += r.untyped;
  }
  bool ok = unfired == 0 && !total.duplicates && !total.lost && !total.divergent && !total.stuck &&
            !total.untyped;
  std::printf(
      "reliability: %s seed=%llu scenarios=%zu requests=%ld faults=%ld duplicate_effects=%ld "
      "lost_acks=%ld divergent_replays=%ld stuck_keys=%ld untyped_errors=%ld unfired=%d\n",
      ok ? "PASS" : "FAIL", static_cast<unsigned long long>(s.seed), rows.size(), total.requests,
      total.faults, total.duplicates, total.lost, total.divergent, total.stuck, total.untyped,
      unfired);
  return ok ? 0 : 1;
}
