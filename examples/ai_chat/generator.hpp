// SPDX-License-Identifier: MIT
// The simulated model of examples/ai_chat: a deterministic UTF-8 answer per prompt, emitted as
// pieces of 1..max_chunk bytes (cut anywhere, also inside a multi-byte character) and, when
// asked, retried from an earlier offset at other boundaries (overlapping output), as a model
// call that times out and is repeated does.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>

namespace ai_chat {

/// FNV-1a: a seed that is the same in every process and build.
inline std::uint64_t stable_hash(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

/// The answer to `prompt`: at most `length` bytes of valid UTF-8 (ASCII words mixed with two-,
/// three- and four-byte characters), the same for the same prompt and length.
inline std::string answer(std::string_view prompt, std::size_t length) {
  static const char* const kWords[] = {
      "idempotency", "means",  "doing",    "it",    "twice", "is",     "the",         "same",
      "as",          "once",   "Ünïcödé",  "naïve", "café",  "straße", "😀",           "🚀",
      "中文",        "日本語", "Ελληνικά", "—",     "∑",     "π≈3.14", "stream",      "chunk",
      "offset",      "replay", "ÆØÅ",      "¿qué?", "Ω",     "✓",      "👩‍💻", "token"};
  constexpr std::size_t kCount = sizeof kWords / sizeof kWords[0];
  std::mt19937_64 rng(stable_hash(prompt) ^ length);
  std::string out;
  out.reserve(length);
  std::size_t words_in_line = 0;
  for (;;) {
    std::string_view w = kWords[rng() % kCount];
    const char* sep = out.empty() ? "" : (words_in_line >= 12 ? ".\n" : " ");
    std::size_t need = std::char_traits<char>::length(sep) + w.size();
    if (out.size() + need > length) break;
    out += sep;
    out += w;
    words_in_line = words_in_line >= 12 ? 0 : words_in_line + 1;
  }
  return out;
}

/// How the generator cuts and retries.
struct GeneratorOptions {
  /// Pieces are 1..max_chunk bytes. Must be positive.
  std::size_t max_chunk = 12;
  /// Every 20..60 pieces, go back 1..32 bytes and go on from there at other boundaries.
  bool retries = false;
  /// Seeds the cuts and retries (a takeover cuts differently than the first run).
  std::uint64_t seed = 1;
};

/// Emits `answer` as pieces (see the file comment). Pieces view the answer: keep it alive.
class Generator {
 public:
  /// A produced range: `bytes` at `offset`.
  struct Piece {
    std::uint64_t offset;
    std::string_view bytes;
  };

  Generator(std::string_view answer, GeneratorOptions options)
      : answer_(answer), options_(options), rng_(options.seed) {
    options_.max_chunk = std::max<std::size_t>(options_.max_chunk, 1);
    next_retry_ = 20 + rng_() % 41;
  }

  /// The next piece; nullopt when the answer was produced to its end.
  std::optional<Piece> next() {
    if (pos_ >= answer_.size()) return std::nullopt;
    if (options_.retries && --next_retry_ == 0) {
      next_retry_ = 20 + rng_() % 41;
      if (pos_ > 0) {
        pos_ -= std::min<std::size_t>(pos_, 1 + rng_() % 32);
        ++retries_;
      }
    }
    std::size_t n = std::min<std::size_t>(1 + rng_() % options_.max_chunk, answer_.size() - pos_);
    Piece p{pos_, answer_.substr(pos_, n)};
    pos_ += n;
    return p;
  }

  /// Times the generator went back (each re-produces bytes it produced before).
  std::uint64_t retries() const noexcept { return retries_; }

 private:
  std::string_view answer_;
  GeneratorOptions options_;
  std::mt19937_64 rng_;
  std::size_t pos_ = 0;
  std::size_t next_retry_ = 0;
  std::uint64_t retries_ = 0;
};

/// True when a chunk ending before `answer[end]` cuts a multi-byte character.
inline bool splits_character(std::string_view answer, std::uint64_t end) {
  return end < answer.size() && (static_cast<unsigned char>(answer[end]) & 0xC0) == 0x80;
}

}  // namespace ai_chat
