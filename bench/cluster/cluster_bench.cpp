// SPDX-License-Identifier: MIT
// The Redis Cluster path of RedisStore against one Redis (throughput of guarded calls) and
// against a single node (per-call routing overhead), interleaved in one process (A B A B ...).
// Prints ops/s, p50, p99 and `ratio <name> = <value>` (A over B, median of per-round ratios).
//
//   idem_cluster_bench --cluster redis-cluster://h:p,... --single redis://h:p
//                      --mode throughput|routing [--threads N] [--ops N] [--rounds N]
#include <hiredis/hiredis.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/side_by_side.hpp"
#include "idem/guard.hpp"
#include "idem/redis/redis_store.hpp"
#include "router.hpp"  // key_slot, parse_topology (white-box: which node owns a key)

namespace {

using Clock = idem::bench::Clock;
using namespace std::chrono_literals;

struct Args {
  std::string cluster, single, mode;
  int threads = 1;
  int ops = 2000;
  int rounds = 11;
};

// Interleaves A and B `rounds` times, alternating which goes first; reports both and the median
// of the per-round ratios A/B (bench/common).
void compare(const Args& a, const std::string& name, const char* a_label, const char* b_label,
             const std::function<void(int, int, int)>& fa,
             const std::function<void(int, int, int)>& fb) {
  idem::bench::report(name, a_label, b_label,
                      idem::bench::interleave(a.rounds, a.threads, a.ops, fa, fb));
}

// A raw hiredis connection to one node, as a service without idem would hold it.
class Raw {
 public:
  Raw(const std::string& host, int port) : c_(redisConnect(host.c_str(), port)) {
    if (c_ == nullptr || c_->err != 0) {
      std::fprintf(stderr, "raw connect to %s:%d failed\n", host.c_str(), port);
      std::exit(2);
    }
  }
  ~Raw() { redisFree(c_); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  redisReply* run(std::initializer_list<std::string_view> args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (auto s : args) {
      argv.push_back(s.data());
      lens.push_back(s.size());
    }
    auto* r = static_cast<redisReply*>(
        redisCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()));
    if (r == nullptr) {
      std::fprintf(stderr, "raw command failed: %s\n", c_->errstr);
      std::exit(2);
    }
    return r;
  }

 private:
  redisContext* c_;
};

std::string run_id() { return std::to_string(std::random_device{}() % 1000000); }

// Guarded calls (the guard over the fast store alone, as bench/redis does) on the cluster and on
// one Redis, same threads, same pool size per node.
void throughput(const Args& a) {
  idem::redis::RedisStoreOptions co{a.cluster}, so{a.single};
  co.pool_size = so.pool_size = static_cast<std::size_t>(a.threads);
  co.key_prefix = so.key_prefix = "idem-bench:";
  idem::redis::RedisStore cluster(co), single(so);
  idem::GuardOptions go;
  go.retention = std::chrono::seconds(300);
  idem::IdempotencyGuard<> gc{cluster, go};
  idem::IdempotencyGuard<> gs{single, go};
  const std::string id = run_id(), tag = "t" + std::to_string(a.threads);
  const std::string fp = idem::fingerprint("{\"order\":\"20001\",\"amount\":100}");
  const std::string response = "{\"payment_no\":\"pay_20001\",\"status\":\"PAID\"}";
  std::atomic<long> bad{0};
  auto first = [&](idem::IdempotencyGuard<>& g, const char* side) {
    return [&, side](int round, int t, int i) {
      auto k =
          idem::Key::make("bench.cluster", id + "_" + side + "_" + std::to_string(round) + "_" +
                                               std::to_string(t) + "_" + std::to_string(i));
      if (g.run(k, fp, [&] { return response; }).outcome != idem::Outcome::kExecuted) ++bad;
    };
  };
  compare(a, "cluster_guard_first_exec_vs_single_redis_" + tag, "3-master cluster",
          "one redis-server", first(gc, "c"), first(gs, "s"));
  constexpr int kKeys = 1000;
  std::vector<idem::Key> keys;
  for (int i = 0; i < kKeys; ++i) {
    keys.push_back(idem::Key::make("bench.cluster", id + "_replay_" + std::to_string(i)));
    (void)gc.run(keys.back(), fp, [&] { return response; });
    (void)gs.run(keys.back(), fp, [&] { return response; });
  }
  auto replay = [&](idem::IdempotencyGuard<>& g) {
    return [&](int, int t, int i) {
      const auto& k = keys[static_cast<std::size_t>((t * 131 + i) % kKeys)];
      if (g.run(k, fp, [] { return std::string("never"); }).outcome != idem::Outcome::kReplayed) {
        ++bad;
      }
    };
  };
  compare(a, "cluster_guard_replay_vs_single_redis_" + tag, "3-master cluster", "one redis-server",
          replay(gc), replay(gs));
  const auto rs = cluster.route_stats();
  std::printf("cluster nodes known %zu, MOVED %llu, ASK %llu, map reads %llu\n", rs.nodes,
              static_cast<unsigned long long>(rs.moved), static_cast<unsigned long long>(rs.ask),
              static_cast<unsigned long long>(rs.refreshes));
  if (bad.load() != 0) std::printf("WARNING: %ld calls had an unexpected outcome\n", bad.load());
}

// Per-call cost of the cluster path (slot hash, slot table, per-node pool) on keys of one
// master, against the same store talking to that master directly, and against a raw hiredis
// SET NX EX loop on that master.
void routing(const Args& a) {
  const auto seeds = idem::redis::detail::parse_topology(a.cluster).endpoints;
  // The master of slot 0's range (asked through the first seed).
  Raw probe(seeds.front().host, seeds.front().port);
  redisReply* slots = probe.run({"CLUSTER", "SLOTS"});
  std::string host;
  int port = 0;
  std::vector<std::pair<long long, long long>> ranges;
  for (std::size_t i = 0; i < slots->elements; ++i) {
    const redisReply* e = slots->element[i];
    const redisReply* m = e->element[2];
    const std::string h(m->element[0]->str, m->element[0]->len);
    const int p = static_cast<int>(m->element[1]->integer);
    if (port == 0) {
      host = h.empty() ? seeds.front().host : h;
      port = p;
    }
    if (p == port) ranges.emplace_back(e->element[0]->integer, e->element[1]->integer);
  }
  freeReplyObject(slots);
  auto owned = [&](int slot) {
    for (auto [lo, hi] : ranges) {
      if (lo <= slot && slot <= hi) return true;
    }
    return false;
  };
  idem::redis::RedisStoreOptions co{a.cluster};
  co.key_prefix = "idem-bench:";
  idem::redis::RedisStore cluster(co);
  idem::redis::RedisStoreOptions dopt{"redis://" + host + ":" + std::to_string(port)};
  dopt.key_prefix = "idem-bench:";
  idem::redis::RedisStore direct(dopt);
  Raw raw(host, port);
  const std::string id = run_id(), fp = idem::fingerprint("{\"order\":\"1\"}");
  const std::string response = "{\"payment_no\":\"pay_1\"}";
  constexpr int kKeys = 1000;
  std::vector<idem::Key> keys;
  std::vector<std::string> raw_keys;
  const auto owner = idem::OwnerToken::generate();
  for (int i = 0; static_cast<int>(keys.size()) < kKeys; ++i) {
    idem::Key k = idem::Key::make("bench.route", id + "_" + std::to_string(i));
    const std::string rk = cluster.redis_key(k);
    if (!owned(idem::redis::detail::key_slot(rk))) continue;
    keys.push_back(k);
    raw_keys.push_back("raw-bench:route:" + id + "_" + std::to_string(i));
    (void)cluster.claim(k, fp, owner, 30s);
    (void)cluster.complete(k, owner, response, std::chrono::seconds(300));
    freeReplyObject(raw.run({"SET", raw_keys.back(), response, "EX", "300"}));
  }
  std::atomic<long> bad{0};
  auto via = [&](idem::redis::RedisStore& s) {
    return [&](int, int, int i) {
      if (s.claim(keys[static_cast<std::size_t>(i % kKeys)], fp, owner, 30s).status !=
          idem::ClaimStatus::kDone) {
        ++bad;
      }
    };
  };
  std::printf("routing: keys of master %s:%d (%zu slot ranges)\n", host.c_str(), port,
              ranges.size());
  compare(a, "cluster_claim_vs_direct_node_claim_t" + std::to_string(a.threads),
          "cluster path claim", "same store, node direct", via(cluster), via(direct));
  compare(a, "cluster_claim_vs_raw_set_nx_t" + std::to_string(a.threads), "cluster path claim",
          "raw hiredis SET NX EX", via(cluster), [&](int, int, int i) {
            freeReplyObject(raw.run({"SET", raw_keys[static_cast<std::size_t>(i % kKeys)], response,
                                     "NX", "EX", "300"}));
          });
  // The routing step alone, in-process: CRC16 of the hash tag + slot-table read.
  constexpr int kN = 2000000;
  const std::string sample = cluster.redis_key(keys.front());
  std::size_t sink = 0;
  auto t0 = Clock::now();
  for (int i = 0; i < kN; ++i)
    sink += idem::redis::detail::key_slot(sample) + static_cast<std::size_t>(i & 1);
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kN;
  std::printf("key_slot(\"%s\") (CRC16 of the tag): %.1f ns per key (%zu)\n", sample.c_str(), ns,
              sink % 7);
  if (bad.load() != 0) std::printf("WARNING: %ld claims were not kDone\n", bad.load());
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--cluster")
      a.cluster = v;
    else if (k == "--single")
      a.single = v;
    else if (k == "--mode")
      a.mode = v;
    else if (k == "--threads")
      a.threads = std::atoi(v.c_str());
    else if (k == "--ops")
      a.ops = std::atoi(v.c_str());
    else if (k == "--rounds")
      a.rounds = std::atoi(v.c_str());
  }
  if (a.cluster.empty() || (a.mode == "throughput" && a.single.empty()) ||
      (a.mode != "throughput" && a.mode != "routing")) {
    std::fprintf(stderr,
                 "usage: idem_cluster_bench --cluster redis-cluster://h:p,... --single "
                 "redis://h:p --mode throughput|routing [--threads N] [--ops N] [--rounds N]\n");
    return 2;
  }
  std::printf("mode %s: %d threads, %d ops per thread per phase, %d rounds (A/B interleaved)\n",
              a.mode.c_str(), a.threads, a.ops, a.rounds);
  if (a.mode == "throughput") {
    throughput(a);
  } else {
    routing(a);
  }
  return 0;
}
