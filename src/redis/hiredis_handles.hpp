// SPDX-License-Identifier: MIT
// RAII owners of hiredis handles (a context, a reply), so no path leaks or double-frees one.
#pragma once

#include <hiredis/hiredis.h>

#include <memory>

namespace idem::redis::detail {

/// Frees a redisContext (closes its socket).
struct ContextDeleter {
  void operator()(redisContext* c) const noexcept {
    if (c != nullptr) redisFree(c);
  }
};
/// An owned connection handle.
using ContextUPtr = std::unique_ptr<redisContext, ContextDeleter>;

/// Frees a reply tree.
struct ReplyDeleter {
  void operator()(redisReply* r) const noexcept {
    if (r != nullptr) freeReplyObject(r);
  }
};
/// An owned reply.
using ReplyUPtr = std::unique_ptr<redisReply, ReplyDeleter>;

}  // namespace idem::redis::detail
