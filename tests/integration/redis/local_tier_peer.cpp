// SPDX-License-Identifier: MIT
// A second process for the local tier tests: a RedisStore with the tier enabled, driven by one
// command per line on stdin, one answer line on stdout (local_tier_test.cpp).
//   wait_tracking            -> ok | timeout
//   warm <id> <fp> <writes>  -> ok (a claim was answered from the tier, after <writes>
//                               invalidations were heard) | timeout
//   claim <id> <fp>          -> <claimed|busy|done|mismatch> [response] <local|remote>
//   wait_gone <id>           -> ok (the tier no longer answers the key) | timeout
//   invalidations            -> invalidations <n>
// Usage: redis_local_tier_peer <redis url> <key prefix>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>

#include "idem/redis/redis_store.hpp"
#include "local_tier_support.hpp"

namespace {

using namespace std::chrono_literals;

using idem::test::eventually;

const char* status_name(idem::ClaimStatus s) {
  switch (s) {
    case idem::ClaimStatus::kClaimed:
      return "claimed";
    case idem::ClaimStatus::kBusy:
      return "busy";
    case idem::ClaimStatus::kDone:
      return "done";
    case idem::ClaimStatus::kMismatch:
      return "mismatch";
  }
  return "?";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: redis_local_tier_peer <redis url> <key prefix>\n";
    return 2;
  }
  idem::redis::RedisStoreOptions o{argv[1]};
  o.key_prefix = argv[2];
  o.local_tier.enabled = true;
  idem::redis::RedisStore store(o);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd, id, fp;
    std::uint64_t writes = 0;
    in >> cmd >> id >> fp >> writes;
    std::string answer;
    try {
      if (cmd == "wait_tracking") {
        answer = eventually([&] { return store.local_tier_stats().tracking; }) ? "ok" : "timeout";
      } else if (cmd == "warm") {
        const idem::Key k = idem::Key::make("tier", id);
        answer = eventually([&] {
          const auto before = store.local_tier_stats().hits;
          store.claim(k, fp, idem::OwnerToken::generate(), 5000ms);
          return store.local_tier_stats().hits > before;
        })
                     ? "ok"
                     : "timeout";
      } else if (cmd == "claim") {
        const idem::Key k = idem::Key::make("tier", id);
        const auto before = store.local_tier_stats().hits;
        auto r = store.claim(k, fp, idem::OwnerToken::generate(), 5000ms);
        answer = status_name(r.status);
        if (!r.response.empty()) answer += " " + r.response;
        answer += store.local_tier_stats().hits > before ? " local" : " remote";
      } else if (cmd == "wait_gone") {
        const std::string rk = store.redis_key(idem::Key::make("tier", id));
        // The entry is gone once the invalidation arrived; nothing else removes it meanwhile.
        answer = eventually([&] {
          return store.local_tier_stats().invalidations > 0 &&
                 store.local_tier_stats().entries == 0;
        })
                     ? "ok"
                     : "timeout";
      } else if (cmd == "invalidations") {
        answer = "invalidations " + std::to_string(store.local_tier_stats().invalidations);
      } else {
        answer = "unknown command";
      }
    } catch (const std::exception& e) {
      answer = std::string("error ") + e.what();
    }
    std::cout << answer << std::endl;
  }
  return 0;
}
