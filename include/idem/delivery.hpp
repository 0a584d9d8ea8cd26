// SPDX-License-Identifier: MIT
// The vocabulary between a message broker's consumer loop and idem::IdempotentConsumer: a
// Delivery in, a Verdict out, a DeadLetter for the sink.
//
// File: delivery.hpp (idem/consumer.hpp includes it; broker adapters need no more than this)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace idem {

/// What a consumer loop should do with a delivery (see the table in idem/consumer.hpp).
enum class Verdict {
  kAck,           ///< the handler ran now and committed: ack
  kAckDuplicate,  ///< consumed (or dead-lettered) before; nothing ran: ack
  kRetryLater,    ///< in progress elsewhere, or failed with attempts left: do not ack
  kMismatch,      ///< same id, different payload (producer bug): park it, do not ack as done
  kDeadLetter,    ///< poison: handed to the dead-letter sink and recorded as failed: ack
};

/// Stable name: ack, ack_duplicate, retry_later, mismatch, dead_letter.
constexpr std::string_view verdict_name(Verdict v) noexcept {
  switch (v) {
    case Verdict::kAck: return "ack";
    case Verdict::kAckDuplicate: return "ack_duplicate";
    case Verdict::kRetryLater: return "retry_later";
    case Verdict::kMismatch: return "mismatch";
    case Verdict::kDeadLetter: return "dead_letter";
  }
  return "unknown";
}

/// True for the verdicts after which the broker entry may be acked right away (kAck,
/// kAckDuplicate, kDeadLetter). kMismatch is acked only after the message was parked.
constexpr bool should_ack(Verdict v) noexcept {
  return v == Verdict::kAck || v == Verdict::kAckDuplicate || v == Verdict::kDeadLetter;
}

/// One delivery of a message, as the consumer loop got it from the broker. The views are not
/// owned: consume / consume_batch copy the message id (into the key) and the fingerprint
/// before any handler runs, so a handler that rewrites those bytes changes nothing the records
/// store; the payload is read when a message is dead-lettered, so it must stay valid until
/// the call returns.
struct Delivery {
  /// The message's global id (not the broker's entry id): a producer retry keeps it. When the
  /// message has none, build one with idem::make_message_id(biz_no, event_type, version).
  std::string_view message_id;
  /// idem::fingerprint(payload), or "" for no payload check: every delivery of the message then
  /// passes "" (a record stored with "" and a delivery with a fingerprint are a mismatch).
  std::string_view fingerprint;
  /// The payload, handed to the dead-letter sink (may be empty).
  std::string_view payload = {};
  /// The broker's delivery count (1 for a first delivery); above 1 counts as a redelivery.
  std::uint32_t delivery_count = 1;
};

/// A poison message, as the dead-letter sink receives it.
struct DeadLetter {
  /// The consumer group that gave up on the message.
  std::string group;
  /// The message's global id.
  std::string message_id;
  /// The payload as delivered (Delivery::payload).
  std::string payload;
  /// The last failure's what().
  std::string error;
  /// Failed attempts counted (>= max_attempts, or 0 for an invalid message id).
  std::uint32_t attempts = 0;
};

}  // namespace idem
