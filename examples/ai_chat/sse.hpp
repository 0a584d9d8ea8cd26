// SPDX-License-Identifier: MIT
// Server-sent events of examples/ai_chat: one event per chunk,
//
//   id: chat_10001_10        <request_id>_<offset of the chunk's first byte>
//   event: chunk
//   data: <base64 of the chunk's bytes>
//
// and a final `event: done` with `data: {"length": N}`. The body is base64 because an event is
// UTF-8 text and a chunk may end inside a multi-byte character; the browser decodes the bytes
// once they are contiguous (web/chat_stream.js).
#pragma once

#include <openssl/evp.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ai_chat {

/// Appends the base64 (RFC 4648, padded) of `bytes` to `out`.
inline void append_base64(std::string& out, std::string_view bytes) {
  const std::size_t at = out.size();
  out.resize(at + 4 * ((bytes.size() + 2) / 3) + 1);
  int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(&out[at]),
                          reinterpret_cast<const unsigned char*>(bytes.data()),
                          static_cast<int>(bytes.size()));
  out.resize(at + static_cast<std::size_t>(n));
}

/// Appends the event of the chunk `body` at `offset` of `request_id`.
inline void append_chunk_event(std::string& out, std::string_view request_id, std::uint64_t offset,
                               std::string_view body) {
  out.append("id: ").append(request_id).append(1, '_').append(std::to_string(offset));
  out.append("\nevent: chunk\ndata: ");
  append_base64(out, body);
  out.append("\n\n");
}

/// Appends the final event of an answer of `length` bytes.
inline void append_done_event(std::string& out, std::uint64_t length) {
  out.append("event: done\ndata: {\"length\":").append(std::to_string(length)).append("}\n\n");
}

/// The offset a Last-Event-ID `<request_id>_<offset>` names; nullopt when it names another
/// stream or is malformed.
inline std::optional<std::uint64_t> parse_last_event_id(std::string_view request_id,
                                                        std::string_view id) {
  if (id.size() <= request_id.size() + 1 || id.substr(0, request_id.size()) != request_id ||
      id[request_id.size()] != '_') {
    return std::nullopt;
  }
  std::string_view digits = id.substr(request_id.size() + 1);
  if (digits.size() > 18) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v;
}

}  // namespace ai_chat
