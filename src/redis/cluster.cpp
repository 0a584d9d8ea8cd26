// SPDX-License-Identifier: MIT
// Redis Cluster routing: the key hash slot (CRC16/XMODEM), MOVED/ASK replies, and the slot map
// read with CLUSTER SLOTS. (Following the redirects is RedisStore's command loop.)
#include <hiredis/hiredis.h>

#include <array>
#include <charconv>
#include <string>
#include <utility>
#include <vector>

#include "router.hpp"

namespace idem::redis::detail {
namespace {

constexpr std::array<std::uint16_t, 256> make_crc_table() noexcept {
  std::array<std::uint16_t, 256> t{};
  for (unsigned i = 0; i < 256; ++i) {
    unsigned crc = i << 8;
    for (int b = 0; b < 8; ++b) crc = (crc & 0x8000U) != 0 ? (crc << 1) ^ 0x1021U : crc << 1;
    t[i] = static_cast<std::uint16_t>(crc & 0xFFFFU);
  }
  return t;
}
constexpr std::array<std::uint16_t, 256> kCrcTable = make_crc_table();

}  // namespace

std::uint16_t crc16(std::string_view bytes) noexcept {
  unsigned crc = 0;
  for (char ch : bytes) {
    const unsigned byte = static_cast<unsigned char>(ch);
    crc = ((crc << 8) ^ kCrcTable[((crc >> 8) ^ byte) & 0xFFU]) & 0xFFFFU;
  }
  return static_cast<std::uint16_t>(crc);
}

std::uint16_t key_slot(std::string_view key) noexcept {
  const auto open = key.find('{');
  if (open != std::string_view::npos) {
    const auto close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  return static_cast<std::uint16_t>(crc16(key) % kSlotCount);
}

std::optional<Redirect> parse_redirect(std::string_view text) {
  Redirect r;
  if (text.compare(0, 6, "MOVED ") == 0) {
    text.remove_prefix(6);
  } else if (text.compare(0, 4, "ASK ") == 0) {
    r.ask = true;
    text.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  const auto space = text.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  auto [p, ec] = std::from_chars(text.data(), text.data() + space, r.slot);
  if (ec != std::errc() || p != text.data() + space || r.slot < 0 ||
      static_cast<std::size_t>(r.slot) >= kSlotCount) {
    return std::nullopt;
  }
  std::string_view addr = text.substr(space + 1);
  const auto colon = addr.rfind(':');
  if (colon == std::string_view::npos) return std::nullopt;
  std::string_view port = addr.substr(colon + 1);
  auto [q, ec2] = std::from_chars(port.data(), port.data() + port.size(), r.port);
  if (ec2 != std::errc() || q != port.data() + port.size() || r.port <= 0 || r.port > 65535) {
    return std::nullopt;
  }
  std::string_view host = addr.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  r.host = std::string(host);
  return r;
}

// Reads CLUSTER SLOTS from the first node that answers (known nodes, seeds first) and installs
// it. Slots no range names are left as they were (a partial answer never unroutes a slot).
bool Router::refresh_slots() {
  std::vector<Pool*> candidates;
  {
    std::lock_guard<std::mutex> lock(nodes_mutex_);
    for (auto& p : nodes_) candidates.push_back(p.get());
  }
  struct Range {
    long long first, last;
    std::string host;
    int port;
  };
  std::string why;  // what each node answered, when none serves
  for (Pool* node : candidates) {
    std::vector<Range> ranges;
    const std::string where = node->settings().endpoint.display;
    try {
      const char* argv[] = {"CLUSTER", "SLOTS"};
      const std::size_t lens[] = {7, 5};
      ReplyUPtr r = run_command(*node, "CLUSTER SLOTS", 2, argv, lens);
      if (r->type != REDIS_REPLY_ARRAY || r->elements == 0) {  // error, or no slots yet
        why += (why.empty() ? "" : "; ") + where +
               (r->type == REDIS_REPLY_ERROR ? ": " + std::string(r->str, r->len)
                                             : std::string(": no slot assigned yet"));
        continue;
      }
      bool well_formed = true;
      for (std::size_t i = 0; i < r->elements && well_formed; ++i) {
        const redisReply* e = r->element[i];
        well_formed = e->type == REDIS_REPLY_ARRAY && e->elements >= 3 &&
                      e->element[0]->type == REDIS_REPLY_INTEGER &&
                      e->element[1]->type == REDIS_REPLY_INTEGER &&
                      e->element[2]->type == REDIS_REPLY_ARRAY && e->element[2]->elements >= 2 &&
                      e->element[2]->element[0]->type == REDIS_REPLY_STRING &&
                      e->element[2]->element[1]->type == REDIS_REPLY_INTEGER;
        if (!well_formed) break;
        const redisReply* master = e->element[2];
        std::string host(master->element[0]->str, master->element[0]->len);
        // "" or "?": the node does not know its address; it is the one we asked.
        if (host.empty() || host == "?") host = node->settings().endpoint.host;
        ranges.push_back(Range{e->element[0]->integer, e->element[1]->integer, std::move(host),
                               static_cast<int>(master->element[1]->integer)});
      }
      if (!well_formed) {
        why += (why.empty() ? "" : "; ") + where + ": a CLUSTER SLOTS reply idem cannot read";
        continue;
      }
    } catch (const std::exception& e) {
      why += (why.empty() ? "" : "; ") + std::string(e.what());
      continue;  // unreachable: ask the next node
    }
    for (const Range& range : ranges) {
      if (range.first < 0 || range.last >= static_cast<long long>(kSlotCount)) continue;
      Pool* owner = &add_node(range.host, range.port);
      for (long long s = range.first; s <= range.last; ++s) {
        (*slots_)[static_cast<std::size_t>(s)].store(owner, std::memory_order_release);
      }
    }
    return true;
  }
  note_refresh_failure(std::move(why));
  return false;
}

}  // namespace idem::redis::detail
