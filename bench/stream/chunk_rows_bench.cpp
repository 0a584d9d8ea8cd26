// SPDX-License-Identifier: MIT
// The durable row per chunk alone: idem::sqlite::ChunkStore::append_all, 64 chunks of 1..12
// bytes per commit (what examples/ai_chat's generator writes between two commits when the model
// does not pause), into a table of schema version 2 (WITHOUT ROWID keyed by the pair) and into
// one of version 1 (a rowid table with a unique index on the pair, as created before). SQLite
// WAL, synchronous=NORMAL. Interleaved runs, medians of microseconds per chunk (commit
// included). No ratio: bench/stream/README.md uses it to explain sse_stream_dedup_vs_plain.
//
//   idem_bench_chunk_rows [commits per run] [runs] [1 | 2 | both]   (the versions measured)
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "idem/sqlite/stream_store.hpp"

namespace {

struct Row {
  std::uint64_t offset = 0;
  std::string body;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One run on a fresh file. @return microseconds per chunk.
double run(const std::filesystem::path& dir, bool version_one, int commits) {
  const auto path = dir / (version_one ? "v1.sqlite" : "v2.sqlite");
  double us = 0;
  {
    auto db = std::make_shared<idem::sqlite::Database>(path.string());
    if (version_one) {
      db->write([](idem::sqlite::Transaction& tx) {
        tx.exec_script(
            "CREATE TABLE ai_stream_chunk (request_id VARCHAR(128) NOT NULL,"
            " chunk_offset BIGINT NOT NULL CHECK (chunk_offset >= 0), body BLOB NOT NULL,"
            " created_at BIGINT NOT NULL, UNIQUE (request_id, chunk_offset))");
      });
    }
    idem::sqlite::ChunkStore chunks{db};
    if (chunks.schema_version() != (version_one ? 1 : 2)) {
      std::fprintf(stderr, "unexpected schema version %d\n", chunks.schema_version());
      std::exit(1);
    }
    std::vector<Row> batch(64);
    std::uint64_t offset = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < commits; ++c) {
      // A chat of ~10,000 chunks (64 KiB), then the next one.
      const std::string id = "chat_" + std::to_string(10000 + c / 156);
      if (c % 156 == 0) offset = 0;
      for (auto& r : batch) {
        r.offset = offset;
        r.body.assign(1 + offset % 12, 'x');
        offset += r.body.size();
      }
      db->write([&](idem::sqlite::Transaction& tx) { chunks.append_all(tx, id, batch); });
    }
    us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  for (const char* suffix : {"", "-wal", "-shm"}) {
    std::filesystem::remove(path.string() + suffix);
  }
  return us / (commits * 64.0);
}

}  // namespace

int main(int argc, char** argv) {
  const int commits = argc > 1 ? std::atoi(argv[1]) : 1000;
  const int runs = argc > 2 ? std::atoi(argv[2]) : 5;
  const std::string which = argc > 3 ? argv[3] : "both";
  const bool one = which != "2", two = which != "1";
  auto dir = std::filesystem::temp_directory_path() /
             ("idem-bench-chunk-rows-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<double> v1{0}, v2{0};
  if (one) v1.clear();
  if (two) v2.clear();
  for (int r = 0; r < runs; ++r) {
    if (two) v2.push_back(run(dir, false, commits));
    if (one) v1.push_back(run(dir, true, commits));
  }
  std::filesystem::remove_all(dir);
  std::printf(
      "chunk rows, 64 per commit (%d commits x %d interleaved runs): %.2f us per chunk in a "
      "version-2 table, %.2f us in a version-1 table (medians; 0: not measured)\n",
      commits, runs, median(v2), median(v1));
  return 0;
}
