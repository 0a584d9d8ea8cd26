// SPDX-License-Identifier: MIT
// The version of idem these headers belong to.
//
// Kept in step with `project(idem VERSION ...)` in CMakeLists.txt (a unit test compares them,
// and checks that CHANGELOG.md has a section for it). The rules for what a version number
// promises are in docs/versioning.md.
#pragma once

/// Major version: while it is 0, a new minor version may change the API.
#define IDEM_VERSION_MAJOR 0
/// Minor version.
#define IDEM_VERSION_MINOR 1
/// Patch version: fixes only, API and schemas unchanged.
#define IDEM_VERSION_PATCH 0
/// "MAJOR.MINOR.PATCH".
#define IDEM_VERSION_STRING "0.1.0"
/// One number for preprocessor comparisons: MAJOR * 10000 + MINOR * 100 + PATCH.
#define IDEM_VERSION (IDEM_VERSION_MAJOR * 10000 + IDEM_VERSION_MINOR * 100 + IDEM_VERSION_PATCH)

namespace idem {

/// The version of the idem headers in use, e.g. "0.1.0" (IDEM_VERSION_STRING).
constexpr const char* version() noexcept { return IDEM_VERSION_STRING; }

}  // namespace idem
