// SPDX-License-Identifier: MIT
// idem/version.hpp is kept by hand: it must match project(idem VERSION ...) (passed in as
// IDEM_PROJECT_VERSION), and CHANGELOG.md must have a section for that version.
#include "idem/version.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

namespace {

std::string read(const std::string& file) {
  std::ifstream in(std::string(IDEM_SOURCE_DIR) + "/" + file);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Version, HeaderMatchesTheCMakeProject) {
  EXPECT_STREQ(IDEM_PROJECT_VERSION, IDEM_VERSION_STRING)
      << "update include/idem/version.hpp to project(idem VERSION " << IDEM_PROJECT_VERSION << ")";
  EXPECT_STREQ(IDEM_VERSION_STRING, idem::version());
  std::string parts = std::to_string(IDEM_VERSION_MAJOR) + "." +
                      std::to_string(IDEM_VERSION_MINOR) + "." + std::to_string(IDEM_VERSION_PATCH);
  EXPECT_EQ(parts, IDEM_VERSION_STRING);
  EXPECT_EQ(IDEM_VERSION_MAJOR * 10000 + IDEM_VERSION_MINOR * 100 + IDEM_VERSION_PATCH,
            IDEM_VERSION);
  static_assert(idem::version()[0] != '\0');  // usable in constant expressions
}

TEST(Version, ChangelogHasASectionForIt) {
  std::string log = read("CHANGELOG.md");
  EXPECT_NE(std::string::npos, log.find("\n## Unreleased\n"))
      << "CHANGELOG.md needs an '## Unreleased' section for the next changes";
  EXPECT_NE(std::string::npos, log.find(std::string("\n## ") + IDEM_VERSION_STRING + " - "))
      << "CHANGELOG.md has no '## " << IDEM_VERSION_STRING << " - <date>' section";
}

TEST(Version, LicenseIsTheMitLicenseOfTheSources) {
  std::string license = read("LICENSE");
  EXPECT_EQ(0u, license.find("MIT License"));
  EXPECT_NE(std::string::npos, license.find("The idem authors"));
  // Every source says so too (checked on one file of each kind).
  for (const char* f : {"include/idem/guard.hpp", "src/redis/pool.cpp", "CMakeLists.txt"}) {
    EXPECT_NE(std::string::npos, read(f).find("SPDX-License-Identifier: MIT")) << f;
  }
}

}  // namespace
