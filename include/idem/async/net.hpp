// SPDX-License-Identifier: MIT
// Which Asio idem::async is built on: Boost.Asio (the default) or standalone Asio.
//
// File: async/net.hpp
//
// idem's asynchronous layer is written once against `idem::async::net`, a namespace alias:
//
//   * Boost.Asio (`boost::asio`, Debian's libboost-dev 1.74), the default: Boost.Beast, the
//     HTTP and WebSocket library most Asio servers use, only runs on Boost.Asio, and a server's
//     sockets and idem's Redis and PostgreSQL sockets must share one io_context.
//   * standalone Asio (`::asio`, Debian's libasio-dev 1.22) when `IDEM_ASIO_STANDALONE` is
//     defined (CMake: -DIDEM_ASIO_STANDALONE=ON, which defines it for every target linking
//     idem::async). Everything else is the same code.
//
// Per-operation cancellation (cancellation slots, Asio >= 1.19: standalone 1.22, Boost >= 1.77)
// is used where the Asio has it (`IDEM_ASIO_HAS_CANCELLATION_SLOT`); idem's own
// `idem::async::CallOptions::cancel` and deadlines work with every version.
#pragma once

// Before Asio: Boost 1.74's awaitable.hpp (compiled in C++20) uses std::exchange without
// including <utility>.
#include <utility>

#if defined(IDEM_ASIO_STANDALONE)
#include <asio.hpp>
#include <asio/version.hpp>
#define IDEM_ASIO_VERSION ASIO_VERSION
#else
#include <boost/asio.hpp>
#include <boost/asio/version.hpp>
#define IDEM_ASIO_VERSION BOOST_ASIO_VERSION
#endif

#if IDEM_ASIO_VERSION >= 101900
/// Defined when the Asio in use has per-operation cancellation (associated cancellation slots).
#define IDEM_ASIO_HAS_CANCELLATION_SLOT 1
#endif

#if defined(IDEM_ASIO_STANDALONE)
#if defined(ASIO_HAS_CO_AWAIT)
/// Defined when C++20 coroutines (net::awaitable, net::use_awaitable) are available.
#define IDEM_ASIO_HAS_CO_AWAIT 1
#endif
#else
#if defined(BOOST_ASIO_HAS_CO_AWAIT)
#define IDEM_ASIO_HAS_CO_AWAIT 1
#endif
#endif

namespace idem::async {

#if defined(IDEM_ASIO_STANDALONE)
namespace net = ::asio;
/// The error code type of the Asio in use.
using error_code = std::error_code;
#else
namespace net = ::boost::asio;
/// The error code type of the Asio in use.
using error_code = ::boost::system::error_code;
#endif

/// The executor type idem's asynchronous stores run on.
using Executor = net::any_io_executor;

}  // namespace idem::async
