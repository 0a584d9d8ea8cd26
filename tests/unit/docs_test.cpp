// SPDX-License-Identifier: MIT
// The error tables of README.md and docs/observability.md are generated from errors.hpp: this
// test fails (and prints the table to paste) when a code, name, message, status or retryability
// changes.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "idem/errors.hpp"

namespace {

// gRPC's status code names (fixed by the protocol), for the gRPC column.
const char* grpc_code_name(int code) {
  static const char* const kNames[] = {
      "OK",        "CANCELLED",         "UNKNOWN", "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS",    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
      "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : "?";
}

std::string generated_table() {
  std::ostringstream out;
  out << "| code | name | message | HTTP | gRPC | retryable |\n";
  out << "|-----:|------|---------|-----:|------|-----------|\n";
  for (int v = 1;; ++v) {
    auto e = static_cast<idem::errc>(v);
    if (idem::errc_name(e) == "unknown") break;
    int g = idem::grpc_status_code(e);
    out << "| " << v << " | `" << idem::errc_name(e) << "` | " << idem::errc_message(e) << " | "
        << idem::http_status(e) << " | " << g << " " << grpc_code_name(g) << " | "
        << (idem::is_retryable(e) ? "yes" : "no") << " |\n";
  }
  return out.str();
}

std::string doc_table(const std::string& file) {
  std::ifstream in(std::string(IDEM_SOURCE_DIR) + "/" + file);
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
  for (const char* file : {"docs/observability.md", "README.md"}) {
    EXPECT_EQ(expected, doc_table(file))
        << file << " is out of date; paste this between the errc-table markers:\n"
        << expected;
  }
  EXPECT_NE(std::string::npos, expected.find("`invalid_argument`"));  // every code is listed
}

// The quick starts of README.md and docs/http.md post the same request: with the same
// Content-Type (the example's fingerprint covers it, so a copy of one after the other must
// replay, not answer 422) and, for the same key, the same bodies.
TEST(Docs, HttpQuickStartsSendTheSameRequests) {
  auto posts = [](const std::string& file) {
    std::ifstream in(std::string(IDEM_SOURCE_DIR) + "/" + file);
    std::vector<std::string> out;
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("curl ", 0) != 0 || line.find(" -d ") == std::string::npos) continue;
      EXPECT_NE(std::string::npos, line.find("-H 'Content-Type: application/json'"))
          << file << ": " << line;
      auto comment = line.find("   #");
      out.push_back(line.substr(0, comment == std::string::npos ? line.size() : comment));
      while (!out.back().empty() && out.back().back() == ' ') out.back().pop_back();
    }
    return out;
  };
  auto readme = posts("README.md");
  auto http = posts("docs/http.md");
  EXPECT_EQ(4u, readme.size());
  EXPECT_EQ(readme, http);
}

}  // namespace
