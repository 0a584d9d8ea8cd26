// SPDX-License-Identifier: MIT
// AI chat streaming without duplicated tokens: the generator retries ranges, the server writes
// chunks twice, the transport replays and reorders, and the client still shows every byte once.
//
// Exit status 0 when the reassembled text equals the generated one byte for byte.
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "idem/sqlite/stream_store.hpp"
#include "idem/stream.hpp"

namespace {

struct WireChunk {
  std::uint64_t offset;
  std::string body;
};

// A stand-in for a model: the answer as a sequence of tokens.
std::vector<std::string> generate_tokens() {
  const char* words[] = {"Idempotency", " means", " that", " doing", " it", " twice", " is",
                         " the", " same", " as", " doing", " it", " once", ".", " Ünïcödé",
                         " bytes", " 😀", " pass", " through", " unchanged", ".\n"};
  std::vector<std::string> tokens;
  for (int round = 0; round < 40; ++round) {
    for (const char* w : words) tokens.emplace_back(w);
  }
  return tokens;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    const std::string a = argv[1];
    const bool help = argc == 2 && (a == "--help" || a == "-h");
    std::fprintf(help ? stdout : stderr,
                 "usage: %s (no options: generates a reply, retries and replays its chunks, and\n"
                 "       exits 0 when the client shows every byte once)\n",
                 argv[0]);
    return help ? 0 : 2;
  }
  const std::string request_id = "chat_10001";
  auto tokens = generate_tokens();
  std::string original;
  for (auto& t : tokens) original += t;

  // Durable table (an in-memory database here; a file or PostgreSQL in production).
  auto db = std::make_shared<idem::sqlite::Database>(":memory:");
  idem::sqlite::ChunkStore stored{db};

  // --- server: the generator is retried twice from earlier tokens ------------------------------
  idem::stream::ProducerDedup producer{request_id};
  std::vector<WireChunk> emitted;
  std::mt19937 rng(2024);
  std::size_t next_token = 0;
  std::uint64_t token_offset = 0;  // byte offset of tokens[next_token]
  std::vector<std::uint64_t> offsets_of;  // byte offset of each token
  for (auto& t : tokens) {
    offsets_of.push_back(token_offset);
    token_offset += t.size();
  }
  int retries = 0;
  while (next_token < tokens.size()) {
    // Up to 4 tokens per chunk.
    std::size_t n = std::min<std::size_t>(1 + rng() % 4, tokens.size() - next_token);
    std::string body;
    for (std::size_t i = 0; i < n; ++i) body += tokens[next_token + i];
    if (auto chunk = producer.admit(offsets_of[next_token], body)) {
      emitted.push_back({chunk->offset, std::string(chunk->body)});
      stored.append(request_id, chunk->offset, chunk->body);
      stored.append(request_id, chunk->offset, chunk->body);  // a second writer: stored once
    }
    next_token += n;
    if (retries < 2 && next_token > tokens.size() / (3 - retries)) {
      next_token -= 7;  // the generator restarts 7 tokens back (e.g. after a timeout)
      ++retries;
    }
  }

  // --- transport: replays overlapping ranges of chunks and reorders a few -----------------------
  std::vector<WireChunk> wire;
  for (std::size_t i = 0; i < emitted.size(); ++i) {
    wire.push_back(emitted[i]);
    if (i >= 5 && i % 11 == 0) {  // reconnect: resend the last 5 chunks
      for (std::size_t j = i - 4; j <= i; ++j) wire.push_back(emitted[j]);
    }
  }
  for (std::size_t i = 3; i + 2 < wire.size(); i += 17) std::swap(wire[i], wire[i + 2]);

  // --- client: the window drops what it has, the reassembler restores the order -----------------
  idem::stream::Reassembler client;
  std::string shown;
  for (auto& c : wire) shown += client.push(c.offset, c.body);

  auto resume = stored.resume(request_id);
  std::printf("generated %zu bytes in %zu tokens; producer skipped %llu already-emitted bytes\n",
              original.size(), tokens.size(),
              static_cast<unsigned long long>(producer.duplicate_bytes()));
  std::printf("wire carried %zu chunks for %zu emitted; client dropped %llu duplicates\n",
              wire.size(), emitted.size(),
              static_cast<unsigned long long>(client.duplicates()));
  std::printf("durable table: %llu rows, resumable at offset %llu\n",
              static_cast<unsigned long long>(stored.count(request_id)),
              static_cast<unsigned long long>(resume.next_offset));

  bool ok = shown == original && resume.text == original &&
            stored.count(request_id) == emitted.size() &&
            client.duplicates() == wire.size() - emitted.size();
  std::printf("%s\n", ok ? "reassembled text equals the original byte for byte"
                         : "MISMATCH: reassembled text differs from the original");
  return ok ? 0 : 1;
}
