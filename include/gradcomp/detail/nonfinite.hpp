// gradcomp/detail/nonfinite.hpp: where the first NaN or Inf of a gradient is, at the speed of a
// streaming read (the check every driver makes before any state changes).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <span>

#include <gradcomp/detail/energy.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/simd.hpp>

namespace gradcomp::detail {

// Index of the first NaN or Inf of g, or g.size() when every value is finite. NaN and Inf are
// exactly the keys above that of the largest finite value. The test runs over chunks of
// nonfinite_chunk values with one horizontal reduction each: a check that is almost never
// positive need not stop every 32 values. (Scanning from the back, so that the front of g
// would still be cached for the pass that follows, did not measure faster.)
inline constexpr std::size_t nonfinite_chunk = 1024;

template <class T>
std::size_t first_nonfinite(std::span<const T> g) {
  using S = signed_key_t<T>;
  constexpr S finite_max = finite_key_max<T>;
  const T* p = g.data();
  const std::size_t n = g.size();
  std::size_t i = 0;
#if GRADCOMP_VECTOR_EXTENSIONS
  typedef S v __attribute__((vector_size(16)));
  constexpr std::size_t w = 16 / sizeof(S);
  const v tt = v{} + finite_max;
  const v mm = v{} + static_cast<S>(abs_key_traits<T>::mask);
  for (; i + nonfinite_chunk <= n; i += nonfinite_chunk) {
    v a = {}, b = {};
    for (std::size_t j = 0; j < nonfinite_chunk; j += 2 * w) {
      v x, y;
      std::memcpy(&x, p + i + j, sizeof(v));
      std::memcpy(&y, p + i + j + w, sizeof(v));
      a |= tt - (x & mm);  // negative lanes: key > finite_max
      b |= tt - (y & mm);
    }
    if (any_negative(a | b)) break;  // the scalar loop finds it in this chunk
  }
#endif
  for (; i < n; ++i) {
    if (signed_abs_key(p[i]) > finite_max) return i;
  }
  return n;
}

// first_nonfinite(g) that also gives ||g||^2 in *energy when every value is finite (the
// contraction's denominator where the vector selected from is g itself: no feedback), from the
// same read: partial sums in T lanes over chunks of 256 values, each added in double
// (detail/energy.hpp).
template <class T>
std::size_t first_nonfinite(std::span<const T> g, double* energy) {
  using S = signed_key_t<T>;
  constexpr S finite_max = finite_key_max<T>;
  const T* p = g.data();
  const std::size_t n = g.size();
  *energy = 0.0;
  for (std::size_t i = 0; i < n; i += 256) {
    const std::size_t m = std::min<std::size_t>(256, n - i);
    std::size_t j = 0;
    double chunk = 0.0;
#if GRADCOMP_VECTOR_EXTENSIONS
    using v = typename lanes<T>::type;
    typedef S sv __attribute__((vector_size(16)));
    constexpr std::size_t w = lanes<T>::count;
    const sv tt = sv{} + finite_max;
    const sv mm = sv{} + static_cast<S>(abs_key_traits<T>::mask);
    sv a = {};
    v q0 = {}, q1 = {};
    for (; j + 2 * w <= m; j += 2 * w) {
      v x, y;
      std::memcpy(&x, p + i + j, sizeof(v));
      std::memcpy(&y, p + i + j + w, sizeof(v));
      sv kx, ky;
      std::memcpy(&kx, &x, sizeof(v));
      std::memcpy(&ky, &y, sizeof(v));
      a |= (tt - (kx & mm)) | (tt - (ky & mm));  // negative lanes: key > finite_max
      q0 += x * x;
      q1 += y * y;
    }
    if (any_negative(a)) j = 0;  // the scalar loop finds it in this chunk
    q0 += q1;
    for (std::size_t l = 0; l < w && j > 0; ++l) chunk += static_cast<double>(q0[l]);
#endif
    for (; j < m; ++j) {
      if (signed_abs_key(p[i + j]) > finite_max) return i + j;
      chunk += static_cast<double>(p[i + j]) * static_cast<double>(p[i + j]);
    }
    add_energy(chunk, p + i, m, energy);
  }
  return n;
}

}  // namespace gradcomp::detail
