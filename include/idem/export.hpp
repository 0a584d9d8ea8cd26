// SPDX-License-Identifier: MIT
// Symbol visibility of idem's compiled libraries.
//
// idem's libraries are compiled with hidden visibility (-fvisibility=hidden), so a shared build
// (BUILD_SHARED_LIBS=ON) exports only what is marked IDEM_EXPORT: the public classes and
// functions the headers declare and the libraries define. Everything else (the `detail`
// helpers, each class's `Impl`, the copies of header-only code) stays inside the library.
// Marking a declaration changes nothing for a static build.
//
// Also where a build that cannot compile idem is told why, first: idem needs C++17,
// exceptions (every failure it reports is thrown) and RTTI (failures are told apart by type).
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201703L
#error "idem needs C++17 or later (-std=c++17)"
#endif
#if !defined(__cpp_exceptions) && !defined(__EXCEPTIONS) && !defined(_CPPUNWIND)
#error "idem needs exceptions: it reports every failure by throwing (remove -fno-exceptions)"
#endif
#if !defined(__cpp_rtti) && !defined(__GXX_RTTI) && !defined(_CPPRTTI)
#error "idem needs RTTI: it tells failures apart with dynamic_cast (remove -fno-rtti)"
#endif

#if defined(__GNUC__) || defined(__clang__)
/// Exported from idem's shared libraries (default visibility).
#define IDEM_EXPORT __attribute__((visibility("default")))
/// Kept inside the library that defines it, even when its enclosing class is exported (used
/// on the definitions of `Impl` classes).
#define IDEM_LOCAL __attribute__((visibility("hidden")))
#else
#define IDEM_EXPORT
#define IDEM_LOCAL
#endif
