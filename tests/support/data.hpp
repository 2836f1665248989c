// Test inputs: gradients drawn from the distributions the tests sweep (normal and
// heavy-tailed ones, zeros, ties, outliers), reproducible from a seed.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string_view>
#include <vector>

namespace gradcomp::test {

enum class dist { normal, laplace, student_t2, mostly_zero, all_equal, outliers, ties };

inline constexpr dist all_dists[] = {dist::normal,    dist::laplace,  dist::student_t2,
                                     dist::mostly_zero, dist::all_equal, dist::outliers,
                                     dist::ties};

inline std::string_view name(dist d) {
  switch (d) {
    case dist::normal: return "normal";
    case dist::laplace: return "laplace";
    case dist::student_t2: return "student_t2";
    case dist::mostly_zero: return "90%_zero";
    case dist::all_equal: return "all_equal";
    case dist::outliers: return "outliers";
    case dist::ties: return "ties";
  }
  return "?";
}

template <class T = float>
std::vector<T> make_gradient(std::size_t n, dist d, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::exponential_distribution<double> expo(1.0);
  std::student_t_distribution<double> student(2.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<T> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    double x = 0.0;
    switch (d) {
      case dist::normal: x = normal(rng); break;
      case dist::laplace: x = (unit(rng) < 0.5 ? -1.0 : 1.0) * expo(rng); break;
      case dist::student_t2: x = student(rng); break;
      case dist::mostly_zero: x = unit(rng) < 0.9 ? 0.0 : normal(rng); break;
      case dist::all_equal: x = 0.5; break;
      case dist::outliers: x = normal(rng) * 1e-3; break;
      case dist::ties: x = static_cast<double>(static_cast<int>(unit(rng) * 7.0) - 3) * 0.25; break;
    }
    g[i] = static_cast<T>(x);
  }
  if (d == dist::outliers && n > 0) {
    for (std::size_t j = 0; j < 5; ++j) g[(j * 7919 + 13) % n] = static_cast<T>((j % 2 ? -1 : 1) * 1e6 * (j + 1));
  }
  return g;
}

}  // namespace gradcomp::test
