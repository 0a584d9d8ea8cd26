// SPDX-License-Identifier: MIT
// The coupon-claim run: users clicking "claim" on a few coupons many times, concurrently, with
// client timeouts and retries, some attempts failing before their commit and some answers
// lost after it; then the table is read back and every answer is checked against it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <mutex>
#include <ostream>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../common/server_pool.hpp"
#include "backends.hpp"
#include "coupon.hpp"
#include "idem/clock.hpp"
#include "idem/errors.hpp"

namespace coupon_claim {

/// Sizes and behaviour of one run.
struct Config {
  int users = 400;
  /// Coupons on offer ("C-0" ...); each user claims a uniform 1..coupons of them.
  int coupons = 3;
  /// Clicks per (user, coupon): a uniform 1..max_clicks, sent within a fraction of a ms.
  int max_clicks = 4;
  /// Client threads (each drives one user at a time).
  int threads = 8;
  /// Server threads running the claims.
  int server_threads = 16;
  /// The client stops waiting after this long and sends again (the first attempt runs on);
  /// each further timeout of the same click doubles it (up to 16x), as clients back off.
  std::chrono::milliseconds client_timeout{25};
  /// Percent of attempts delayed on the network before they reach the server (a retry may
  /// overtake them).
  int slow_percent = 5;
  std::chrono::milliseconds slow_delay{30};
  /// Percent of attempts whose transaction is slow (it holds the unique key, and on SQLite the
  /// write lock, for slow_tx_delay).
  int slow_tx_percent = 1;
  std::chrono::milliseconds slow_tx_delay{10};
  /// Percent of attempts that fail after their insert, before commit (rolled back).
  int fail_percent = 5;
  /// Percent of attempts whose answer is lost after the commit (the client retries).
  int lost_percent = 5;
  std::uint64_t seed = 0;
};

/// What one (user, coupon) pair's clicks were answered.
struct PairAnswers {
  int clicks = 0;
  std::vector<std::string> finals;  ///< "claimed:<id>" (or anything else: a defect)
  bool gave_up = false;
};

struct Check {
  std::string name;
  bool ok = false;
  std::string detail;
};

/// The outcome of a run.
struct Report {
  Config config;
  std::string backend, where;
  std::map<std::pair<std::int64_t, std::string>, PairAnswers> pairs;
  Rows rows;
  std::uint64_t clicks = 0, attempts = 0, timeouts = 0, failed = 0, lost = 0;
  idem::UniqueInsertStats unique;
  std::chrono::milliseconds elapsed{0};
  std::vector<Check> checks;
  std::vector<std::string> samples;

  bool ok() const {
    return std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.ok; });
  }
};

namespace detail {
struct Reply {
  enum class Kind { kFinal, kRetry, kError } kind = Kind::kFinal;
  std::string text;
};
struct SimulatedFailure : std::runtime_error {
  SimulatedFailure() : std::runtime_error("simulated failure before commit") {}
};
}  // namespace detail

/// Runs the clicks against `backend` and checks its table.
template <class Backend>
Report run_claims(Backend& backend, const Config& cfg, const std::string& where) {
  using Tx = typename Backend::Tx;
  Report rep;
  rep.config = cfg;
  rep.backend = backend.name();
  rep.where = where;
  backend.reset();
  CouponDesk desk{backend.table()};
  std::mutex mu;
  std::atomic<int> next_user{0};
  std::atomic<std::uint64_t> clicks{0}, attempts{0}, timeouts{0}, failed{0}, lost{0};

  struct Fate {
    bool slow = false, slow_tx = false, fail = false, lose = false;
  };
  auto serve = [&](std::int64_t user, std::string coupon, std::string request_id,
                   Fate fate) -> detail::Reply {
    const bool fail = fate.fail, lose = fate.lose;
    if (fate.slow) std::this_thread::sleep_for(cfg.slow_delay);
    try {
      std::string answer = backend.write([&](Tx& tx) {
        std::string a =
            desk.claim(tx, user, coupon, request_id, idem::to_millis(idem::system_now()));
        if (fate.slow_tx) std::this_thread::sleep_for(cfg.slow_tx_delay);
        if (fail) throw detail::SimulatedFailure();
        return a;
      });
      if (lose) {
        lost.fetch_add(1);
        return {detail::Reply::Kind::kRetry, "lost"};  // committed; the answer never arrives
      }
      return {detail::Reply::Kind::kFinal, answer};
    } catch (const detail::SimulatedFailure&) {
      failed.fetch_add(1);
      return {detail::Reply::Kind::kRetry, "failed"};
    } catch (const idem::Error& e) {
      if (e.retryable()) return {detail::Reply::Kind::kRetry, e.what()};
      return {detail::Reply::Kind::kError, e.what()};
    } catch (const std::exception& e) {
      return {detail::Reply::Kind::kError, e.what()};
    }
  };

  const std::uint64_t seed = cfg.seed;
  auto start = std::chrono::steady_clock::now();
  {
    examples::ServerPool<detail::Reply> server(cfg.server_threads);
    auto client = [&](int t) {
      std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(t));
      auto pct = [&](int p) { return static_cast<int>(rng() % 100) < p; };
      for (;;) {
        const int u = next_user.fetch_add(1);
        if (u >= cfg.users) return;
        struct Click {
          std::string coupon, request_id;
          std::future<detail::Reply> reply;
          std::chrono::steady_clock::time_point sent, retry_at;
          int attempts = 0, timeouts = 0;
          bool waiting = false, done = false;
          PairAnswers* answers = nullptr;
        };
        std::vector<Click> cs;
        std::map<std::string, PairAnswers> mine;
        const int n_coupons = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(cfg.coupons));
        for (int c = 0; c < n_coupons; ++c) {
          std::string coupon = "C-" + std::to_string(c);
          const int n = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(cfg.max_clicks));
          for (int k = 0; k < n; ++k) {
            Click click;
            click.coupon = coupon;
            click.request_id = "u" + std::to_string(u) + "-" + coupon + "-" + std::to_string(k);
            cs.push_back(std::move(click));
          }
        }
        for (auto& c : cs) {
          c.answers = &mine[c.coupon];
          ++c.answers->clicks;
        }
        clicks.fetch_add(cs.size());
        auto send = [&](Click& c) {
          attempts.fetch_add(1);
          ++c.attempts;
          Fate fate{pct(cfg.slow_percent), pct(cfg.slow_tx_percent), pct(cfg.fail_percent),
                    pct(cfg.lost_percent)};
          c.reply = server.submit([&serve, u, coupon = c.coupon, id = c.request_id, fate] {
            return serve(u, coupon, id, fate);
          });
          c.sent = std::chrono::steady_clock::now();
          c.waiting = true;
        };
        for (auto& c : cs) {
          send(c);
          std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
        }
        for (bool all_done = false; !all_done;) {
          all_done = true;
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
              if (r.kind == detail::Reply::Kind::kRetry) {
                c.retry_at = now + std::chrono::milliseconds(2);
              } else {
                c.answers->finals.push_back(r.kind == detail::Reply::Kind::kFinal ? r.text
                                                                                  : "!" + r.text);
                c.done = true;
              }
            } else if (now - c.sent > cfg.client_timeout * (1 << std::min(c.timeouts, 4))) {
              timeouts.fetch_add(1);
              ++c.timeouts;
              send(c);  // the first attempt keeps running on the server
            }
            if (!c.done && c.attempts > 500) {
              c.answers->gave_up = true;
              c.done = true;
            }
          }
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        std::lock_guard<std::mutex> lock(mu);
        for (auto& [coupon, a] : mine) rep.pairs[{u, coupon}] = std::move(a);
      }
    };
    std::vector<std::thread> clients;
    for (int t = 0; t < cfg.threads; ++t) clients.emplace_back(client, t);
    for (auto& t : clients) t.join();
  }  // ~ServerPool: abandoned attempts finish before the checks
  rep.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  rep.clicks = clicks.load();
  rep.attempts = attempts.load();
  rep.timeouts = timeouts.load();
  rep.failed = failed.load();
  rep.lost = lost.load();
  rep.unique = desk.stats();
  rep.rows = backend.rows();

  // Checks, from the table.
  auto add = [&](std::string name, bool ok, std::string detail) {
    rep.checks.push_back(Check{std::move(name), ok, std::move(detail)});
  };
  auto sample = [&](std::string s) {
    if (rep.samples.size() < 6) rep.samples.push_back(std::move(s));
  };
  int not_one = 0, stray = 0, wrong = 0, unanswered = 0;
  for (const auto& [pair, a] : rep.pairs) {
    auto it = rep.rows.find(pair);
    std::size_t n = it == rep.rows.end() ? 0 : it->second.size();
    if (n != 1) {
      ++not_one;
      sample("user " + std::to_string(pair.first) + " " + pair.second + " has " +
             std::to_string(n) + " rows");
      continue;
    }
    const std::string expected = "claimed:" + std::to_string(it->second.front());
    for (const auto& f : a.finals) {
      if (f != expected) {
        ++wrong;
        sample("user " + std::to_string(pair.first) + " " + pair.second + " answered " + f +
               ", table says " + expected);
      }
    }
    if (a.gave_up || static_cast<int>(a.finals.size()) != a.clicks) ++unanswered;
  }
  for (const auto& [pair, ids] : rep.rows) {
    if (rep.pairs.count(pair) == 0) ++stray;
  }
  add("exactly one row per (user, coupon) claimed", not_one == 0,
      std::to_string(rep.pairs.size()) + " pairs clicked, " + std::to_string(rep.rows.size()) +
          " rows, " + std::to_string(not_one) + " pairs without exactly one");
  add("no row nobody claimed", stray == 0, std::to_string(stray) + " stray rows");
  add("every click answered \"claimed\" with its row's id (no \"already claimed\" error)",
      wrong == 0, std::to_string(wrong) + " other answers");
  add("every click got an answer", unanswered == 0,
      std::to_string(unanswered) + " pairs with unanswered clicks");
  return rep;
}

/// Prints the summary, the checks and PASS/FAIL.
inline void print_report(const Report& r, std::ostream& out) {
  const auto& c = r.config;
  out << "coupon claims: " << c.users << " users, up to " << c.coupons << " coupons each, 1-"
      << c.max_clicks << " clicks per coupon, " << c.threads << " client threads, backend "
      << r.backend << " (" << r.where << ")\n";
  out << "  traffic: " << r.clicks << " clicks, " << r.attempts << " attempts in "
      << r.elapsed.count() << " ms; " << r.timeouts << " client timeouts retried, " << r.failed
      << " attempts failed before commit (rolled back), " << r.lost
      << " answers lost after commit\n";
  out << "  unique key: " << r.unique.inserted << " inserts (some rolled back), "
      << r.unique.already_exists
      << " clicks answered from the existing row (user_coupon unique (user_id, coupon_id))\n";
  for (const auto& ch : r.checks) {
    out << "  check " << (ch.ok ? "ok  " : "FAIL") << "  " << ch.name << " (" << ch.detail << ")\n";
  }
  for (const auto& s : r.samples) out << "    e.g. " << s << "\n";
  out << (r.ok() ? "PASS" : "FAIL") << "\n";
}

}  // namespace coupon_claim
