// SPDX-License-Identifier: MIT
// The flash-sale simulation: many users, few units, double clicks, client timeouts and retries;
// at the end the database itself is checked. Generic over the backend (the durable store, its
// transaction type and the verification queries), so PostgreSQL + Redis is one more backend.
//
// The order handler, run by IdempotencyGuard in transactional mode (one transaction holds the
// idempotency record, the order row and the stock deduction):
//
//   1. UniqueInsert into flash_order unique (user_id, sku). Already there (the same user came
//      back with a new request id, e.g. a reloaded page): answer that order's number. No second
//      order, no second deduction, no "order already exists" error.
//   2. StockTable::deduct(sku, 1). Not enough: delete the row just inserted and answer
//      "sold_out" (a response: stored and replayed, never thrown).
//   3. Answer "order:<id>".
//
// A repeat of the same key (double click, client retry after a timeout, a retry that overtakes
// a slow first attempt) never reaches the handler: the fast store answers "in progress" or
// replays, and the durable record backs it up.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"
#include "idem/stock.hpp"
#include "idem/unique_insert.hpp"
#include "../common/server_pool.hpp"

namespace flash_sale {

/// Sizes and behaviour of one simulated sale.
struct Config {
  /// Simulated users, each clicking "buy" 1..max_clicks times.
  int users = 2000;
  /// Units on sale.
  std::int64_t stock = 100;
  /// Client threads (each drives one user at a time, its clicks concurrently).
  int threads = 8;
  /// Server workers running the guarded handler (0 means 2 * threads).
  int server_threads = 0;
  /// Most clicks per user (each user clicks a uniform 1..max_clicks times).
  int max_clicks = 3;
  /// The embedded database file (recreated tables; the idempotency records of the scope are
  /// cleared first).
  std::string db = "flash_sale.sqlite";
  /// The client gives up waiting after this long and retries with the same key, while the first
  /// attempt may still be running. Each further timeout of the same click doubles its wait (at
  /// most 1 s), as clients back off: on a slow machine, retries at a fixed pace would pile
  /// abandoned attempts onto the server faster than it finishes them.
  std::chrono::milliseconds client_timeout{25};
  /// A click with no final answer this long after its first attempt is given up (the
  /// "every click got a final answer" check fails). A bound in time, not in attempts: the
  /// attempts a click makes while its first one runs depend on the machine's load.
  std::chrono::seconds give_up_after{60};
  /// Percent of attempts delayed before they reach the guard (a slow network path): a retry
  /// may overtake them.
  int slow_network_percent = 5;
  /// Percent of attempts whose handler is slow (it holds the key, and the SQLite write lock).
  int slow_handler_percent = 1;
  /// Delay of a slow attempt.
  std::chrono::milliseconds slow_delay{40};
  /// Percent of clicks after the first that come from a reloaded page (a new request id, so a
  /// new idempotency key for the same user): the business unique key answers those.
  int reload_percent = 10;
  /// Random seed (0 means random).
  std::uint64_t seed = 0;
  /// The item's sku.
  std::string sku = "FLASH-1";
  /// When this user starts, the fast store loses every record (a simulated failover to an empty
  /// replica, mid-sale; the durable record then catches the duplicates it forgot). -1 means
  /// never; the default (-2) means when half the units should be sold: user min(users,stock)/2.
  int fast_loss_at_user = -2;
};

/// What the database says at the end.
struct DbState {
  /// user_id -> order ids of that user for the sku (one each, if all is well).
  std::map<std::int64_t, std::vector<std::int64_t>> orders;
  std::int64_t order_rows = 0;
  std::optional<std::int64_t> stock_left;
  /// Idempotency records of the sale's scope, completed and still in progress.
  std::int64_t records_completed = 0;
  std::int64_t records_in_progress = 0;
};

/// What one simulated user saw.
struct UserAnswers {
  std::vector<std::string> finals;  ///< every final answer any click of the user received
  std::vector<std::string> errors;  ///< non-retryable errors the user saw
  bool gave_up = false;             ///< a click got no final answer in give_up_after
};

/// One check of the end state.
struct Check {
  std::string name;
  bool ok = false;
  std::string detail;
};

/// The outcome of a sale.
struct Report {
  Config config;
  std::string backend;
  std::int64_t expected_orders = 0;
  DbState db;
  /// Per user (index = user id): what their clicks were answered.
  std::vector<UserAnswers> users;
  std::int64_t users_ordered = 0, users_sold_out = 0;
  std::uint64_t clicks = 0, attempts = 0, timeouts = 0, in_progress_replies = 0,
                retryable_errors = 0, overtaken = 0;
  std::uint64_t unique_key_duplicates = 0;
  /// The user index at which the fast store lost its records (-1: it did not).
  int fast_lost_at_user = -1;
  idem::GuardStatsSnapshot guard;
  std::chrono::milliseconds elapsed{0};
  std::vector<Check> checks;
  std::vector<std::string> samples;  ///< a few offending users, for the log

  /// True when every check passed.
  bool ok() const {
    return std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.ok; });
  }
};

/// Scope of the sale's idempotency keys.
inline constexpr const char* kScope = "flash.order";
/// The answer of a sold-out order.
inline constexpr const char* kSoldOut = "sold_out";

/// The order handler's business tables, shared by every backend.
struct Tables {
  idem::UniqueInsert orders{"flash_order", {"user_id", "sku"}, {"request_id"}};
  idem::StockTable stock{"flash_stock", "sku", "qty"};
};

/// Steps 1-3 of the file comment, in the caller's transaction.
/// `remove_order(tx, id)` deletes the order row just inserted (the backend's SQL).
template <class Tx, class RemoveOrder>
std::string place_order(Tx& tx, const Tables& t, std::int64_t user_id, const std::string& sku,
                        const std::string& request_id, RemoveOrder&& remove_order) {
  auto order = t.orders.insert(tx, user_id, sku, request_id);
  if (!order.inserted()) return "order:" + std::to_string(order.id);
  auto d = t.stock.deduct(tx, sku, 1);
  if (!d.ok()) {
    remove_order(tx, order.id);
    return kSoldOut;
  }
  return "order:" + std::to_string(order.id);
}

namespace detail {

/// A reply as the simulated client sees it.
struct Reply {
  enum class Kind { kFinal, kInProgress, kRetryableError, kError } kind = Kind::kFinal;
  std::string text;  ///< final: the response; errors: errc name and message
};

/// The server workers running the guarded handler.
using ServerPool = examples::ServerPool<Reply>;

}  // namespace detail

/// Fills `rep.checks` (and `users_ordered`, `users_sold_out`, `samples`) from `rep.db`, read
/// from the database, and `rep.users`, what the users were told.
inline void evaluate(Report& rep) {
  const Config& cfg = rep.config;
  rep.checks.clear();
  rep.samples.clear();
  rep.users_ordered = rep.users_sold_out = 0;
  rep.expected_orders = std::min<std::int64_t>(cfg.users, cfg.stock);
  auto add = [&](std::string name, bool ok, std::string detail) {
    rep.checks.push_back(Check{std::move(name), ok, std::move(detail)});
  };
  add("exactly " + std::to_string(rep.expected_orders) + " orders",
      rep.db.order_rows == rep.expected_orders,
      std::to_string(rep.db.order_rows) + " rows in flash_order");
  std::int64_t expected_left = cfg.stock - rep.expected_orders;
  add("stock exactly " + std::to_string(expected_left),
      rep.db.stock_left && *rep.db.stock_left == expected_left,
      rep.db.stock_left ? "qty " + std::to_string(*rep.db.stock_left) : "no stock row");

  std::int64_t double_orders = 0;
  for (const auto& [user, ids] : rep.db.orders) {
    if (ids.size() > 1) {
      ++double_orders;
      if (rep.samples.size() < 5) {
        rep.samples.push_back("user " + std::to_string(user) + " has " +
                              std::to_string(ids.size()) + " orders");
      }
    }
  }
  add("no user with two orders", double_orders == 0,
      std::to_string(double_orders) + " users with more than one");

  std::int64_t inconsistent = 0, with_errors = 0, gave_up = 0;
  for (std::size_t u = 0; u < rep.users.size(); ++u) {
    const auto& log = rep.users[static_cast<std::size_t>(u)];
    if (log.gave_up) ++gave_up;
    if (!log.errors.empty()) {
      ++with_errors;
      if (rep.samples.size() < 5) {
        rep.samples.push_back("user " + std::to_string(u) + " saw error: " + log.errors[0]);
      }
    }
    auto it = rep.db.orders.find(static_cast<std::int64_t>(u));
    std::string expected =
        it == rep.db.orders.end() || it->second.empty()
            ? std::string(kSoldOut)
            : "order:" + std::to_string(it->second.front());
    bool same = true;
    for (const auto& f : log.finals) same = same && f == expected;
    if (!same) {
      ++inconsistent;
      if (rep.samples.size() < 5) {
        std::string seen;
        for (const auto& f : log.finals) seen += (seen.empty() ? "" : ", ") + f;
        rep.samples.push_back("user " + std::to_string(u) + " got [" + seen +
                              "], database says " + expected);
      }
    }
    if (!log.finals.empty() && log.finals.front() == kSoldOut) {
      ++rep.users_sold_out;
    } else if (!log.finals.empty()) {
      ++rep.users_ordered;
    }
  }
  add("every user's clicks got the same answer (their order or sold out)", inconsistent == 0,
      std::to_string(inconsistent) + " users with differing or wrong answers");
  add("no user saw an error (no \"order already exists\")", with_errors == 0,
      std::to_string(with_errors) + " users saw a non-retryable error");
  add("every click got a final answer", gave_up == 0,
      std::to_string(gave_up) + " users gave up without a final answer");
  add("no idempotency record left in progress", rep.db.records_in_progress == 0,
      std::to_string(rep.db.records_in_progress) + " in progress, " +
          std::to_string(rep.db.records_completed) + " completed");
}

/// Runs a sale on `backend` behind `fast` and checks the database. `lose_fast_store` (may be
/// empty) empties the fast store; it is called once, when user Config::fast_loss_at_user
/// starts. The backend provides:
///   using Durable;  Durable& durable();  std::string name();
///   void reset(const Config&);            // tables created/emptied, stock seeded, scope cleared
///   DbState read_state(const Config&);    // from the database itself
///   void remove_order(Durable::Transaction&, std::int64_t id);
/// The server workers a sale runs (Config::server_threads, or twice the client threads).
inline int server_workers(const Config& cfg) {
  return cfg.server_threads > 0 ? cfg.server_threads : 2 * cfg.threads;
}

template <class Backend>
Report run_sale(Backend& backend, idem::FastStore& fast, const Config& cfg,
                const std::function<void()>& lose_fast_store = {}) {
  using Tx = typename Backend::Durable::Transaction;
  Report rep;
  rep.config = cfg;
  rep.backend = backend.name();
  backend.reset(cfg);

  Tables tables;
  idem::GuardOptions opts;
  // Longer than the slowest handler (40 ms here), and no longer than a key may answer "in
  // progress" after an attempt died or a store failed between its claim and its completion.
  // The handler's transaction holds the durable record, so a retry that outlives a slow
  // attempt's fast claim still waits on the unique key: it never runs twice.
  opts.lease = std::chrono::seconds(5);
  idem::IdempotencyGuard<typename Backend::Durable> guard{fast, backend.durable(), opts};

  const std::uint64_t seed = cfg.seed != 0 ? cfg.seed : std::random_device{}();
  std::vector<UserAnswers> logs(static_cast<std::size_t>(cfg.users));
  std::atomic<int> next_user{0};
  int loss_at = cfg.fast_loss_at_user;
  if (loss_at == -2) loss_at = static_cast<int>(std::min<std::int64_t>(cfg.users, cfg.stock) / 2);
  if (!lose_fast_store) loss_at = -1;
  std::atomic<std::uint64_t> clicks{0}, attempts{0}, timeouts{0}, in_progress{0},
      retryable{0}, overtaken{0};

  // One attempt as the server runs it. `slow_net` delays it before the guard, `slow_handler`
  // inside the handler (holding the key).
  auto serve = [&](idem::Key key, std::int64_t user, bool slow_net,
                   bool slow_handler) -> detail::Reply {
    if (slow_net) std::this_thread::sleep_for(cfg.slow_delay);
    try {
      std::string payload = std::to_string(user) + "/" + cfg.sku;
      auto r = guard.run(key, idem::fingerprint(payload), [&](Tx& tx) {
        if (slow_handler) std::this_thread::sleep_for(cfg.slow_delay);
        return place_order(tx, tables, user, cfg.sku, key.id(),
                           [&](Tx& t, std::int64_t id) { backend.remove_order(t, id); });
      });
      if (r.ok()) {
        if (slow_net && r.outcome == idem::Outcome::kReplayed) overtaken.fetch_add(1);
        return {detail::Reply::Kind::kFinal, *r.value};
      }
      if (r.outcome == idem::Outcome::kInProgress) return {detail::Reply::Kind::kInProgress, ""};
      return {detail::Reply::Kind::kError, std::string(idem::outcome_name(r.outcome))};
    } catch (const idem::Error& e) {
      auto kind = e.retryable() ? detail::Reply::Kind::kRetryableError
                                : detail::Reply::Kind::kError;
      return {kind, std::string(idem::errc_name(e.code())) + ": " + e.what()};
    } catch (const std::exception& e) {
      return {detail::Reply::Kind::kError, e.what()};
    }
  };

  auto start = std::chrono::steady_clock::now();
  {
    detail::ServerPool server(server_workers(cfg));

    auto client = [&](int thread_index) {
      std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(thread_index));
      auto pct = [&](int p) { return static_cast<int>(rng() % 100) < p; };
      for (;;) {
        int u = next_user.fetch_add(1);
        if (u >= cfg.users) return;
        if (u == loss_at) {
          lose_fast_store();
          rep.fast_lost_at_user = u;
        }
        auto& log = logs[static_cast<std::size_t>(u)];
        int n_clicks = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(
                                                std::max(1, cfg.max_clicks)));
        clicks.fetch_add(static_cast<std::uint64_t>(n_clicks));
        struct Click {
          idem::Key key;
          std::future<detail::Reply> reply;
          std::chrono::steady_clock::time_point sent;
          std::chrono::steady_clock::time_point retry_at;
          std::chrono::steady_clock::time_point first_sent;
          int attempts = 0;
          bool waiting = false;  // a reply is awaited (else: retry at retry_at)
          bool done = false;
          std::chrono::milliseconds timeout{0};  // doubles with each timeout (at most 1 s)
          std::chrono::milliseconds poll{2};     // after "in progress": doubles, at most 50 ms
        };
        std::vector<Click> cs;
        int page = 1;
        auto send = [&](Click& c) {
          attempts.fetch_add(1);
          ++c.attempts;
          bool slow_net = pct(cfg.slow_network_percent);
          bool slow_handler = pct(cfg.slow_handler_percent);
          c.reply = server.submit([&serve, key = c.key, u, slow_net, slow_handler] {
            return serve(key, u, slow_net, slow_handler);
          });
          c.sent = std::chrono::steady_clock::now();
          c.waiting = true;
        };
        for (int i = 0; i < n_clicks; ++i) {
          if (i > 0 && pct(cfg.reload_percent)) ++page;  // a reloaded page: a new request id
          std::string id = "sale-" + cfg.sku + "-user-" + std::to_string(u) + "-page-" +
                           std::to_string(page) + "-" + std::to_string(seed % 1000000);
          cs.push_back(Click{idem::Key::make(kScope, id), {}, {}, {},
                             std::chrono::steady_clock::now(), 0, false, false,
                             cfg.client_timeout, std::chrono::milliseconds(2)});
          send(cs.back());
          // Double clicks come within a fraction of a millisecond of each other.
          std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
        }
        for (;;) {
          bool all_done = true;
          auto now = std::chrono::steady_clock::now();
          for (auto& c : cs) {
            if (c.done) continue;
            all_done = false;
            if (!c.waiting) {
              if (now >= c.retry_at) send(c);
              continue;
            }
            if (c.reply.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
              detail::Reply r = c.reply.get();
              c.waiting = false;
              switch (r.kind) {
                case detail::Reply::Kind::kFinal:
                  log.finals.push_back(r.text);
                  c.done = true;
                  break;
                case detail::Reply::Kind::kInProgress:
                  in_progress.fetch_add(1);
                  c.retry_at = now + c.poll;
                  c.poll = std::min(c.poll * 2, std::chrono::milliseconds(50));
                  break;
                case detail::Reply::Kind::kRetryableError:
                  retryable.fetch_add(1);
                  c.retry_at = now + std::chrono::milliseconds(5);
                  break;
                case detail::Reply::Kind::kError:
                  log.errors.push_back(r.text);
                  c.done = true;
                  break;
              }
            } else if (now - c.sent > c.timeout) {
              // The client gives up waiting; the attempt keeps running on the server. Retry
              // with the same key at once, and wait longer for this one.
              timeouts.fetch_add(1);
              c.timeout = std::min(c.timeout * 2, std::chrono::milliseconds(1000));
              send(c);
            }
            if (!c.done && now - c.first_sent > cfg.give_up_after) {
              log.gave_up = true;
              c.done = true;
            }
          }
          if (all_done) break;
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
    };

    std::vector<std::thread> clients;
    for (int t = 0; t < cfg.threads; ++t) clients.emplace_back(client, t);
    for (auto& t : clients) t.join();
    // ~ServerPool: abandoned attempts still queued or running finish before the checks.
  }
  rep.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);

  rep.clicks = clicks.load();
  rep.attempts = attempts.load();
  rep.timeouts = timeouts.load();
  rep.in_progress_replies = in_progress.load();
  rep.retryable_errors = retryable.load();
  rep.overtaken = overtaken.load();
  rep.unique_key_duplicates = tables.orders.stats().already_exists;
  rep.guard = guard.stats().snapshot();
  rep.db = backend.read_state(cfg);

  rep.users = std::move(logs);
  evaluate(rep);
  return rep;
}

/// Prints the summary (and the failed checks) to `out`.
inline void print_report(const Report& r, std::ostream& out) {
  const auto& c = r.config;
  auto pct = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f%%", v * 100.0);
    return std::string(buf);
  };
  out << "flash sale: " << c.stock << " x " << c.sku << ", " << c.users << " users clicking 1-"
      << c.max_clicks << " times, " << c.threads << " client threads, backend " << r.backend
      << " (" << c.db << ")\n";
  out << "  traffic: " << r.clicks << " clicks, " << r.attempts << " attempts in "
      << r.elapsed.count() << " ms; " << r.timeouts << " client timeouts retried, "
      << r.in_progress_replies << " \"in progress\" replies, " << r.overtaken
      << " slow attempts overtaken by their retry, " << r.retryable_errors
      << " retryable errors\n";
  out << "  result: " << r.users_ordered << " users got an order, " << r.users_sold_out
      << " were told sold out; database: " << r.db.order_rows << " orders, stock left "
      << (r.db.stock_left ? std::to_string(*r.db.stock_left) : std::string("?")) << "\n";
  out << "  guard: " << r.guard.calls << " calls, " << r.guard.executed << " executed, "
      << r.guard.replayed << " replayed, " << r.guard.in_progress << " in progress; "
      << "fast-store hit rate " << pct(r.guard.fast_hit_rate()) << " (" << r.guard.fast_hits
      << " duplicates stopped by the fast store, " << r.guard.durable_conflicts
      << " by the durable record)\n";
  if (r.fast_lost_at_user >= 0) {
    out << "  fast store: lost every record when user " << r.fast_lost_at_user
        << " started (simulated failover to an empty replica)\n";
  }
  out << "  unique key: " << r.unique_key_duplicates
      << " orders answered from flash_order unique (user_id, sku) (a new request id for a "
         "user who already had one)\n";
  for (const auto& ch : r.checks) {
    out << "  check " << (ch.ok ? "ok  " : "FAIL") << "  " << ch.name << " (" << ch.detail
        << ")\n";
  }
  for (const auto& s : r.samples) out << "    e.g. " << s << "\n";
  out << (r.ok() ? "PASS" : "FAIL") << "\n";
}

}  // namespace flash_sale
