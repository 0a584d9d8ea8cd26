// SPDX-License-Identifier: MIT
// Shared by the package consumers: a check that prints what failed.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <idem/errors.hpp>
#include <idem/version.hpp>

#define CONSUMER_CHECK(cond)                                                        \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

// The headers' version is the package's (IDEM_PACKAGE_VERSION: idem_VERSION from
// find_package, or `pkg-config --modversion`).
inline void check_version() {
#ifdef IDEM_PACKAGE_VERSION
  CONSUMER_CHECK(std::strcmp(idem::version(), IDEM_PACKAGE_VERSION) == 0);
#endif
}

// An error thrown inside an idem library keeps its idem::errc when caught here (in a shared
// build this crosses a library boundary: one error category for both sides).
inline void check_typed(const idem::Error& e, idem::errc expected) {
  CONSUMER_CHECK(e.code() == expected);
  CONSUMER_CHECK(e.error_code() == idem::make_error_code(expected));
  CONSUMER_CHECK(std::strcmp(e.error_code().category().name(), "idem") == 0);
}
