// Helpers shared by the quantizer tests: the payload a caller prepares before encode(),
// reproducible normal values, and the Bernstein bound used by the unbiasedness tests.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include <gradcomp/sparse.hpp>

namespace gradcomp_test {

// What the caller sets before encode: a dense payload of n values.
inline gradcomp::payload blank(std::size_t n) {
  gradcomp::payload p;
  p.dense_size = n;
  p.layout = gradcomp::index_layout::dense;
  p.count = static_cast<std::uint32_t>(n);
  return p;
}

inline std::vector<float> normal_values(std::size_t n, std::uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Deviation t such that the mean of m independent samples, each within `range` of its
// expectation and with variance `var`, is off by more than t with probability below 1e-12
// (Bernstein's inequality).
inline double bernstein_bound(double var, double range, std::size_t m) {
  const double l = std::log(2.0 / 1e-12);
  const double md = static_cast<double>(m);
  return (l * range / 3.0 + std::sqrt(l * range / 3.0 * (l * range / 3.0) + 2.0 * md * l * var)) /
         md;
}

}  // namespace gradcomp_test
