// SPDX-License-Identifier: MIT
// docs/observability.md's error table is generated from errors.hpp: this test fails (and prints
// the table to paste) when a code, name, message, status or retryability changes.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "idem/errors.hpp"

namespace {

std::string generated_table() {
  std::ostringstream out;
  out << "| code | name | message | HTTP | retryable |\n";
  out << "|-----:|------|---------|-----:|-----------|\n";
  for (int v = 1;; ++v) {
    auto e = static_cast<idem::errc>(v);
    if (idem::errc_name(e) == "unknown") break;
    out << "| " << v << " | `" << idem::errc_name(e) << "` | " << idem::errc_message(e) << " | "
        << idem::http_status(e) << " | " << (idem::is_retryable(e) ? "yes" : "no") << " |\n";
  }
  return out.str();
}

std::string doc_table() {
  std::ifstream in(IDEM_SOURCE_DIR "/docs/observability.md");
  std::string line, table;
  bool inside = false;
  while (std::getline(in, line)) {
    if (line.rfind("<!-- errc-table:begin", 0) == 0) {
      inside = true;
      continue;
    }
    if (line.rfind("<!-- errc-table:end", 0) == 0) break;
    if (inside) table += line + "\n";
  }
  return table;
}

TEST(Docs, ErrorTableMatchesErrorsHpp) {
  std::string expected = generated_table();
  EXPECT_EQ(expected, doc_table())
      << "docs/observability.md is out of date; paste this between the errc-table markers:\n"
      << expected;
  EXPECT_NE(std::string::npos, expected.find("`invalid_argument`"));  // every code is listed
}

}  // namespace
