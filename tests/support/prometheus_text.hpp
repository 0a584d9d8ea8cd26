// SPDX-License-Identifier: MIT
// Reads values out of Prometheus text exposition (for metric tests and /metrics scrapes).
#pragma once

#include <map>
#include <optional>
#include <sstream>
#include <string>

namespace idem::test {

/// The value of the series `name` whose labels include every pair of `labels` (other labels
/// are ignored), summed over all matching series; nullopt when no series matches.
inline std::optional<double> metric_value(const std::string& text, const std::string& name,
                                          const std::map<std::string, std::string>& labels = {}) {
  std::istringstream in(text);
  std::string line;
  std::optional<double> sum;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    auto brace = line.find('{');
    auto space = line.rfind(' ');
    if (space == std::string::npos) continue;
    std::string series = line.substr(0, brace == std::string::npos ? space : brace);
    if (series != name) continue;
    std::map<std::string, std::string> found;
    if (brace != std::string::npos) {
      auto close = line.find('}', brace);
      std::string body = line.substr(brace + 1, close - brace - 1);
      std::size_t pos = 0;
      while (pos < body.size()) {
        auto eq = body.find('=', pos);
        auto q1 = body.find('"', eq);
        auto q2 = body.find('"', q1 + 1);
        found[body.substr(pos, eq - pos)] = body.substr(q1 + 1, q2 - q1 - 1);
        pos = body.find(',', q2);
        if (pos == std::string::npos) break;
        ++pos;
      }
    }
    bool match = true;
    for (auto& [k, v] : labels) {
      auto it = found.find(k);
      if (it == found.end() || it->second != v) match = false;
    }
    if (!match) continue;
    sum = sum.value_or(0.0) + std::stod(line.substr(space + 1));
  }
  return sum;
}

}  // namespace idem::test
