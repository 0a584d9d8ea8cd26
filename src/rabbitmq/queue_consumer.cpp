// SPDX-License-Identifier: MIT
// idem::rabbitmq::QueueConsumer on rabbitmq-c: basic.consume with manual acks (client.hpp).
#include <amqp.h>
#include <amqp_framing.h>
#include <sys/time.h>

#include <algorithm>
#include <set>

#include "connection.hpp"
#include "errors.hpp"
#include "idem/errors.hpp"
#include "idem/rabbitmq/client.hpp"

namespace idem::rabbitmq {
namespace {

using detail::bytes_of;
using detail::str;
using detail::timeout_until;
using Clock = std::chrono::steady_clock;

// A header value as text, or nullopt for kinds Headers leaves out.
std::optional<std::string> text_of(const amqp_field_value_t& v) {
  switch (v.kind) {
    case AMQP_FIELD_KIND_UTF8:
    case AMQP_FIELD_KIND_BYTES:
      return str(v.value.bytes);
    case AMQP_FIELD_KIND_BOOLEAN:
      return std::string(v.value.boolean ? "true" : "false");
    case AMQP_FIELD_KIND_I8:
      return std::to_string(v.value.i8);
    case AMQP_FIELD_KIND_U8:
      return std::to_string(v.value.u8);
    case AMQP_FIELD_KIND_I16:
      return std::to_string(v.value.i16);
    case AMQP_FIELD_KIND_U16:
      return std::to_string(v.value.u16);
    case AMQP_FIELD_KIND_I32:
      return std::to_string(v.value.i32);
    case AMQP_FIELD_KIND_U32:
      return std::to_string(v.value.u32);
    case AMQP_FIELD_KIND_I64:
      return std::to_string(v.value.i64);
    case AMQP_FIELD_KIND_U64:
    case AMQP_FIELD_KIND_TIMESTAMP:
      return std::to_string(v.value.u64);
    default:
      return std::nullopt;
  }
}

Message to_message(const amqp_envelope_t& env, std::uint64_t connection) {
  Message m;
  m.body = str(env.message.body);
  const amqp_basic_properties_t& p = env.message.properties;
  if (p._flags & AMQP_BASIC_MESSAGE_ID_FLAG) m.message_id = str(p.message_id);
  if (p._flags & AMQP_BASIC_CONTENT_TYPE_FLAG) m.content_type = str(p.content_type);
  if (p._flags & AMQP_BASIC_HEADERS_FLAG) {
    for (int i = 0; i < p.headers.num_entries; ++i) {
      const amqp_table_entry_t& e = p.headers.entries[i];
      auto value = text_of(e.value);
      if (!value) continue;
      std::string key = str(e.key);
      if (key == "x-delivery-count") {
        try {
          m.x_delivery_count = std::stoull(*value);
        } catch (const std::exception&) {
        }
      }
      m.headers.emplace_back(std::move(key), std::move(*value));
    }
  }
  m.exchange = str(env.exchange);
  m.routing_key = str(env.routing_key);
  m.redelivered = env.redelivered != 0;
  m.delivery_tag = env.delivery_tag;
  m.connection = connection;
  return m;
}

}  // namespace

class IDEM_LOCAL QueueConsumer::Impl {
 public:
  explicit Impl(QueueConsumerOptions options)
      : options_(std::move(options)), conn_(options_.connection, "QueueConsumer") {
    detail::validate(options_.queue);
    if (options_.prefetch == 0) {
      throw UsageError("idem::rabbitmq::QueueConsumer: prefetch must be positive");
    }
    conn_.set_setup([this] { setup(); });
  }

  void connect() {
    auto lock = conn_.lock();
    conn_.ensure(lock, options_.connection.reconnect_backoff_max);
  }

  std::vector<Message> receive(std::size_t max, std::chrono::milliseconds wait,
                               std::chrono::milliseconds linger) {
    if (max == 0) throw UsageError("idem::rabbitmq::QueueConsumer: receive max must be positive");
    const auto first_deadline = Clock::now() + wait;
    auto lock = conn_.lock();
    conn_.ensure(lock, wait);
    sync_unsettled();
    std::vector<Message> out;
    Clock::time_point linger_deadline{};
    const std::string what = "basic.consume " + options_.queue.name;
    while (out.size() < max) {
      const Clock::time_point deadline =
          out.empty() ? first_deadline : (linger.count() > 0 ? linger_deadline : Clock::now());
      timeval tv = timeout_until(deadline);
      amqp_connection_state_t st = conn_.state();
      amqp_maybe_release_buffers(st);
      amqp_envelope_t env;
      amqp_rpc_reply_t r = amqp_consume_message(st, &env, &tv, 0);
      if (r.reply_type == AMQP_RESPONSE_NORMAL) {
        if (env.channel == conn_.channel()) {
          out.push_back(to_message(env, conn_.id()));
          unsettled_.insert(env.delivery_tag);
          ++deliveries_;
          if (env.redelivered) ++redelivered_;
          if (out.size() == 1) linger_deadline = Clock::now() + linger;
        }
        amqp_destroy_envelope(&env);
        continue;
      }
      if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
          r.library_error == AMQP_STATUS_TIMEOUT) {
        break;
      }
      if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION &&
          r.library_error == AMQP_STATUS_UNEXPECTED_STATE) {
        other_frame(what);
        continue;
      }
      conn_.check(r, what);  // throws
    }
    conn_.touched();
    return out;
  }

  bool settle(const Message& m, int kind, bool requeue) {
    auto lock = conn_.lock();
    if (!current(m)) {
      ++stale_settles_;
      return false;
    }
    amqp_connection_state_t st = conn_.state();
    int rc = AMQP_STATUS_OK;
    switch (kind) {
      case 0:
        rc = amqp_basic_ack(st, conn_.channel(), m.delivery_tag, 0);
        break;
      case 1:
        rc = amqp_basic_nack(st, conn_.channel(), m.delivery_tag, 0, requeue ? 1 : 0);
        break;
      default:
        rc = amqp_basic_reject(st, conn_.channel(), m.delivery_tag, requeue ? 1 : 0);
        break;
    }
    conn_.touched();
    if (rc != AMQP_STATUS_OK) {
      conn_.drop();  // the broker returns the connection's unacked deliveries to the queue
      return false;
    }
    unsettled_.erase(m.delivery_tag);
    (kind == 0 ? acked_ : kind == 1 ? nacked_ : rejected_) += 1;
    return true;
  }

  std::size_t ack(const std::vector<const Message*>& messages) {
    auto lock = conn_.lock();
    std::vector<std::uint64_t> tags;
    for (const Message* m : messages) {
      if (m != nullptr && current(*m)) {
        tags.push_back(m->delivery_tag);
      } else {
        ++stale_settles_;
      }
    }
    if (tags.empty()) return 0;
    std::sort(tags.begin(), tags.end());
    tags.erase(std::unique(tags.begin(), tags.end()), tags.end());
    amqp_connection_state_t st = conn_.state();
    // One multiple ack when the tags are every unsettled delivery up to the last of them.
    const auto upto = unsettled_.upper_bound(tags.back());
    const auto below = static_cast<std::size_t>(std::distance(unsettled_.begin(), upto));
    bool ok = true;
    if (below == tags.size()) {
      ok = amqp_basic_ack(st, conn_.channel(), tags.back(), 1) == AMQP_STATUS_OK;
      if (ok) unsettled_.erase(unsettled_.begin(), upto);
    } else {
      for (std::uint64_t t : tags) {
        if (amqp_basic_ack(st, conn_.channel(), t, 0) != AMQP_STATUS_OK) {
          ok = false;
          break;
        }
        unsettled_.erase(t);
      }
    }
    conn_.touched();
    if (!ok) {
      conn_.drop();
      return 0;
    }
    acked_ += tags.size();
    return tags.size();
  }

  void keep_alive() {
    auto lock = conn_.lock();
    conn_.heartbeat_if_due();
  }

  std::uint64_t connection() {
    auto lock = conn_.lock();
    return conn_.id();
  }

  std::size_t unsettled() {
    auto lock = conn_.lock();
    sync_unsettled();
    return unsettled_.size();
  }

  void close() {
    auto lock = conn_.lock();
    conn_.close();
    sync_unsettled();
  }

  QueueConsumerStats stats() {
    auto lock = conn_.lock();
    QueueConsumerStats s;
    s.connection = conn_.stats();
    s.deliveries = deliveries_;
    s.redelivered = redelivered_;
    s.acked = acked_;
    s.nacked = nacked_;
    s.rejected = rejected_;
    s.stale_settles = stale_settles_;
    return s;
  }

  const QueueConsumerOptions& options() const noexcept { return options_; }

 private:
  // On every new connection: the queue, the prefetch window, the subscription.
  void setup() {
    detail::declare_queue(conn_, options_.queue);
    amqp_basic_qos(conn_.state(), conn_.channel(), 0, options_.prefetch, 0);
    conn_.check_last("basic.qos");
    amqp_basic_consume(conn_.state(), conn_.channel(), bytes_of(options_.queue.name),
                       bytes_of(options_.consumer_tag), 0, 0, 0, amqp_empty_table);
    conn_.check_last("basic.consume " + options_.queue.name);
  }

  bool current(const Message& m) const noexcept {
    return conn_.live() && m.connection == conn_.id();
  }

  // Deliveries of a connection that is gone were returned to the queue by the broker.
  void sync_unsettled() {
    if (unsettled_connection_ != conn_.id()) {
      unsettled_.clear();
      unsettled_connection_ = conn_.id();
    }
  }

  // A frame other than basic.deliver while consuming.
  void other_frame(std::string_view what) {
    amqp_frame_t frame;
    const int rc = amqp_simple_wait_frame(conn_.state(), &frame);
    if (rc != AMQP_STATUS_OK) conn_.fail_status(rc, what);
    if (frame.frame_type != AMQP_FRAME_METHOD) return;
    conn_.fail_if_closed(frame.payload.method, what);
    if (frame.payload.method.id == AMQP_BASIC_CANCEL_METHOD) {
      // The broker ended the subscription (the queue was deleted, or its leader moved).
      conn_.drop();
      detail::throw_error(detail::Failure{detail::Failure::Kind::kServer, what,
                                          "consumer cancelled by the broker", 0, 320});
    }
  }

  QueueConsumerOptions options_;
  detail::Connection conn_;
  std::set<std::uint64_t> unsettled_;
  std::uint64_t unsettled_connection_ = 0;
  std::uint64_t deliveries_ = 0, redelivered_ = 0, acked_ = 0, nacked_ = 0, rejected_ = 0,
                stale_settles_ = 0;
};

QueueConsumer::QueueConsumer(QueueConsumerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
QueueConsumer::~QueueConsumer() = default;
QueueConsumer::QueueConsumer(QueueConsumer&&) noexcept = default;
QueueConsumer& QueueConsumer::operator=(QueueConsumer&&) noexcept = default;

void QueueConsumer::connect() { impl_->connect(); }
std::vector<Message> QueueConsumer::receive(std::size_t max, std::chrono::milliseconds wait,
                                            std::chrono::milliseconds linger) {
  return impl_->receive(max, wait, linger);
}
bool QueueConsumer::ack(const Message& m) { return impl_->settle(m, 0, false); }
std::size_t QueueConsumer::ack(const std::vector<const Message*>& messages) {
  return impl_->ack(messages);
}
bool QueueConsumer::nack(const Message& m, bool requeue) { return impl_->settle(m, 1, requeue); }
bool QueueConsumer::reject(const Message& m, bool requeue) { return impl_->settle(m, 2, requeue); }
void QueueConsumer::keep_alive() { impl_->keep_alive(); }
std::uint64_t QueueConsumer::connection() const { return impl_->connection(); }
std::size_t QueueConsumer::unsettled() const { return impl_->unsettled(); }
void QueueConsumer::close() { impl_->close(); }
QueueConsumerStats QueueConsumer::stats() const { return impl_->stats(); }
const QueueConsumerOptions& QueueConsumer::options() const noexcept { return impl_->options(); }

}  // namespace idem::rabbitmq
