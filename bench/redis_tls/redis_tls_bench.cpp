// SPDX-License-Identifier: MIT
// One RedisStore call (a claim of a completed key: one round trip, answered "done") over two
// connections side by side, interleaved round by round in one process: A over `--a`, B over
// `--b` (e.g. rediss:// through idem's TLS relay vs redis:// through a stunnel client, or vs
// plain TCP). Prints both sides' ops/s, p50, p99 and `ratio <name> = <A over B>`.
//
//   idem_redis_tls_bench --a URL --b URL --ca CA.pem --name NAME [--threads 1] [--ops 2000]
//                        [--rounds 21]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../common/side_by_side.hpp"
#include "idem/redis/redis_store.hpp"

namespace {

struct Args {
  std::string a, b, ca, name;
  int threads = 1;
  int ops = 2000;
  int rounds = 21;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--a")
      a.a = v;
    else if (k == "--b")
      a.b = v;
    else if (k == "--ca")
      a.ca = v;
    else if (k == "--name")
      a.name = v;
    else if (k == "--threads")
      a.threads = std::atoi(v.c_str());
    else if (k == "--ops")
      a.ops = std::atoi(v.c_str());
    else if (k == "--rounds")
      a.rounds = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (a.a.empty() || a.b.empty() || a.name.empty()) {
    std::fprintf(stderr, "usage: idem_redis_tls_bench --a URL --b URL --ca CA --name NAME\n");
    std::exit(2);
  }
  return a;
}

std::unique_ptr<idem::redis::RedisStore> store(const std::string& url, const Args& args) {
  idem::redis::RedisStoreOptions o;
  o.uri = url;
  if (url.rfind("rediss://", 0) == 0) o.tls.ca_file = args.ca;
  o.pool_size = static_cast<std::size_t>(args.threads);
  return std::make_unique<idem::redis::RedisStore>(o);
}

}  // namespace

int main(int argc, char** argv) {
  Args args = parse(argc, argv);
  auto a = store(args.a, args);
  auto b = store(args.b, args);
  // One completed key per thread; each call claims it again and is answered "done".
  std::vector<idem::Key> keys;
  for (int t = 0; t < args.threads; ++t) {
    keys.push_back(idem::Key::make("bench_tls", "k" + std::to_string(t)));
    auto owner = idem::OwnerToken::generate();
    for (auto* s : {a.get(), b.get()}) {
      if (s->claim(keys.back(), "", owner, std::chrono::seconds(60)).status ==
          idem::ClaimStatus::kClaimed) {
        (void)s->complete(keys.back(), owner, "response", std::chrono::seconds(600));
      }
    }
  }
  auto call = [&](idem::redis::RedisStore& s, int t) {
    auto r = s.claim(keys[static_cast<std::size_t>(t)], "", idem::OwnerToken::generate(),
                     std::chrono::seconds(60));
    if (r.status != idem::ClaimStatus::kDone) {
      std::fprintf(stderr, "unexpected claim status\n");
      std::exit(1);
    }
  };
  auto c = idem::bench::interleave(
      args.rounds, args.threads, args.ops, [&](int, int t, int) { call(*a, t); },
      [&](int, int t, int) { call(*b, t); });
  idem::bench::report(args.name, "A", "B", c);
  std::printf("%-44s A = %s, B = %s, %d thread(s)\n", "", args.a.c_str(), args.b.c_str(),
              args.threads);
  return 0;
}
