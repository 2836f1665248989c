// Test inputs: gradients drawn from the distributions the tests sweep (normal and
// heavy-tailed ones, zeros, ties, outliers), reproducible from a seed. The generator is a
// local SplitMix64 so that inputs are identical on every platform and standard library.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <vector>

namespace gradcomp_test {

struct splitmix {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1): never 0, so logs are finite.
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() {
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(2.0 * std::numbers::pi * uniform());
  }
  std::size_t below(std::size_t n) { return static_cast<std::size_t>(next() % n); }
};

enum class dist {
  normal,
  laplace,
  student_t2,
  zeros90,    // 90% exact zeros, the rest normal
  all_equal,  // the same |g| everywhere, alternating signs
  outliers,   // normal background and a few huge values
  ties,       // values from a small set
};

inline constexpr dist all_dists[] = {dist::normal,  dist::laplace,   dist::student_t2,
                                     dist::zeros90, dist::all_equal, dist::outliers,
                                     dist::ties};

// Whether a sweep over distributions runs `d` at `n` elements. Everywhere but in the sanitizer
// builds, every distribution at every size. The asan preset (GRADCOMP_TEST_SANITIZED) builds
// the tests at -O0 with AddressSanitizer, where the sweeps at 2^20 elements and more took
// most of its test time; there those sizes run three distributions of different shape:
// normal (continuous), zeros90 (mostly exact zeros) and ties (a few repeated values), and the
// other four at the smaller sizes of the same sweep. The default preset's build checks all
// seven at every size.
inline bool sweep_runs(dist d, std::size_t n) {
#if defined(GRADCOMP_TEST_SANITIZED)
  if (n >= (std::size_t{1} << 20)) {
    return d == dist::normal || d == dist::zeros90 || d == dist::ties;
  }
#endif
  (void)d;
  (void)n;
  return true;
}

inline const char* name(dist d) {
  switch (d) {
    case dist::normal:
      return "normal";
    case dist::laplace:
      return "laplace";
    case dist::student_t2:
      return "student_t2";
    case dist::zeros90:
      return "zeros90";
    case dist::all_equal:
      return "all_equal";
    case dist::outliers:
      return "outliers";
    case dist::ties:
      return "ties";
  }
  return "?";
}

template <class T>
std::vector<T> make_input(dist d, std::size_t n, std::uint64_t seed = 1) {
  splitmix rng{seed * 0x1234567ULL + static_cast<std::uint64_t>(d)};
  std::vector<T> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    double v = 0.0;
    switch (d) {
      case dist::normal:
        v = rng.normal();
        break;
      case dist::laplace: {
        const double u = rng.uniform() - 0.5;
        v = (u < 0 ? 1.0 : -1.0) * std::log(1.0 - 2.0 * std::fabs(u));
        break;
      }
      case dist::student_t2:
        v = rng.normal() / std::sqrt(-std::log(rng.uniform()));
        break;
      case dist::zeros90:
        v = rng.below(10) == 0 ? rng.normal() : 0.0;
        break;
      case dist::all_equal:
        v = (i % 2 == 0) ? 0.375 : -0.375;
        break;
      case dist::outliers:
        v = rng.normal();
        break;
      case dist::ties:
        v = 0.25 * (static_cast<double>(rng.below(7)) - 3.0);
        break;
    }
    g[i] = static_cast<T>(v);
  }
  if (d == dist::outliers) {
    for (int j = 0; j < 5 && n > 0; ++j) {
      g[rng.below(n)] = static_cast<T>((j % 2 ? -1.0 : 1.0) * 1e30 * (j + 1));
    }
  }
  return g;
}

}  // namespace gradcomp_test
