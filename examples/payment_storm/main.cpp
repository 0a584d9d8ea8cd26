// SPDX-License-Identifier: MIT
// payment_storm: thousands of payments, each submitted 1-5 times (double clicks, client retries
// after a timeout, concurrent submits) from 8 threads, through IdempotencyGuard on the embedded
// default (MemoryStore in front of SQLite). The handler debits an account and inserts a payment
// row in the same transaction as the idempotency record. At the end the database itself is
// checked: one payment row per distinct payment, every account debited exactly once per payment,
// every duplicate answered with the first payment number.
//
//   payment_storm [--payments N] [--threads T] [--accounts A] [--db PATH] [--seed S]
#include <idem/idem.hpp>
#include <idem/sqlite/sqlite_store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

struct Config {
  int payments = 2000;
  int threads = 8;
  int accounts = 200;
  std::string db;
  unsigned seed = 20261129;
};

constexpr const char* kUsage =
    "usage: payment_storm [--payments N>=1] [--threads 1..256] [--accounts N>=1] [--db PATH] "
    "[--seed S]\n";

// A bad command line: why, then the usage, on stderr; exit status 2.
[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "payment_storm: %s\n%s", why, kUsage);
  std::exit(2);
}

int parse_int(const char* flag, const char* v, int lo, int hi) {
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || n < lo || n > hi) {
    std::string msg = std::string("bad value for ") + flag + ": '" + v + "'";
    usage(msg.c_str());
  }
  return static_cast<int>(n);
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    if (a == "--payments") c.payments = parse_int("--payments", value(), 1, 10'000'000);
    else if (a == "--threads") c.threads = parse_int("--threads", value(), 1, 256);
    else if (a == "--accounts") c.accounts = parse_int("--accounts", value(), 1, 1'000'000);
    else if (a == "--db") c.db = value();
    else if (a == "--seed") c.seed = static_cast<unsigned>(parse_int("--seed", value(), 0, 2147483647));
    else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else
      usage(("unknown argument " + a).c_str());
  }
  return c;
}

// One request as a client sends it. `delay_slot` orders the queue: copies of one payment with
// the same slot are sent at the same moment by different threads (concurrent submits, double
// clicks); later slots are retries after a client-side timeout.
struct Submission {
  int payment;
  int slot;
  const char* kind;
};

constexpr long long kInitialBalance = 1'000'000'000;

long long amount_of(int payment) { return 100 + (payment * 37) % 9900; }
int account_of(int payment, int accounts) { return payment % accounts; }
std::string order_no(int payment) { return "order_" + std::to_string(100000 + payment); }

}  // namespace

int main(int argc, char** argv) {
  Config cfg = parse(argc, argv);
  std::filesystem::path tmp;
  if (cfg.db.empty()) {
    tmp = std::filesystem::temp_directory_path() /
          ("idem-payment-storm-" + std::to_string(::getpid()));
    std::filesystem::create_directories(tmp);
    cfg.db = (tmp / "payments.sqlite").string();
  }

  // The embedded default: MemoryStore in front of SQLite, one database for records and business.
  auto database = std::make_shared<idem::sqlite::Database>(cfg.db);
  idem::sqlite::SqliteStore durable(database);
  idem::MemoryStore fast;
  idem::GuardOptions options;
  options.lease = std::chrono::seconds(10);
  idem::IdempotencyGuard guard{fast, durable, options};

  database->write([&](idem::sqlite::Transaction& tx) {
    tx.exec_script(
        "DROP TABLE IF EXISTS payment; DROP TABLE IF EXISTS account;"
        "CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);"
        "CREATE TABLE payment (payment_no TEXT PRIMARY KEY, order_no TEXT NOT NULL,"
        " account_id INTEGER NOT NULL, amount INTEGER NOT NULL);"
        "DELETE FROM api_idempotency;");
    for (int a = 0; a < cfg.accounts; ++a) {
      tx.exec("INSERT INTO account (id, balance) VALUES (?, ?)", a, kInitialBalance);
    }
  });

  // Plan the storm: each payment is submitted 1-5 times, in a mix of patterns.
  std::mt19937 rng(cfg.seed);
  std::vector<Submission> plan;
  int max_slot = 0;
  for (int p = 0; p < cfg.payments; ++p) {
    int base = static_cast<int>(rng() % 1000);
    int copies = 1 + static_cast<int>(rng() % 5);
    for (int c = 0; c < copies; ++c) {
      int pattern = static_cast<int>(rng() % 3);
      int slot = base;
      const char* kind = "first";
      if (c > 0 && pattern == 0) { slot = base; kind = "concurrent"; }
      else if (c > 0 && pattern == 1) { slot = base + 1; kind = "double_click"; }
      else if (c > 0) { slot = base + 50 + static_cast<int>(rng() % 400); kind = "retry"; }
      plan.push_back({p, slot, kind});
      max_slot = std::max(max_slot, slot);
    }
  }
  std::stable_sort(plan.begin(), plan.end(),
                   [](const Submission& a, const Submission& b) { return a.slot < b.slot; });

  std::vector<std::string> answers(static_cast<std::size_t>(cfg.payments));
  std::vector<std::mutex> answer_locks(64);
  std::atomic<long> divergent{0}, executed{0}, replayed{0}, in_progress_answers{0},
      client_retries{0}, errors{0};
  std::atomic<std::size_t> next{0};
  auto started = std::chrono::steady_clock::now();

  // Halfway through, the fast store loses every record (a Redis failover to an empty replica,
  // an eviction storm): from then on the relational unique key catches what it lets through.
  std::atomic<bool> flushed{false};
  auto worker = [&](unsigned thread_seed) {
    std::mt19937 trng(thread_seed);
    for (;;) {
      std::size_t i = next.fetch_add(1);
      if (i >= plan.size()) return;
      if (i >= plan.size() / 2 && !flushed.exchange(true)) fast.clear();
      const Submission& s = plan[i];
      auto key = idem::Key::make("payment", order_no(s.payment));
      std::string body = order_no(s.payment) + ":" + std::to_string(amount_of(s.payment));
      auto fp = idem::fingerprint(body);
      // A client keeps asking while the first attempt is in progress (HTTP 409 + Retry-After).
      for (int attempt = 0;; ++attempt) {
        try {
          auto r = guard.run(key, fp, [&](idem::sqlite::Transaction& tx) {
            int account = account_of(s.payment, cfg.accounts);
            tx.exec("UPDATE account SET balance = balance - ? WHERE id = ?",
                    amount_of(s.payment), account);
            std::string payment_no = "pay_" + std::to_string(s.payment) + "_" +
                                     std::to_string(trng() % 1000000);
            tx.exec("INSERT INTO payment (payment_no, order_no, account_id, amount) "
                    "VALUES (?, ?, ?, ?)",
                    payment_no, order_no(s.payment), account, amount_of(s.payment));
            if (trng() % 8 == 0) {
              // A slow gateway call now and then, so duplicates overlap a running payment.
              std::this_thread::sleep_for(std::chrono::microseconds(500 + trng() % 1500));
            }
            return payment_no;
          });
          if (r.outcome == idem::Outcome::kInProgress) {
            ++in_progress_answers;
            ++client_retries;
            std::this_thread::sleep_for(std::chrono::microseconds(200 + trng() % 800));
            continue;
          }
          if (!r.ok()) {
            ++errors;
            std::fprintf(stderr, "unexpected outcome %s for %s\n",
                         std::string(idem::outcome_name(r.outcome)).c_str(), key.str().c_str());
            break;
          }
          (r.outcome == idem::Outcome::kExecuted ? executed : replayed)++;
          std::lock_guard<std::mutex> lock(answer_locks[static_cast<std::size_t>(s.payment) % 64]);
          auto& a = answers[static_cast<std::size_t>(s.payment)];
          if (a.empty()) {
            a = *r.value;
          } else if (a != *r.value) {
            ++divergent;
          }
          break;
        } catch (const idem::Error& e) {
          if (!e.retryable() || attempt > 50) {
            ++errors;
            std::fprintf(stderr, "error for %s: %s\n", key.str().c_str(), e.what());
            break;
          }
          ++client_retries;
        }
      }
    }
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < cfg.threads; ++t) threads.emplace_back(worker, cfg.seed + 1000u * t);
  // Progress line once a second while the storm runs.
  std::thread progress([&] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      std::size_t done = std::min(next.load(), plan.size());
      if (done >= plan.size()) return;
      std::fprintf(stderr, "  ... %zu / %zu requests\n", done, plan.size());
    }
  });
  for (auto& t : threads) t.join();
  progress.join();
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

  // Ground truth from the database.
  long payment_rows = 0, distinct_orders = 0, wrong_balances = 0, double_charges = 0;
  database->read([&](idem::sqlite::Session& db) {
    payment_rows = static_cast<long>(db.query_int64("SELECT count(*) FROM payment").value_or(-1));
    distinct_orders = static_cast<long>(
        db.query_int64("SELECT count(DISTINCT order_no) FROM payment").value_or(-1));
    double_charges = static_cast<long>(
        db.query_int64("SELECT count(*) FROM (SELECT order_no FROM payment GROUP BY order_no "
                       "HAVING count(*) > 1)")
            .value_or(-1));
    std::map<int, long long> expected;
    for (int p = 0; p < cfg.payments; ++p) {
      expected[account_of(p, cfg.accounts)] += amount_of(p);
    }
    auto st = db.prepare("SELECT id, balance FROM account ORDER BY id");
    while (st.step()) {
      int id = static_cast<int>(st.column_int64(0));
      if (kInitialBalance - st.column_int64(1) != expected[id]) ++wrong_balances;
    }
  });
  // Every client answer must be the payment number that is in the database.
  long unmatched_answers = 0;
  database->read([&](idem::sqlite::Session& db) {
    for (int p = 0; p < cfg.payments; ++p) {
      auto stored = db.query_text("SELECT payment_no FROM payment WHERE order_no = ?",
                                  order_no(p));
      if (!stored || *stored != answers[static_cast<std::size_t>(p)]) ++unmatched_answers;
    }
  });

  auto stats = guard.stats().snapshot();
  // The figures add up: each request ends once (executed, replayed or an error); a request
  // answered "in progress" (or failing with a retryable error) is asked again by its client, so
  // the guard sees more calls than there are requests.
  const long requests = static_cast<long>(plan.size());
  const long ended = executed.load() + replayed.load() + errors.load();
  const long in_progress_repeats = in_progress_answers.load();
  const long error_repeats = client_retries.load() - in_progress_repeats;
  const long calls = static_cast<long>(stats.calls);
  std::printf("payment_storm: %d payments, %ld requests from %d threads in %.2f s (%.0f req/s)\n",
              cfg.payments, requests, cfg.threads, seconds,
              static_cast<double>(requests) / seconds);
  std::printf("  each request ended once:\n");
  std::printf("    executed        %6ld  the first request of each payment charged it\n",
              executed.load());
  std::printf("    replayed        %6ld  duplicates answered with the first payment number\n",
              replayed.load());
  std::printf("    errors          %6ld\n", errors.load());
  std::printf("    = requests      %6ld%s\n", ended, ended == requests ? "" : "  (MISMATCH)");
  std::printf(
      "  guard calls       %6ld  = %ld requests + %ld repeats after an \"in progress\" "
      "answer + %ld after a retryable error%s\n",
      calls, requests, in_progress_repeats, error_repeats,
      calls == requests + in_progress_repeats + error_repeats ? "" : "  (MISMATCH)");
  std::printf(
      "  duplicate calls   %6llu  (replayed and \"in progress\" answers) stopped by the fast "
      "store %llu (hit rate %.1f%%; it was flushed halfway), by the database's unique key "
      "%llu\n",
      static_cast<unsigned long long>(stats.fast_hits + stats.durable_conflicts),
      static_cast<unsigned long long>(stats.fast_hits), 100.0 * stats.fast_hit_rate(),
      static_cast<unsigned long long>(stats.durable_conflicts));
  std::printf("  payment rows      %6ld  (distinct payments %d)\n", payment_rows, cfg.payments);
  std::printf("  double charges    %6ld\n", double_charges);
  std::printf("  wrong balances    %6ld  of %d accounts\n", wrong_balances, cfg.accounts);
  std::printf("  divergent answers %6ld, answers not matching the database %ld\n", divergent.load(),
              unmatched_answers);

  bool ok = payment_rows == cfg.payments && distinct_orders == cfg.payments &&
            double_charges == 0 && wrong_balances == 0 && divergent == 0 &&
            unmatched_answers == 0 && errors == 0 && executed == cfg.payments &&
            ended == requests && calls == requests + in_progress_repeats + error_repeats &&
            stats.durable_conflicts > 0;  // the flush must have been felt, or it proved nothing
  std::printf("%s\n", ok ? "OK: every payment charged exactly once"
                         : "VIOLATION: see the figures above");
  if (!tmp.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);
  }
  return ok ? 0 : 1;
}
