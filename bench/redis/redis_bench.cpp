// SPDX-License-Identifier: MIT
// idem's Redis fast store against the raw hiredis loops it must keep up with, interleaved in one
// process (A B A B ...), same thread count, same connection count. Prints ops/s, p50, p99 and
// `ratio <name> = <value>` (ours over raw, median of the per-round ratios; higher is better).
//
//   idem_redis_bench --url redis://127.0.0.1:6379 [--threads 1] [--ops 20000] [--rounds 7]
//                    [--only replay|first|memory|token] [--name-suffix S]
#include <hiredis/hiredis.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/side_by_side.hpp"
#include "idem/guard.hpp"
#include "idem/redis/redis_store.hpp"

namespace {

using Clock = idem::bench::Clock;
using namespace std::chrono_literals;

struct Args {
  std::string url;
  int threads = 1;
  int ops = 20000;  // per thread per phase
  int rounds = 7;
  std::string only;
  std::string side;  // "ours" or "raw": run one side only (for profiling); "" both
  bool claim_script = false;
  std::string name_suffix;          // appended to the ratio names (e.g. "_unpinned")
  bool auto_pipeline = true;        // RedisStoreOptions::auto_pipeline
  bool autopipeline_names = false;  // the many-thread names: guard_*_autopipeline_tN_vs_raw_*
};

// A raw hiredis connection, as a service without idem would hold it.
class Raw {
 public:
  explicit Raw(const std::string& host, int port) {
    c_ = redisConnect(host.c_str(), port);
    if (c_ == nullptr || c_->err != 0) {
      std::fprintf(stderr, "raw connect failed\n");
      std::exit(2);
    }
  }
  ~Raw() { redisFree(c_); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  // Runs a command and frees the reply; exits on a connection failure.
  void run(int argc, const char** argv, const std::size_t* lens) {
    void* r = redisCommandArgv(c_, argc, argv, lens);
    if (r == nullptr) {
      std::fprintf(stderr, "raw command failed: %s\n", c_->errstr);
      std::exit(2);
    }
    freeReplyObject(r);
  }
  long long integer(std::initializer_list<std::string_view> args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    auto* r = static_cast<redisReply*>(
        redisCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()));
    long long v = r != nullptr && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    if (r != nullptr) freeReplyObject(r);
    return v;
  }

 private:
  redisContext* c_;
};

using idem::bench::median;
using idem::bench::percentile;

// Ours (side A) against raw (side B), interleaved round by round (bench/common).
idem::bench::Comparison compare(const Args& a, const std::function<void(int, int, int)>& ours,
                                const std::function<void(int, int, int)>& raw) {
  const std::string only = a.side == "ours" ? "a" : a.side == "raw" ? "b" : "";
  return idem::bench::interleave(a.rounds, a.threads, a.ops, ours, raw, only);
}

void report(const std::string& name, const idem::bench::Comparison& c) {
  idem::bench::report(name, "ours:", "raw: ", c);
}

std::string run_id() {
  std::random_device rd;
  return std::to_string(rd() % 1000000);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    std::string v = argv[i + 1];
    if (k == "--url")
      a.url = v;
    else if (k == "--threads")
      a.threads = std::atoi(v.c_str());
    else if (k == "--ops")
      a.ops = std::atoi(v.c_str());
    else if (k == "--rounds")
      a.rounds = std::atoi(v.c_str());
    else if (k == "--only")
      a.only = v;
    else if (k == "--side")
      a.side = v;
    else if (k == "--claim-script")
      a.claim_script = v == "1";
    else if (k == "--name-suffix")
      a.name_suffix = v;
    else if (k == "--auto-pipeline")
      a.auto_pipeline = v == "1";
    else if (k == "--autopipeline-names")
      a.autopipeline_names = v == "1";
  }
  if (a.url.empty()) {
    std::fprintf(stderr,
                 "usage: idem_redis_bench --url redis://host:port [--threads N] "
                 "[--ops N] [--rounds N] [--only replay|first|memory|token]\n");
    return 2;
  }
  auto want = [&](const char* part) { return a.only.empty() || a.only == part; };
  // host:port for the raw connections (the bench takes redis://host:port only).
  std::string hp = a.url.substr(a.url.find("://") + 3);
  std::string host = hp.substr(0, hp.find(':'));
  int port = std::atoi(hp.substr(hp.find(':') + 1).c_str());
  const std::string tag = std::string(a.claim_script ? "lua_claim_" : "") + "t" +
                          std::to_string(a.threads) + a.name_suffix;
  const std::string id = run_id();

  idem::redis::RedisStoreOptions options{a.url};
  options.pool_size = static_cast<std::size_t>(a.threads);
  options.key_prefix = "idem-bench:";
  options.claim_script = a.claim_script;
  options.auto_pipeline = a.auto_pipeline;
  idem::redis::RedisStore store(options);
  idem::GuardOptions gopt;
  gopt.retention = std::chrono::seconds(300);
  idem::IdempotencyGuard guard{store, gopt};
  std::vector<std::unique_ptr<Raw>> raws;
  for (int t = 0; t < a.threads; ++t) raws.push_back(std::make_unique<Raw>(host, port));
  const std::string fp = idem::fingerprint("{\"order\":\"20001\",\"amount\":100}");
  const std::string response = "{\"payment_no\":\"pay_20001\",\"status\":\"PAID\"}";

  std::printf(
      "threads %d, %d ops per thread per phase, %d rounds (A/B interleaved), "
      "pool_size %d (auto_pipeline %s) vs %d raw connections\n",
      a.threads, a.ops, a.rounds, a.threads, a.auto_pipeline ? "on" : "off", a.threads);

  if (want("token")) {
    constexpr int kN = 200000;
    auto t0 = Clock::now();
    std::size_t sink = 0;
    for (int i = 0; i < kN; ++i) sink += idem::OwnerToken::generate().str().size();
    double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kN;
    std::printf("OwnerToken::generate (RAND_bytes + base64url): %.0f ns per token (%zu)\n", ns,
                sink / kN);
  }

  if (want("replay")) {
    // K completed keys per thread, cycled; the raw side SET NX EX 300 on K existing keys.
    constexpr int kKeys = 1000;
    std::vector<std::vector<idem::Key>> keys(static_cast<std::size_t>(a.threads));
    std::vector<std::vector<std::string>> raw_keys(static_cast<std::size_t>(a.threads));
    for (int t = 0; t < a.threads; ++t) {
      for (int i = 0; i < kKeys; ++i) {
        std::string sid = id + "_" + tag + "_" + std::to_string(t) + "_" + std::to_string(i);
        keys[static_cast<std::size_t>(t)].push_back(idem::Key::make("bench.replay", sid));
        raw_keys[static_cast<std::size_t>(t)].push_back("raw-bench:replay:" + sid);
        auto r = guard.run(keys[static_cast<std::size_t>(t)].back(), fp, [&] { return response; });
        (void)r;
        const std::string& rk = raw_keys[static_cast<std::size_t>(t)].back();
        const char* av[] = {"SET", rk.c_str(), response.c_str(), "EX", "300"};
        const std::size_t lv[] = {3, rk.size(), response.size(), 2, 3};
        raws[static_cast<std::size_t>(t)]->run(5, av, lv);
      }
    }
    // The raw side of both replay comparisons: SET NX EX 300 on an existing key.
    auto raw_set_nx_ex = [&](int, int t, int i) {
      const std::string& rk =
          raw_keys[static_cast<std::size_t>(t)][static_cast<std::size_t>(i % kKeys)];
      const char* av[] = {"SET", rk.c_str(), response.c_str(), "NX", "EX", "300"};
      const std::size_t lv[] = {3, rk.size(), response.size(), 2, 2, 3};
      raws[static_cast<std::size_t>(t)]->run(6, av, lv);
    };
    std::atomic<long> bad{0};
    auto c = compare(
        a,
        [&](int, int t, int i) {
          auto r = guard.run(keys[static_cast<std::size_t>(t)][static_cast<std::size_t>(i % kKeys)],
                             fp, [&] { return std::string("never"); });
          if (r.outcome != idem::Outcome::kReplayed) ++bad;
        },
        raw_set_nx_ex);
    if (bad.load() != 0) std::printf("WARNING: %ld replays were not kReplayed\n", bad.load());
    report(a.autopipeline_names ? "guard_replay_autopipeline_" + tag + "_vs_raw_set_nx_ex_" + tag
                                : "guard_replay_vs_set_nx_ex_" + tag,
           c);
    if (a.only == "replay") {
      // Diagnostic: the store's claim alone (no guard, a fixed owner token) on the same keys,
      // to tell the store's cost from the guard's.
      const idem::OwnerToken owner = idem::OwnerToken::generate();
      auto d = compare(
          a,
          [&](int, int t, int i) {
            auto r =
                store.claim(keys[static_cast<std::size_t>(t)][static_cast<std::size_t>(i % kKeys)],
                            fp, owner, 30s);
            if (r.status != idem::ClaimStatus::kDone) ++bad;
          },
          raw_set_nx_ex);
      report("store_claim_replay_vs_set_nx_ex_" + tag, d);
    }
  }

  if (a.only == "pipeline") {
    // The lone caller's price of auto-pipelining: the same guard replay over a store with
    // auto_pipeline on (ours) and off (the pooled connection), interleaved.
    idem::redis::RedisStoreOptions off_options = options;
    off_options.auto_pipeline = false;
    idem::redis::RedisStore off_store(off_options);
    idem::IdempotencyGuard off_guard{off_store, gopt};
    constexpr int kKeys = 1000;
    std::vector<idem::Key> keys;
    for (int i = 0; i < kKeys; ++i) {
      keys.push_back(idem::Key::make("bench.pipeline", id + "_" + tag + "_" + std::to_string(i)));
      auto r = guard.run(keys.back(), fp, [&] { return response; });
      (void)r;
    }
    std::atomic<long> bad{0};
    auto replay = [&](idem::IdempotencyGuard<>& g, int i) {
      auto r = g.run(keys[static_cast<std::size_t>(i % kKeys)], fp,
                     [&] { return std::string("never"); });
      if (r.outcome != idem::Outcome::kReplayed) ++bad;
    };
    auto c = idem::bench::interleave(
        a.rounds, a.threads, a.ops, [&](int, int, int i) { replay(guard, i); },
        [&](int, int, int i) { replay(off_guard, i); });
    if (bad.load() != 0) std::printf("WARNING: %ld replays were not kReplayed\n", bad.load());
    idem::bench::report("guard_replay_autopipeline_vs_pooled_" + tag, "pipelined:", "pooled:", c);
  }

  if (want("first")) {
    // A new key every call: guard (claim + complete: 2 round trips) vs SET NX + SET XX.
    std::atomic<long> bad{0};
    auto key_of = [&](const char* kind, int round, int t, int i) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "%s_%s_%s_%d_%d_%d", id.c_str(), kind, tag.c_str(), round, t,
                    i);
      return std::string(buf);
    };
    auto c = compare(
        a,
        [&](int round, int t, int i) {
          auto k = idem::Key::make("bench.first", key_of("g", round, t, i));
          auto r = guard.run(k, fp, [&] { return response; });
          if (r.outcome != idem::Outcome::kExecuted) ++bad;
        },
        [&](int round, int t, int i) {
          std::string rk = "raw-bench:first:" + key_of("r", round, t, i);
          const char* a1[] = {"SET", rk.c_str(), "CONSUMING", "NX", "EX", "300"};
          const std::size_t l1[] = {3, rk.size(), 9, 2, 2, 3};
          raws[static_cast<std::size_t>(t)]->run(6, a1, l1);
          const char* a2[] = {"SET", rk.c_str(), response.c_str(), "XX", "EX", "300"};
          const std::size_t l2[] = {3, rk.size(), response.size(), 2, 2, 3};
          raws[static_cast<std::size_t>(t)]->run(6, a2, l2);
        });
    if (bad.load() != 0) std::printf("WARNING: %ld first calls were not kExecuted\n", bad.load());
    report(a.autopipeline_names ? "guard_first_exec_autopipeline_" + tag + "_vs_raw_two_step_" + tag
                                : "guard_first_exec_vs_set_nx_set_xx_" + tag,
           c);
    const auto ps = store.pool_stats();
    if (ps.pipelined_flushes > 0) {
      std::printf(
          "auto-pipeline: %llu commands in %llu batches (%.1f per batch)\n",
          static_cast<unsigned long long>(ps.pipelined_commands),
          static_cast<unsigned long long>(ps.pipelined_flushes),
          static_cast<double>(ps.pipelined_commands) / static_cast<double>(ps.pipelined_flushes));
    }
  }

  if (want("memory")) {
    Raw& raw = *raws[0];
    for (std::size_t size : {std::size_t{0}, std::size_t{1024}}) {
      auto k = idem::Key::make("payment", "order_" + id + "_mem" + std::to_string(size));
      std::string body(size, 'x');
      auto r = guard.run(k, fp, [&] { return body; });
      (void)r;
      std::string rk = store.redis_key(k);
      long long bytes = raw.integer({"MEMORY", "USAGE", rk, "SAMPLES", "0"});
      std::printf(
          "MEMORY USAGE per completed record, %4zu-byte response: %lld bytes "
          "(key %zu bytes, 64-char fingerprint, %zu-char owner)\n",
          size, bytes, rk.size(), idem::OwnerToken::kLength);
    }
  }
  return 0;
}
