// gradcomp/exchange/link_median.hpp: several calibrations of one link as one: the lower median of
// each field over the runs, for link_model and link_probe.
// Part of the cost model (exchange/cost_model.hpp includes them all).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/error.hpp>
#include <gradcomp/exchange/measure_link.hpp>

namespace gradcomp {

namespace detail {

// The ((N + 1) / 2)-th smallest of N runs' values of one field (for an even N the lower of the
// two middle ones): always a value one run measured.
template <class T, class V>
V lower_median(std::span<const T> runs, V T::*field) {
  std::vector<V> v;
  v.reserve(runs.size());
  for (const T& r : runs) v.push_back(r.*field);
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>((v.size() - 1) / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

// Refuses an empty list and a value that is not finite and >= 0, naming runs[i].field.
template <class T, class Fields>
void check_runs(std::string_view who, std::span<const T> runs, const Fields& fields) {
  if (runs.empty()) throw_invalid_argument(who, "runs", "an empty list", "at least 1 calibration");
  for (std::size_t i = 0; i < runs.size(); ++i) {
    for (const auto& [name, field] : fields) {
      check_link_value(who, concat("runs[", i, "].", name), static_cast<double>(runs[i].*field));
    }
  }
}

}  // namespace detail

// Several calibrations of one link as one: every field the lower median of its values over the
// runs (the ((N + 1) / 2)-th smallest; for three runs the middle one). A phase in which the
// machine runs slow can move one calibration's costs by 2x (ranks sharing cores; the ring's
// alpha is a mean): the median of three ignores one such run where a least time over them would
// keep the luckiest value of each field. The fields are taken apart, so the result need not be
// any one run, and its alpha need not be max(pair_alpha, the ring's) of the medians. Every run
// must have measured its local costs on the same vector sizes (small_elements,
// large_elements); a value that is not finite and >= 0 is refused, naming runs[i].<field>.
inline link_model median_link(std::span<const link_model> runs) {
  detail::check_runs("median_link", runs, link_model_fields);
  for (std::size_t i = 1; i < runs.size(); ++i) {
    if (runs[i].small_elements != runs[0].small_elements || runs[i].large_elements != runs[0].large_elements) {
      detail::throw_invalid_argument(
          "median_link", detail::concat("runs[", i, "].small_elements, large_elements"),
          detail::concat(runs[i].small_elements, ", ", runs[i].large_elements),
          detail::concat("those of runs[0]: ", runs[0].small_elements, ", ", runs[0].large_elements));
    }
  }
  link_model m = runs[0];
  for (const auto& [name, field] : link_model_fields) m.*field = detail::lower_median(runs, field);
  return m;
}

// The same for what the calibrations measured on the way (link_probe), field by field,
// allreduce_bytes included: measure_link grows the allreduce's message by its timing, so the
// median allreduce_bytes may come from another run than the median allreduce_beta.
inline link_probe median_probe(std::span<const link_probe> runs) {
  static constexpr std::array<std::pair<std::string_view, double link_probe::*>, 5> fields{{
      {"pingpong_alpha", &link_probe::pingpong_alpha},
      {"pingpong_beta", &link_probe::pingpong_beta},
      {"ring_alpha", &link_probe::ring_alpha},
      {"ring_beta", &link_probe::ring_beta},
      {"allreduce_beta", &link_probe::allreduce_beta},
  }};
  detail::check_runs("median_probe", runs, fields);
  link_probe m;
  for (const auto& [name, field] : fields) m.*field = detail::lower_median(runs, field);
  m.allreduce_bytes = detail::lower_median(runs, &link_probe::allreduce_bytes);
  return m;
}

}  // namespace gradcomp
