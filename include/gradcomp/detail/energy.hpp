// gradcomp/detail/energy.hpp: sums of squares (||v||^2, the top-k contraction's denominator)
// added up inside passes that read or write the values anyway: partial sums in 16-byte lanes
// of T over chunks of at most 256 values, each chunk's total added in double, and a chunk
// whose lanes overflowed summed again in double.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>

#include <gradcomp/detail/simd.hpp>

namespace gradcomp::detail {

// The sum of squares of x[0, m) in double, element by element: the exact fallback for a
// chunk whose squares overflowed T's lanes.
template <class T>
inline double squares_in_double(const T* x, std::size_t m) noexcept {
  double s = 0.0;
  for (std::size_t i = 0; i < m; ++i) s += square_unfused(static_cast<double>(x[i]));
  return s;
}

// The squares' partial sums of a chunk of values x[0, m), in T lanes (`lanes` their total),
// added to *energy in double; a chunk whose lanes overflowed (|x| above about 1.8e19 for
// float) is summed again in double from x.
template <class T>
inline void add_energy(double lanes, const T* x, std::size_t m, double* energy) noexcept {
  *energy += std::isfinite(lanes) ? lanes : squares_in_double(x, m);
}

// Adds the sum of squares of x[0, m) to *energy, in chunks of 256 as above: for values that a
// pass has just written and the cache still holds.
template <class T>
inline void add_squares(const T* x, std::size_t m, double* energy) noexcept {
  while (m > 0) {
    const std::size_t c = m < 256 ? m : 256;
    std::size_t i = 0;
    double chunk = 0.0;
#if GRADCOMP_VECTOR_EXTENSIONS
    using v = typename lanes<T>::type;
    constexpr std::size_t w = lanes<T>::count;
    v q0 = {}, q1 = {};
    for (; i + 2 * w <= c; i += 2 * w) {
      v a, b;
      std::memcpy(&a, x + i, sizeof(v));
      std::memcpy(&b, x + i + w, sizeof(v));
      q0 += square_unfused(a);
      q1 += square_unfused(b);
    }
    q0 += q1;
    for (std::size_t j = 0; j < w; ++j) chunk += static_cast<double>(q0[j]);
#endif
    for (; i < c; ++i) chunk += square_unfused(static_cast<double>(x[i]));
    add_energy(chunk, x, c, energy);
    x += c;
    m -= c;
  }
}

}  // namespace gradcomp::detail
