// gradcomp/detail/nonfinite.hpp: where the first NaN or Inf of a gradient is, at the speed of a
// streaming read (the check every driver makes before any state changes).
#pragma once

#include <cstddef>
#include <cstring>
#include <limits>
#include <span>

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

}  // namespace gradcomp::detail
