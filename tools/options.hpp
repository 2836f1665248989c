// tools/options.hpp: the command-line numbers of gradcomp's tools, checked one way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace gradcomp_tools {

// The whole of `text` as a finite number in [lo, hi], or nothing (a bad character, trailing
// text, out of range): the one check every numeric option goes through.
inline std::optional<double> whole_number(const std::string& text, double lo, double hi) {
  std::size_t used = 0;
  double v = 0.0;
  try {
    v = std::stod(text, &used);
  } catch (const std::logic_error&) {
    return std::nullopt;
  }
  if (used != text.size() || !std::isfinite(v) || !(v >= lo && v <= hi)) return std::nullopt;
  return v;
}

// The whole of `text` as a whole number in [1, max], for the option named `option`; throws
// std::invalid_argument naming the option and the range otherwise.
inline int parse_count(const char* option, const std::string& text, int max) {
  const auto v = whole_number(text, 1.0, static_cast<double>(max));
  if (!v || *v != std::floor(*v)) {
    throw std::invalid_argument(std::string(option) + ": '" + text + "' is not a count in [1, " +
                                std::to_string(max) + "]");
  }
  return static_cast<int>(*v);
}

// "1048576,25600000" -> {1048576, 25600000}, each a whole number in [1, max] (`range` names
// it in the error); throws std::invalid_argument on anything else.
inline std::vector<std::size_t> parse_sizes(const std::string& list, double max, const char* range) {
  std::vector<std::size_t> out;
  std::size_t at = 0;
  while (at <= list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, comma - at);
    const auto v = whole_number(item, 1.0, max);
    if (!v || *v != std::floor(*v)) {
      throw std::invalid_argument("--sizes: '" + item + "' is not a size in " + range);
    }
    out.push_back(static_cast<std::size_t>(*v));
    at = comma + 1;
  }
  return out;
}

}  // namespace gradcomp_tools
