// SPDX-License-Identifier: MIT
// The shared case table of the stream consumer rules (tests/stream/window_cases.json), run
// against idem::stream::Window and Reassembler. The browser module runs the same table under
// node's test runner (tests/stream/window_cases.test.mjs): both must give the same answers.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "idem/stream.hpp"

namespace {

using idem::stream::Reassembler;
using idem::stream::Window;
using idem::stream::WindowOptions;
using nlohmann::json;

const json& cases() {
  static const json table = [] {
    std::ifstream in(IDEM_STREAM_CASES);
    if (!in) throw std::runtime_error("cannot open " + std::string(IDEM_STREAM_CASES));
    return json::parse(in);
  }();
  return table;
}

WindowOptions options_of(const json& c) {
  WindowOptions o;
  if (!c.contains("options")) return o;
  const json& j = c["options"];
  o.max_pending = j.value("max_pending", o.max_pending);
  o.max_ahead = j.value("max_ahead", o.max_ahead);
  o.max_buffered_bytes = j.value("max_buffered_bytes", o.max_buffered_bytes);
  return o;
}

// The error kind the table names: WindowFull, ChunkOverlap or invalid_argument.
template <class Fn>
std::optional<std::string> thrown_by(Fn&& fn) {
  try {
    fn();
  } catch (const idem::stream::WindowFull&) {
    return "WindowFull";
  } catch (const idem::stream::ChunkOverlap&) {
    return "ChunkOverlap";
  } catch (const idem::UsageError&) {
    return "invalid_argument";
  }
  return std::nullopt;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::string bytes_of(const json& step, const char* text_field, const char* hex_field) {
  if (step.contains(hex_field)) return from_hex(step[hex_field].get<std::string>());
  return step[text_field].get<std::string>();
}

class WindowCases : public ::testing::TestWithParam<std::size_t> {};
class ReassemblerCases : public ::testing::TestWithParam<std::size_t> {};

TEST(StreamCaseTable, HasCasesOfBothKinds) {
  EXPECT_GE(cases()["window"].size(), 10u);
  EXPECT_GE(cases()["reassembler"].size(), 4u);
}

TEST_P(WindowCases, MatchTheTable) {
  const json& c = cases()["window"][GetParam()];
  SCOPED_TRACE(c["name"].get<std::string>());
  const std::uint64_t start = c.value("start", std::uint64_t{0});
  if (c.contains("construct_throws")) {
    EXPECT_EQ(c["construct_throws"].get<std::string>(), thrown_by([&] {
                                                          Window w{options_of(c), start};
                                                        }).value_or("nothing"));
    return;
  }
  Window w{options_of(c), start};
  std::size_t n = 0;
  for (const json& step : c["steps"]) {
    SCOPED_TRACE("step " + std::to_string(n++) + ": " + step.dump());
    if (step.contains("admit")) {
      const json& a = step["admit"];
      idem::stream::Admission got;
      auto err = thrown_by([&] {
        if (a.size() == 1) {
          bool fresh = w.admit(a[0].get<std::uint64_t>());
          got.begin = 0;
          got.end = fresh ? 1 : 0;  // only `fresh` is compared for the unit form
        } else {
          got = w.admit(a[0].get<std::uint64_t>(), a[1].get<std::uint64_t>());
        }
      });
      if (step.contains("throws")) {
        EXPECT_EQ(step["throws"].get<std::string>(), err.value_or("nothing"));
        continue;
      }
      ASSERT_FALSE(err) << *err;
      EXPECT_EQ(step["fresh"].get<bool>(), got.fresh());
      if (a.size() == 2) {
        EXPECT_EQ(step.value("begin", std::uint64_t{0}), got.begin);
        EXPECT_EQ(step.value("end", std::uint64_t{0}), got.end);
        EXPECT_EQ(step.value("whole", false), got.whole);
      }
    } else if (step.contains("seen")) {
      const json& s = step["seen"];
      EXPECT_EQ(step["expect"].get<bool>(),
                w.seen(s[0].get<std::uint64_t>(), s[1].get<std::uint64_t>()));
    } else {
      const json& s = step.at("state");
      if (s.contains("watermark")) {
        EXPECT_EQ(s["watermark"].get<std::uint64_t>(), w.watermark());
      }
      if (s.contains("pending")) {
        EXPECT_EQ(s["pending"].get<std::size_t>(), w.pending());
      }
      if (s.contains("duplicates")) {
        EXPECT_EQ(s["duplicates"].get<std::uint64_t>(), w.duplicates());
      }
    }
  }
}

TEST_P(ReassemblerCases, MatchTheTable) {
  const json& c = cases()["reassembler"][GetParam()];
  SCOPED_TRACE(c["name"].get<std::string>());
  const std::uint64_t start = c.value("start", std::uint64_t{0});
  if (c.contains("construct_throws")) {
    EXPECT_EQ(c["construct_throws"].get<std::string>(), thrown_by([&] {
                                                          Reassembler r{options_of(c), start};
                                                        }).value_or("nothing"));
    return;
  }
  Reassembler r{options_of(c), start};
  std::size_t n = 0;
  for (const json& step : c["steps"]) {
    SCOPED_TRACE("step " + std::to_string(n++) + ": " + step.dump());
    if (step.contains("push")) {
      std::string body = bytes_of(step, "body", "hex");
      std::string out;
      auto err = thrown_by([&] { out = r.push(step["push"].get<std::uint64_t>(), body); });
      if (step.contains("throws")) {
        EXPECT_EQ(step["throws"].get<std::string>(), err.value_or("nothing"));
        continue;
      }
      ASSERT_FALSE(err) << *err;
      EXPECT_EQ(bytes_of(step, "out", "out_hex"), out);
    } else {
      // last_chunk_offset is the browser module's own addition (its Last-Event-ID).
      const json& s = step.at("state");
      if (s.contains("delivered_end")) {
        EXPECT_EQ(s["delivered_end"].get<std::uint64_t>(), r.delivered_end());
      }
      if (s.contains("buffered_bytes")) {
        EXPECT_EQ(s["buffered_bytes"].get<std::size_t>(), r.buffered_bytes());
      }
      if (s.contains("duplicates")) {
        EXPECT_EQ(s["duplicates"].get<std::uint64_t>(), r.duplicates());
      }
      if (s.contains("pending")) {
        EXPECT_EQ(s["pending"].get<std::size_t>(), r.window().pending());
      }
    }
  }
}

std::string case_name(const char* kind, const ::testing::TestParamInfo<std::size_t>& info) {
  return cases()[kind][info.param]["name"].get<std::string>();
}

INSTANTIATE_TEST_SUITE_P(Table, WindowCases,
                         ::testing::Range<std::size_t>(0, cases()["window"].size()),
                         [](const auto& p) { return case_name("window", p); });
INSTANTIATE_TEST_SUITE_P(Table, ReassemblerCases,
                         ::testing::Range<std::size_t>(0, cases()["reassembler"].size()),
                         [](const auto& p) { return case_name("reassembler", p); });

}  // namespace
