// SPDX-License-Identifier: MIT
// examples/coupon_claim: users claiming coupons with many clicks, client timeouts and retries,
// attempts failing before their commit and answers lost after it; one row per (user, coupon),
// and every click answered "claimed" with that row's id. Checked from the table afterwards.
//
//   idem_coupon_claim [--users N] [--coupons N] [--max-clicks N] [--threads N]
//                     [--server-threads N] [--timeout-ms N] [--slow-percent N]
//                     [--slow-tx-percent N] [--fail-percent N] [--lost-percent N] [--seed N]
//                     [--db PATH | --postgres DSN | --mysql URI] [--table NAME]
//
// --mysql takes mysql://user:password@host:port/database (the database must exist).
//
// Exit status: 0 when every check passed, 1 on any violation, 2 on bad flags, 3 on an error.
#include <cstdlib>
#include <exception>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>

#include "simulation.hpp"

namespace {

void usage(std::ostream& out) {
  out << "usage: idem_coupon_claim [--users N] [--coupons N] [--max-clicks N] [--threads N]\n"
         "       [--server-threads N] [--timeout-ms N] [--slow-percent N] [--slow-tx-percent N]\n"
         "       [--fail-percent N] [--lost-percent N] [--seed N]\n"
         "       [--db PATH | --postgres DSN | --mysql URI] [--table NAME]\n"
         "defaults: 400 users, 1-3 coupons each, 1-4 clicks per coupon, 8 client threads,\n"
         "16 server threads, 25 ms client timeout (doubling per retry), 5% failures before commit, "
         "5% lost answers,\n"
         "db coupon_claim.sqlite\n";
}

long long number(const std::string& flag, const char* text, long long min, long long max) {
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v < min || v > max) {
    throw std::invalid_argument(flag + " needs an integer in " + std::to_string(min) + ".." +
                                std::to_string(max) + ", got '" + text + "'");
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  coupon_claim::Config cfg;
  std::string db = "coupon_claim.sqlite", dsn, mysql_uri, table = "user_coupon";
  try {
    for (int i = 1; i < argc; ++i) {
      std::string flag = argv[i];
      if (flag == "--help" || flag == "-h") {
        usage(std::cout);
        return 0;
      }
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      const char* v = argv[++i];
      if (flag == "--users")
        cfg.users = static_cast<int>(number(flag, v, 1, 1000000));
      else if (flag == "--coupons")
        cfg.coupons = static_cast<int>(number(flag, v, 1, 1000));
      else if (flag == "--max-clicks")
        cfg.max_clicks = static_cast<int>(number(flag, v, 1, 100));
      else if (flag == "--threads")
        cfg.threads = static_cast<int>(number(flag, v, 1, 256));
      else if (flag == "--server-threads")
        cfg.server_threads = static_cast<int>(number(flag, v, 1, 256));
      else if (flag == "--timeout-ms")
        cfg.client_timeout = std::chrono::milliseconds(number(flag, v, 1, 60000));
      else if (flag == "--slow-percent")
        cfg.slow_percent = static_cast<int>(number(flag, v, 0, 100));
      else if (flag == "--slow-tx-percent")
        cfg.slow_tx_percent = static_cast<int>(number(flag, v, 0, 100));
      else if (flag == "--fail-percent")
        cfg.fail_percent = static_cast<int>(number(flag, v, 0, 90));
      else if (flag == "--lost-percent")
        cfg.lost_percent = static_cast<int>(number(flag, v, 0, 90));
      else if (flag == "--seed")
        cfg.seed = static_cast<std::uint64_t>(number(flag, v, 0, 1LL << 62));
      else if (flag == "--db")
        db = v;
      else if (flag == "--postgres")
        dsn = v;
      else if (flag == "--mysql")
        mysql_uri = v;
      else if (flag == "--table")
        table = v;
      else
        throw std::invalid_argument("unknown flag " + flag);
    }
    if (cfg.fail_percent + cfg.lost_percent > 90) {
      throw std::invalid_argument("at least 10% of attempts must succeed");
    }
#ifndef COUPON_CLAIM_WITH_POSTGRES
    if (!dsn.empty()) throw std::invalid_argument("--postgres needs a build with idem::postgres");
#endif
#ifndef COUPON_CLAIM_WITH_MYSQL
    if (!mysql_uri.empty()) throw std::invalid_argument("--mysql needs a build with idem::mysql");
#endif
    if (!dsn.empty() && !mysql_uri.empty()) {
      throw std::invalid_argument("--postgres and --mysql are exclusive");
    }
    if (cfg.seed == 0) cfg.seed = std::random_device{}() % 1000000 + 1;
  } catch (const std::exception& e) {
    std::cerr << "idem_coupon_claim: " << e.what() << "\n";
    usage(std::cerr);
    return 2;
  }
  // One run on `backend`: the report, and the exit status of its checks.
  auto run = [&](auto&& backend, const std::string& where) {
    auto rep = coupon_claim::run_claims(backend, cfg, where);
    coupon_claim::print_report(rep, std::cout);
    return rep.ok() ? 0 : 1;
  };
  try {
#ifdef COUPON_CLAIM_WITH_POSTGRES
    if (!dsn.empty())
      return run(coupon_claim::PostgresBackend{dsn, table}, "postgres, table " + table);
#endif
#ifdef COUPON_CLAIM_WITH_MYSQL
    if (!mysql_uri.empty())
      return run(coupon_claim::MysqlBackend{mysql_uri, table}, "mysql, table " + table);
#endif
    return run(coupon_claim::SqliteBackend{db, table}, db);
  } catch (const std::exception& e) {
    std::cerr << "idem_coupon_claim: " << e.what() << "\n";
    return 3;
  }
}
