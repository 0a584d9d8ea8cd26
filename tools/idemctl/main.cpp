// SPDX-License-Identifier: MIT
// idemctl: look at and maintain idempotency records (see docs/idemctl.md).
#include <algorithm>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "idem/http/idempotency_key.hpp"
#include "idem/log.hpp"
#include "idemctl.hpp"
#ifdef IDEMCTL_WITH_POSTGRES
#include "idemctl_postgres.hpp"
#endif
#ifdef IDEMCTL_WITH_MYSQL
#include "idemctl_mysql.hpp"
#endif

namespace {

constexpr const char* kUsage =
    "usage: idemctl [options] <command> [arguments]\n"
    "\n"
    "commands:\n"
    "  show <scope> <id>            print the record from each store, side by side\n"
    "                               (exit 1 when no store has it)\n"
    "  stats                        count records by status\n"
    "  purge --older-than <dur>     delete completed/failed records last updated more than\n"
    "        [--dry-run]            <dur> ago (7d, 12h, 30m, 45s, 2w, 1d12h); in-progress\n"
    "                               records are never deleted\n"
    "  purge --expired              delete records whose retention ended\n"
    "  key --scope S --principal P --method M --route R --key K\n"
    "                               print the idem key an HTTP request is stored under\n"
    "\n"
    "options:\n"
    "  --db DB          SQLite file, or PostgreSQL: a postgresql:// URI or a libpq\n"
    "                   conninfo string (\"host=... dbname=...\"), or MySQL / MariaDB:\n"
    "                   a mysql:// URI (env IDEMCTL_DB)\n"
    "  --mysql URI      the same as --db mysql://user:pass@host:port/database\n"
    "  --table NAME     record table (default api_idempotency)\n"
    "  --mq             the MQ consume record table (mq_consume_record)\n"
    "  --fast URL       also read the fast store at URL in `show` (redis://host:port[/db])\n"
    "  --fast-prefix P  the fast store's key prefix (default idem:)\n"
    "  -h, --help       this text\n"
    "\n"
    "exit status: 0 ok, 1 record not found, 2 bad arguments, 3 store unreachable or failing\n";

struct Args {
  std::string db;
  std::string table;
  bool mq = false;
  std::string fast_url;
  std::string fast_prefix = "idem:";
  std::vector<std::string> rest;
};

std::string take_value(const std::vector<std::string>& argv, std::size_t& i) {
  if (i + 1 >= argv.size()) throw idemctl::UsageError(argv[i] + " needs a value");
  return argv[++i];
}

Args parse_global(const std::vector<std::string>& argv) {
  Args a;
  if (const char* env = std::getenv("IDEMCTL_DB")) a.db = env;
  std::size_t i = 0;
  for (; i < argv.size(); ++i) {
    const std::string& s = argv[i];
    if (s == "--db") {
      a.db = take_value(argv, i);
    } else if (s == "--mysql") {
      a.db = take_value(argv, i);
      if (a.db.find("://") == std::string::npos) a.db = "mysql://" + a.db;
    } else if (s == "--table") {
      a.table = take_value(argv, i);
    } else if (s == "--mq") {
      a.mq = true;
    } else if (s == "--fast" || s == "--redis") {
      a.fast_url = take_value(argv, i);
    } else if (s == "--fast-prefix") {
      a.fast_prefix = take_value(argv, i);
    } else if (!s.empty() && s[0] == '-' && s != "-h" && s != "--help") {
      throw idemctl::UsageError("unknown option '" + s + "'");
    } else {
      break;
    }
  }
  a.rest.assign(argv.begin() + static_cast<std::ptrdiff_t>(i), argv.end());
  return a;
}

idem::sqlite::SqliteStoreOptions store_options(const Args& a) {
  auto o = a.mq ? idem::sqlite::SqliteStoreOptions::mq_consume_record()
                : idem::sqlite::SqliteStoreOptions{};
  if (!a.table.empty()) o.table = a.table;
  return o;
}

// The durable store named by --db: MySQL for a mysql:// URI, PostgreSQL for a URI or
// conninfo, else an SQLite file. Each is a RecordSource and an Admin.
std::unique_ptr<idemctl::RecordSource> open_durable(const Args& a) {
  // First: a mysql:// URI may carry '=' in its query, which would look like a conninfo.
#ifdef IDEMCTL_WITH_MYSQL
  if (idemctl::is_mysql_uri(a.db)) {
    auto o = a.mq ? idem::mysql::MysqlStoreOptions::mq_consume_record(a.db)
                  : idem::mysql::MysqlStoreOptions{};
    o.uri = a.db;
    if (!a.table.empty()) o.table = a.table;
    return std::make_unique<idemctl::MysqlSource>(std::move(o));
  }
#else
  if (a.db.rfind("mysql://", 0) == 0 || a.db.rfind("mariadb://", 0) == 0) {
    throw idemctl::StoreError("cannot open " + idemctl::redact_dsn(a.db) +
                              ": this idemctl was built without MySQL (idem::mysql)");
  }
#endif
#ifdef IDEMCTL_WITH_POSTGRES
  if (idemctl::is_postgres_dsn(a.db)) {
    auto o = a.mq ? idem::postgres::PostgresStoreOptions::mq_consume_record(a.db)
                  : idem::postgres::PostgresStoreOptions{};
    o.conninfo = a.db;
    if (!a.table.empty()) o.table = a.table;
    return std::make_unique<idemctl::PostgresSource>(std::move(o));
  }
#else
  if (a.db.rfind("postgresql://", 0) == 0 || a.db.rfind("postgres://", 0) == 0) {
    throw idemctl::StoreError("cannot open " + idemctl::redact_dsn(a.db) +
                              ": this idemctl was built without PostgreSQL (idem::postgres)");
  }
#endif
  return std::make_unique<idemctl::SqliteSource>(a.db, store_options(a));
}

idemctl::Admin& admin_of(idemctl::RecordSource& src) {
  return dynamic_cast<idemctl::Admin&>(src);
}

std::string when(idem::TimePoint t) { return idem::log::format_time(t); }

int cmd_show(const Args& a) {
  if (a.rest.size() != 3) throw idemctl::UsageError("show needs <scope> <id>");
  idem::Key key = [&] {
    try {
      return idem::Key::make(a.rest[1], a.rest[2]);
    } catch (const idem::InvalidKey& e) {
      throw idemctl::UsageError(e.what());
    }
  }();
  std::vector<std::unique_ptr<idemctl::RecordSource>> sources;
  if (a.db.empty()) throw idemctl::UsageError("no database: pass --db DB (or set IDEMCTL_DB)");
  sources.push_back(open_durable(a));
  if (!a.fast_url.empty()) sources.push_back(idemctl::open_fast_source(a.fast_url, a.fast_prefix));

  std::vector<std::string> fields = {"status",    "owner",      "lease_until", "first_seen",
                                     "last_seen", "expires_at", "fingerprint", "response"};
  std::vector<std::vector<std::string>> columns;
  bool found = false;
  for (auto& src : sources) {
    std::vector<std::string> col;
    auto r = src->lookup(key);
    if (!r) {
      col.assign(fields.size(), "");
      col[0] = "(absent)";
    } else {
      found = true;
      col = {std::string(idem::record_status_name(r->status)),
             r->owner,
             r->status == idem::Record::Status::kInProgress ? when(r->lease_until) : "-",
             when(r->created_at),
             when(r->updated_at),
             r->status == idem::Record::Status::kInProgress ? "-" : when(r->expires_at),
             r->fingerprint.empty() ? "-" : r->fingerprint,
             std::to_string(r->response.size()) + " bytes"};
      for (auto& [name, value] : src->extra(key)) {
        if (columns.empty() && std::find(fields.begin(), fields.end(), name) == fields.end()) {
          fields.push_back(name);
        }
        col.push_back(value);
      }
    }
    columns.push_back(std::move(col));
  }

  std::size_t width = 34;
  for (auto& c : columns) {
    for (auto& v : c) width = std::max(width, v.size() + 2);
  }
  std::cout << "key " << key.str() << "\n";
  // One row per field, one column per store; the last column is not padded.
  auto row = [&](const std::string& title, auto&& cell) {
    std::cout << std::left << std::setw(13) << title;
    for (std::size_t i = 0; i < sources.size(); ++i) {
      std::string v = cell(i);
      if (i + 1 < sources.size()) v.resize(std::max(v.size(), width), ' ');
      std::cout << v;
    }
    std::cout << "\n";
  };
  row("", [&](std::size_t i) { return sources[i]->name(); });
  for (std::size_t f = 0; f < fields.size(); ++f) {
    row(fields[f], [&](std::size_t i) { return f < columns[i].size() ? columns[i][f] : ""; });
  }
  return found ? 0 : 1;
}

int cmd_stats(const Args& a) {
  if (a.rest.size() != 1) throw idemctl::UsageError("stats takes no arguments");
  if (a.db.empty()) throw idemctl::UsageError("no database: pass --db DB (or set IDEMCTL_DB)");
  auto src = open_durable(a);
  auto s = admin_of(*src).stats(idem::system_now());
  std::cout << "store " << src->name() << " table " << store_options(a).table << "\n"
            << "in_progress  " << s.in_progress << "  (" << s.stale_in_progress
            << " with an expired lease)\n"
            << "completed    " << s.completed << "\n"
            << "failed       " << s.failed << "\n"
            << "total        " << s.in_progress + s.completed + s.failed << "  ("
            << s.past_retention << " past retention, purgeable with purge --expired)\n";
  return 0;
}

int cmd_purge(const Args& a) {
  std::optional<std::chrono::seconds> older;
  bool expired = false, dry_run = false;
  for (std::size_t i = 1; i < a.rest.size(); ++i) {
    const auto& s = a.rest[i];
    if (s == "--older-than") {
      older = idemctl::parse_duration(take_value(a.rest, i));
    } else if (s == "--expired") {
      expired = true;
    } else if (s == "--dry-run") {
      dry_run = true;
    } else {
      throw idemctl::UsageError("unknown purge argument '" + s + "'");
    }
  }
  if (older.has_value() == expired) {
    throw idemctl::UsageError("purge needs exactly one of --older-than <duration> or --expired");
  }
  if (expired && dry_run) throw idemctl::UsageError("--dry-run goes with --older-than");
  if (a.db.empty()) throw idemctl::UsageError("no database: pass --db DB (or set IDEMCTL_DB)");
  auto src = open_durable(a);
  auto& admin = admin_of(*src);
  if (expired) {
    std::cout << "purged " << admin.purge_expired() << " records past retention from "
              << src->name() << "\n";
    return 0;
  }
  auto cutoff = idem::system_now() - *older;
  auto n = admin.purge_older_than(cutoff, dry_run);
  std::cout << (dry_run ? "would purge " : "purged ") << n
            << " completed/failed records last updated before " << when(cutoff) << " from "
            << src->name() << "\n";
  return 0;
}

int cmd_key(const Args& a) {
  std::string scope, principal, method, route, client_key;
  bool have_key = false;
  for (std::size_t i = 1; i < a.rest.size(); ++i) {
    const auto& s = a.rest[i];
    if (s == "--scope") {
      scope = take_value(a.rest, i);
    } else if (s == "--principal") {
      principal = take_value(a.rest, i);
    } else if (s == "--method") {
      method = take_value(a.rest, i);
    } else if (s == "--route") {
      route = take_value(a.rest, i);
    } else if (s == "--key") {
      client_key = take_value(a.rest, i);
      have_key = true;
    } else {
      throw idemctl::UsageError("unknown key argument '" + s + "'");
    }
  }
  if (scope.empty() || method.empty() || route.empty() || !have_key) {
    throw idemctl::UsageError("key needs --scope, --method, --route and --key");
  }
  try {
    auto k = idem::http::scoped_key(scope, principal, method, route, client_key);
    std::cout << k.scope() << " " << k.id() << "\n";
  } catch (const idem::InvalidKey& e) {
    throw idemctl::UsageError(e.what());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    Args a = parse_global(args);
    if (a.rest.empty()) throw idemctl::UsageError("no command");
    const std::string& cmd = a.rest[0];
    if (cmd == "-h" || cmd == "--help" || cmd == "help") {
      std::cout << kUsage;
      return 0;
    }
    if (cmd == "show") return cmd_show(a);
    if (cmd == "stats") return cmd_stats(a);
    if (cmd == "purge") return cmd_purge(a);
    if (cmd == "key") return cmd_key(a);
    throw idemctl::UsageError("unknown command '" + cmd + "'");
  } catch (const idemctl::UsageError& e) {
    std::cerr << "idemctl: " << e.what() << "\n\n" << kUsage;
    return 2;
  } catch (const idemctl::StoreError& e) {
    std::cerr << "idemctl: " << e.what() << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "idemctl: " << e.what() << "\n";
    return 3;
  }
}
