// SPDX-License-Identifier: MIT
// The job an asynchronous store's destructor leaves on the store's strand: it closes the store's
// connections when the loop runs it, or, when the loop never does (an io_context stopped and
// then destroyed with the job still queued), when the io_context destroys it. Calls in flight
// keep the store's state alive from inside its connections (their callbacks wait there and
// hold it), so without the second path nothing would release those connections: their sockets
// would stay open until the process exits.
#pragma once

#include <memory>
#include <utility>

namespace idem::async::detail {

/// Posted by a store's destructor: `impl->close()` on the strand, or at the job's destruction if
/// it never ran. Destroying it unrun happens only while its io_context shuts down, when no
/// thread runs the loop, so closing there touches the store from one thread only.
template <class Impl>
class CloseOnStrand {
 public:
  explicit CloseOnStrand(std::shared_ptr<Impl> impl) noexcept : impl_(std::move(impl)) {}
  CloseOnStrand(CloseOnStrand&&) noexcept = default;
  CloseOnStrand& operator=(CloseOnStrand&&) = delete;
  CloseOnStrand(const CloseOnStrand&) = delete;
  CloseOnStrand& operator=(const CloseOnStrand&) = delete;
  ~CloseOnStrand() { close(); }

  void operator()() noexcept { close(); }

 private:
  void close() noexcept {
    std::shared_ptr<Impl> impl = std::move(impl_);
    if (!impl) return;
    try {
      impl->close();
    } catch (...) {  // a callback that failed while being told the store closed: nothing to tell
    }
  }

  std::shared_ptr<Impl> impl_;
};

}  // namespace idem::async::detail
