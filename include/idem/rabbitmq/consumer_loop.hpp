// SPDX-License-Identifier: MIT
// idem::rabbitmq::ConsumerLoop: RabbitMQ deliveries through an IdempotentConsumer, verdicts
// back to the broker.
//
// File: rabbitmq/consumer_loop.hpp
//
// The glue between QueueConsumer / Publisher (client.hpp) and idem::IdempotentConsumer
// (consumer.hpp), which it uses through its public API only:
//
//   message id       the `message-id` property; else MessageIdRule::header; else
//                    MessageIdRule::build (e.g. business_id_from_headers(): idem::make_message_id
//                    over biz_no / event / version headers); else "" (dead-lettered: no key)
//   delivery count   `x-delivery-count` + 1 where the queue sets it (quorum queues count the
//                    returns before this delivery); else 2 when `redelivered`, else 1. Classic
//                    queues only say "may have been delivered before": not how often, and not
//                    whether the consumer that got it ever read it (it may have died with the
//                    message unread in its socket buffer)
//   verdict          kAck, kAckDuplicate, kDeadLetter -> basic.ack (one multiple ack per batch
//                    when it can; kDeadLetter without a ConsumerOptions::dead_letter sink ->
//                    basic.reject without requeue, to the queue's x-dead-letter-exchange: a
//                    poison message is never dropped silently); kRetryLater -> basic.nack with
//                    requeue, after `retry_delay` (the broker puts a requeued message back at the
//                    head of the queue and delivers it again at once: without the pause a message
//                    held by another consumer would circle between broker and consumers until that
//                    one finishes); kMismatch -> published to the parking destination (confirmed),
//                    then acked; without one, basic.reject without requeue (the queue's own
//                    x-dead-letter-exchange, if any, gets it)
//   dead letters     ConsumerOptions::dead_letter = dead_letter_sink(publisher, destination):
//                    published with confirms (headers x-idem-error, x-idem-attempts,
//                    x-idem-group, x-idem-message-id) before the record is marked failed; if
//                    the publish fails the message stays unacked and comes back
//
// A delivery whose connection is gone cannot be settled (the broker already requeued it):
// settling it does nothing, and its redelivery is answered from the consume record.
//
// @code
//   idem::rabbitmq::Publisher publisher{{}};
//   auto dead = idem::rabbitmq::declare_dead_letters(publisher, "orders");
//   auto parked = idem::rabbitmq::declare_parking(publisher, "orders");
//   idem::ConsumerOptions co;
//   co.dead_letter = idem::rabbitmq::dead_letter_sink(publisher, dead);
//   co.attempts = std::make_shared<idem::sqlite::SqliteAttemptLedger>(durable.shared_database());
//   idem::IdempotentConsumer consumer{guard, "billing", co};
//   idem::rabbitmq::QueueConsumer broker{broker_options};      // queue "orders", prefetch 32
//   idem::rabbitmq::ConsumerLoopOptions lo;
//   lo.park = parked;
//   idem::rabbitmq::ConsumerLoop loop{broker, consumer, lo, &publisher};
//   for (;;) {
//     loop.poll_batch([&](idem::sqlite::Transaction& tx, const idem::rabbitmq::Message& m) {
//       record_payment(tx, m);                                 // commits with the record
//     });
//   }
// @endcode
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/consumer.hpp"
#include "idem/export.hpp"
#include "idem/fingerprint.hpp"
#include "idem/rabbitmq/client.hpp"

namespace idem::rabbitmq {

/// Where a message's global id comes from when its `message-id` property is empty.
struct MessageIdRule {
  /// A header holding the id ("" : none).
  std::string header;
  /// Builds the id from the message when neither is set (may return "", e.g.
  /// business_id_from_headers()). Empty: none.
  std::function<std::string(const Message&)> build;
};

/// A MessageIdRule::build for messages that carry their business number, event type and
/// version in headers: idem::make_message_id(biz_no, event, version), e.g.
/// "order_20001:paid:v3"; "" when a header is missing or a part breaks a key rule.
IDEM_EXPORT std::function<std::string(const Message&)> business_id_from_headers(
    std::string biz_no = "biz_no", std::string event = "event", std::string version = "version");

/// The message's global id: the `message-id` property, else `rule.header`, else
/// `rule.build(m)`, else "".
IDEM_EXPORT std::string message_id_of(const Message& m, const MessageIdRule& rule = {});

/// The broker's delivery count: x-delivery-count + 1 when set (quorum queues), else 2 when
/// flagged redelivered, else 1 (see the file comment for what each can tell).
IDEM_EXPORT std::uint32_t delivery_count_of(const Message& m) noexcept;

/// A dead-letter or parking destination: an exchange and a routing key.
struct Destination {
  /// The exchange ("" is the default exchange: `routing_key` is then a queue name).
  std::string exchange;
  /// The routing key.
  std::string routing_key;
  /// True when neither is set.
  bool empty() const noexcept { return exchange.empty() && routing_key.empty(); }
};

/// Declares a durable direct exchange `<queue>.dlx` and a durable queue `<queue>.dead` bound
/// to it with routing key `<queue>`. Give the exchange to the main queue too
/// (QueueOptions::dead_letter_exchange) and the broker's own dead letters (reject without
/// requeue, delivery limit) land in the same queue. @return {"<queue>.dlx", "<queue>"}.
IDEM_EXPORT Destination declare_dead_letters(Publisher& publisher, std::string_view queue);

/// Declares a durable queue `<queue>.parked` for mismatched messages (same id, another
/// payload: a producer bug for a human to look at). @return {"", "<queue>.parked"}.
IDEM_EXPORT Destination declare_parking(Publisher& publisher, std::string_view queue);

/// A ConsumerOptions::dead_letter sink: publishes the message to `to` with confirms (body =
/// payload; message-id = its id, headers x-idem-error, x-idem-attempts, x-idem-group,
/// x-idem-message-id). Throws what Publisher::publish throws: the consumer then keeps the
/// message with the broker and dead-letters it on a later delivery.
IDEM_EXPORT std::function<void(const DeadLetter&)> dead_letter_sink(Publisher& publisher,
                                                                    Destination to);

/// The deliveries of a batch as idem::Delivery values (it owns their ids and fingerprints).
class IDEM_EXPORT Deliveries {
 public:
  /// Ids by `rule`, fingerprints idem::fingerprint(body), counts delivery_count_of().
  explicit Deliveries(const std::vector<Message>& batch, const MessageIdRule& rule = {});
  Deliveries(const Deliveries&) = delete;
  Deliveries& operator=(const Deliveries&) = delete;
  /// One Delivery per message, in order (views into this object and the batch).
  const std::vector<Delivery>& all() const noexcept { return deliveries_; }
  /// The id of message `i` ("" when it has none).
  const std::string& id(std::size_t i) const { return ids_[i]; }

 private:
  std::vector<std::string> ids_, fingerprints_;
  std::vector<Delivery> deliveries_;
};

/// Options of a ConsumerLoop.
struct ConsumerLoopOptions {
  /// How message ids are found.
  MessageIdRule ids;
  /// Most deliveries per batch (receive's max; no use above the consumer's prefetch).
  std::size_t max_batch = 32;
  /// How long poll waits for a first delivery.
  std::chrono::milliseconds wait{1000};
  /// After the first, how long poll goes on collecting (0: only what already arrived).
  std::chrono::milliseconds linger{0};
  /// How long a kRetryLater delivery is held before it is nacked back to the queue.
  std::chrono::milliseconds retry_delay{200};
  /// Where kMismatch deliveries are published (needs the loop's Publisher); empty: they are
  /// rejected without requeue.
  Destination park;
};

/// Counters of a ConsumerLoop.
struct ConsumerLoopStats {
  std::uint64_t batches = 0;        ///< batches processed
  std::uint64_t acked = 0;          ///< deliveries acked (ack, ack_duplicate, dead_letter, parked)
  std::uint64_t requeued = 0;       ///< deliveries nacked back to the queue (retry_later)
  std::uint64_t parked = 0;         ///< mismatched deliveries published to the parking destination
  std::uint64_t rejected = 0;  ///< rejected without requeue: mismatched (no parking destination),
                               ///< dead-lettered (no ConsumerOptions::dead_letter sink)
  std::uint64_t park_failures = 0;  ///< parking publishes that failed (the delivery was requeued)
  std::uint64_t stale = 0;          ///< settles skipped because the delivery's connection was gone
};

/// Receives from a QueueConsumer, runs an IdempotentConsumer, settles the verdicts (see the
/// file comment). One thread uses a loop; the objects given must outlive it.
///
/// A handler is `void(Transaction&, const Message&)` (transactional: its writes commit with
/// the consume record) or `void(const Message&)` (two-phase, external effects; poll_each only).
template <class Durable>
class IDEM_EXPORT ConsumerLoop {
 public:
  /// @param broker   the queue's consumer
  /// @param consumer the idempotent consumer (its dead_letter sink, see dead_letter_sink())
  /// @param options  ids, batch size, waits, retry delay, parking destination
  /// @param publisher publishes parked messages (needed when options.park is set)
  /// @throws idem::UsageError for max_batch 0, or a parking destination without publisher.
  ConsumerLoop(QueueConsumer& broker, IdempotentConsumer<Durable>& consumer,
               ConsumerLoopOptions options = {}, Publisher* publisher = nullptr)
      : broker_(&broker),
        consumer_(&consumer),
        options_(std::move(options)),
        publisher_(publisher) {
    if (options_.max_batch == 0) throw UsageError("idem::rabbitmq::ConsumerLoop: max_batch is 0");
    if (!options_.park.empty() && publisher_ == nullptr) {
      throw UsageError("idem::rabbitmq::ConsumerLoop: parking needs a Publisher");
    }
  }

  /// Requeues the deliveries still held (requeue_held): none stays unacked on a channel that
  /// outlives the loop, where a prefetch window full of them would stop every later consumer of
  /// that channel. A failure to reach the broker is swallowed (a broken connection returns
  /// them anyway).
  ~ConsumerLoop() {
    try {
      (void)requeue_held();
    } catch (...) {  // the connection is gone: the broker requeues its unacked deliveries
    }
  }
  ConsumerLoop(const ConsumerLoop&) = delete;
  ConsumerLoop& operator=(const ConsumerLoop&) = delete;
  /// Moves the held deliveries along (the moved-from loop holds none).
  ConsumerLoop(ConsumerLoop&&) noexcept = default;
  ConsumerLoop& operator=(ConsumerLoop&&) = delete;

  /// Receives a batch (waiting at most `wait`, less when a held delivery falls due), runs
  /// `handler` for each delivery through consume_batch (one transaction for the batch), settles
  /// the verdicts. @return the deliveries received.
  /// @throws what QueueConsumer::receive and IdempotentConsumer::consume_batch throw (nothing
  ///         of a failed batch is acked: its deliveries are held and requeued after
  ///         `retry_delay` by the next poll, or returned by the broker when the connection
  ///         closes), and a parking failure (after the rest of the batch was settled).
  template <class Fn>
  std::size_t poll_batch(Fn&& handler) {
    auto batch = receive();
    if (!batch.empty()) process_batch(batch, handler);
    return batch.size();
  }

  /// As poll_batch, with one consume() (one transaction) per delivery.
  template <class Fn>
  std::size_t poll_each(Fn&& handler) {
    auto batch = receive();
    if (!batch.empty()) process_each(batch, handler);
    return batch.size();
  }

  /// Receives a batch as poll_* does (flushing due retries first), without processing it.
  std::vector<Message> receive() {
    flush();
    auto wait = options_.wait;
    if (!held_.empty()) {
      const auto until =
          std::chrono::duration_cast<std::chrono::milliseconds>(held_.front().due - Clock::now());
      wait = std::clamp(until, std::chrono::milliseconds(0), wait);
    }
    return broker_->receive(options_.max_batch, wait, options_.linger);
  }

  /// consume_batch over `batch` and settles the verdicts. @return the verdicts, in order.
  template <class Fn>
  std::vector<Verdict> process_batch(const std::vector<Message>& batch, Fn&& handler) {
    using Tx = typename Durable::Transaction;
    static_assert(!std::is_void_v<Tx> && std::is_invocable_v<Fn&, Tx&, const Message&>,
                  "ConsumerLoop::process_batch needs a handler(Transaction&, const Message&)");
    Deliveries d{batch, options_.ids};
    std::vector<Verdict> verdicts;
    try {
      verdicts = consumer_->consume_batch(d.all(),
                                          [&](Tx& tx, std::size_t i) { handler(tx, batch[i]); });
    } catch (...) {
      hold_from(batch, 0);  // no verdict: requeued after retry_delay, never left unacked
      throw;
    }
    settle(batch, d, verdicts);
    return verdicts;
  }

  /// consume() per delivery over `batch` and settles the verdicts. If a store fails midway,
  /// the verdicts so far are settled and the rest held for a requeue (as kRetryLater) before
  /// the error propagates.
  template <class Fn>
  std::vector<Verdict> process_each(const std::vector<Message>& batch, Fn&& handler) {
    using Tx = typename Durable::Transaction;
    Deliveries d{batch, options_.ids};
    std::vector<Verdict> verdicts;
    verdicts.reserve(batch.size());
    try {
      for (std::size_t i = 0; i < batch.size(); ++i) {
        const Message& m = batch[i];
        if constexpr (!std::is_void_v<Tx> && std::is_invocable_v<Fn&, Tx&, const Message&>) {
          verdicts.push_back(consumer_->consume(d.all()[i], [&](Tx& tx) { handler(tx, m); }));
        } else {
          static_assert(std::is_invocable_v<Fn&, const Message&>,
                        "ConsumerLoop: the handler must be callable as handler(Transaction&, "
                        "const Message&) or handler(const Message&)");
          verdicts.push_back(consumer_->consume(d.all()[i], [&] { handler(m); }));
        }
      }
    } catch (...) {
      try {
        settle(batch, d, verdicts);  // the verdicts so far
      } catch (...) {
        // A parking failure: that delivery is held for a requeue; the store's error wins.
      }
      hold_from(batch, verdicts.size());  // the rest: requeued after retry_delay
      throw;
    }
    settle(batch, d, verdicts);
    return verdicts;
  }

  /// Settles `verdicts` (one per message of `batch`, in order, ids from `d`; fewer verdicts
  /// than messages settle a prefix): acks, parks, holds the retries.
  /// @throws a parking failure, after the rest was settled.
  void settle(const std::vector<Message>& batch, const Deliveries& d,
              const std::vector<Verdict>& verdicts) {
    ++stats_.batches;
    std::vector<const Message*> acks;
    std::exception_ptr park_error;
    const auto due = Clock::now() + options_.retry_delay;
    for (std::size_t i = 0; i < verdicts.size(); ++i) {
      const Message& m = batch[i];
      switch (verdicts[i]) {
        case Verdict::kAck:
        case Verdict::kAckDuplicate:
          acks.push_back(&m);
          break;
        case Verdict::kDeadLetter:
          // The consumer's sink has it; without one, the queue's own dead-letter exchange.
          if (consumer_->options().dead_letter) {
            acks.push_back(&m);
          } else {
            reject(m);
          }
          break;
        case Verdict::kRetryLater:
          hold(m, due);
          break;
        case Verdict::kMismatch:
          if (options_.park.empty()) {
            reject(m);
            break;
          }
          try {
            publisher_->publish(park_message(m, d.id(i)));
            ++stats_.parked;
            acks.push_back(&m);
          } catch (...) {
            ++stats_.park_failures;
            if (!park_error) park_error = std::current_exception();
            hold(m, due);
          }
          break;
      }
    }
    const std::size_t acked = broker_->ack(acks);
    stats_.acked += acked;
    stats_.stale += acks.size() - acked;
    if (options_.retry_delay.count() == 0) flush();
    if (park_error) std::rethrow_exception(park_error);
  }

  /// Rejects `m` without requeue: to the queue's x-dead-letter-exchange, if it has one.
  void reject(const Message& m) {
    if (broker_->reject(m, false)) {
      ++stats_.rejected;
    } else {
      ++stats_.stale;
    }
  }

  /// Nacks (requeue) the held retry_later deliveries whose delay has passed.
  void flush() {
    const auto now = Clock::now();
    while (!held_.empty() && held_.front().due <= now) requeue_first_held();
  }

  /// Nacks (requeue) every held delivery now, whether or not its retry delay has passed: what
  /// the destructor does; call it before pausing a loop that keeps its channel open.
  /// @return the deliveries requeued (stale ones, of a closed connection, are only dropped).
  /// @throws what QueueConsumer::nack throws (the deliveries not yet requeued stay held).
  std::size_t requeue_held() {
    std::size_t requeued = 0;
    while (!held_.empty()) requeued += requeue_first_held() ? 1 : 0;
    return requeued;
  }

  /// Deliveries held for a later requeue.
  std::size_t held() const noexcept { return held_.size(); }
  /// The counters.
  const ConsumerLoopStats& stats() const noexcept { return stats_; }
  /// The options in force.
  const ConsumerLoopOptions& options() const noexcept { return options_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Held {
    Message message;  // only its delivery tag and connection are kept
    Clock::time_point due;
  };

  // Nacks (requeue) the first held delivery and forgets it. false: it was stale.
  bool requeue_first_held() {
    const bool requeued = broker_->nack(held_.front().message, true);
    ++(requeued ? stats_.requeued : stats_.stale);
    held_.erase(held_.begin());
    return requeued;
  }

  // Holds batch[from..] for a requeue after retry_delay: deliveries a failed consume left
  // without a verdict. Unacked on a live channel, the broker would return them only when the
  // connection closes, and a prefetch window full of them would stop the consumer.
  void hold_from(const std::vector<Message>& batch, std::size_t from) {
    const auto due = Clock::now() + options_.retry_delay;
    for (std::size_t i = from; i < batch.size(); ++i) hold(batch[i], due);
  }

  void hold(const Message& m, Clock::time_point due) {
    Held h{Message{}, due};
    h.message.delivery_tag = m.delivery_tag;
    h.message.connection = m.connection;
    held_.push_back(std::move(h));  // `due` only grows: the list stays in order
  }

  OutgoingMessage park_message(const Message& m, const std::string& id) const {
    OutgoingMessage out;
    out.exchange = options_.park.exchange;
    out.routing_key = options_.park.routing_key;
    out.message_id = id.empty() ? std::string("(none)") : id;
    out.body = m.body;
    out.content_type = m.content_type;
    out.headers = m.headers;
    out.headers.emplace_back("x-idem-verdict", std::string(verdict_name(Verdict::kMismatch)));
    out.headers.emplace_back("x-idem-group", consumer_->group());
    return out;
  }

  QueueConsumer* broker_;
  IdempotentConsumer<Durable>* consumer_;
  ConsumerLoopOptions options_;
  Publisher* publisher_;
  std::vector<Held> held_;
  ConsumerLoopStats stats_;
};

}  // namespace idem::rabbitmq
