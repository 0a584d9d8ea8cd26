// SPDX-License-Identifier: MIT
// The one place where rabbitmq-c and broker failures become idem exceptions.
#pragma once

#include <string_view>

namespace idem::rabbitmq::detail {

/// What went wrong, as the client saw it. Nothing of rabbitmq-c leaves errors.cpp but numbers
/// and messages.
struct Failure {
  enum class Kind {
    kLibrary,      ///< rabbitmq-c returned an amqp_status_enum (`status`)
    kServer,       ///< the broker closed the channel or connection (`reply_code`, `message`)
    kBackoff,      ///< not connected, and the reconnect backoff has not passed (`message`)
    kUnroutable,   ///< a mandatory publish came back (`reply_code` 312, `message`)
    kUnconfirmed,  ///< publishes were sent and never confirmed (`message`: the last failure)
    kProtocol,     ///< a reply the client does not expect
  };
  Kind kind;
  std::string_view context;      ///< what was being done, e.g. "basic.consume orders"
  std::string_view message;      ///< the broker's reply text, or detail
  int status = 0;                ///< kLibrary: the amqp_status_enum value
  int reply_code = 0;            ///< kServer / kUnroutable: AMQP reply code (320, 404, ...)
  bool write_may_apply = false;  ///< a lost answer may leave the write applied (OutcomeUnknown)
};

/// Throws the idem exception for `f`: StorageUnavailable, StorageTimeout, OutcomeUnknown or
/// StorageError, with the context and the broker's or library's message in what().
[[noreturn]] void throw_error(const Failure& f);

/// True when a broker close means "try again (on a new channel)": 320 connection-forced (the
/// broker is shutting down); 406 PRECONDITION_FAILED for a delivery held past the broker's
/// consumer_timeout ("delivery acknowledgement ... timed out": the broker requeued it) or an
/// ack of a delivery tag the channel does not know (the new channel starts clean). Other 406s
/// (a queue declared again with other arguments) and 505/506 frame or resource errors are not.
bool transient_reply(int reply_code, std::string_view reply_text) noexcept;

}  // namespace idem::rabbitmq::detail
