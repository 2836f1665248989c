// gradcomp/detail/moments.hpp: the one-pass statistics of the threshold selectors: mean and
// standard deviation of g (Gaussian-k), mean and maximum of |g| (RedSync).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>

#include <gradcomp/detail/select_common.hpp>

namespace gradcomp::detail {

struct mean_sd {
  double mean = 0.0;
  double sd = 0.0;
};

struct mean_max_abs {
  double mean = 0.0;  // mean |g|
  double max = 0.0;   // max |g|; NaN if g holds a NaN
};

// Partial sums run over chunks of this many elements in 16-byte lanes of T, and the chunk
// totals are added in double: each lane sums only a few dozen values in T before its total
// moves to double, so for float the relative error stays near 1e-7 instead of growing with n,
// at the speed of float arithmetic. The plain double loops cannot be vectorised (reordering
// double additions is not allowed) and GCC keeps array accumulators in memory at -O2; vector
// types avoid both (see GRADCOMP_VECTOR_EXTENSIONS in select_common.hpp).
inline constexpr std::size_t moments_chunk = 256;

#if GRADCOMP_VECTOR_EXTENSIONS
template <class T>
struct lanes {
  typedef T type __attribute__((vector_size(16)));
  static constexpr std::size_t count = 16 / sizeof(T);
};
#endif

// Reference loops in double, also the fallback when T arithmetic overflowed (values beyond
// about 1e19 squared in float).
template <class T>
mean_sd mean_and_sd_double(std::span<const T> g) {
  const std::size_t n = g.size();
  if (n == 0) return {};
  const double shift = static_cast<double>(g[0]);
  double s1[4] = {};
  double s2[4] = {};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (std::size_t j = 0; j < 4; ++j) {
      const double d = static_cast<double>(g[i + j]) - shift;
      s1[j] += d;
      s2[j] += d * d;
    }
  }
  for (; i < n; ++i) {
    const double d = static_cast<double>(g[i]) - shift;
    s1[0] += d;
    s2[0] += d * d;
  }
  const double sum = (s1[0] + s1[1]) + (s1[2] + s1[3]);
  const double sq = (s2[0] + s2[1]) + (s2[2] + s2[3]);
  const double nd = static_cast<double>(n);
  return {shift + sum / nd, std::sqrt(std::max((sq - sum * sum / nd) / nd, 0.0))};
}

// Mean and population standard deviation. Values are shifted by g[0] before squaring so that
// a large common offset does not cancel the variance away.
template <class T>
mean_sd mean_and_sd(std::span<const T> g) {
#if GRADCOMP_VECTOR_EXTENSIONS
  using v = typename lanes<T>::type;
  constexpr std::size_t w = lanes<T>::count;
  const std::size_t n = g.size();
  if (n == 0) return {};
  const T* p = g.data();
  const T shift = p[0];
  v sh;
  for (std::size_t j = 0; j < w; ++j) sh[j] = shift;
  double sum = 0.0;
  double sq = 0.0;
  std::size_t i = 0;
  for (; i + moments_chunk <= n; i += moments_chunk) {
    v a = {}, b = {}, c = {}, d = {};
    for (std::size_t q = 0; q < moments_chunk; q += 2 * w) {
      v x, y;
      std::memcpy(&x, p + i + q, sizeof(v));
      std::memcpy(&y, p + i + q + w, sizeof(v));
      x -= sh;
      y -= sh;
      a += x;
      b += y;
      c += x * x;
      d += y * y;
    }
    for (std::size_t j = 0; j < w; ++j) {
      sum += static_cast<double>(a[j]) + static_cast<double>(b[j]);
      sq += static_cast<double>(c[j]) + static_cast<double>(d[j]);
    }
  }
  const double shift_d = static_cast<double>(shift);
  for (; i < n; ++i) {
    const double dd = static_cast<double>(p[i]) - shift_d;
    sum += dd;
    sq += dd * dd;
  }
  if (!std::isfinite(sum) || !std::isfinite(sq)) return mean_and_sd_double(g);
  const double nd = static_cast<double>(n);
  return {shift_d + sum / nd, std::sqrt(std::max((sq - sum * sum / nd) / nd, 0.0))};
#else
  return mean_and_sd_double(g);
#endif
}

template <class T>
mean_max_abs mean_and_max_abs_double(std::span<const T> g) {
  const std::size_t n = g.size();
  double s[4] = {};
  abs_key_t<T> mx[4] = {};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (std::size_t j = 0; j < 4; ++j) {
      s[j] += std::fabs(static_cast<double>(g[i + j]));
      mx[j] = std::max(mx[j], abs_key(g[i + j]));
    }
  }
  for (; i < n; ++i) {
    s[0] += std::fabs(static_cast<double>(g[i]));
    mx[0] = std::max(mx[0], abs_key(g[i]));
  }
  const abs_key_t<T> top = std::max(std::max(mx[0], mx[1]), std::max(mx[2], mx[3]));
  return {n == 0 ? 0.0 : ((s[0] + s[1]) + (s[2] + s[3])) / static_cast<double>(n),
          static_cast<double>(key_magnitude<T>(top))};
}

// Mean and maximum of |g|. A NaN or Inf anywhere makes the mean non-finite (the maximum is then
// taken over keys, so that NaN shows as NaN); the vector loop compares values, which is cheap
// for both widths, and leaves those cases to the double loop.
template <class T>
mean_max_abs mean_and_max_abs(std::span<const T> g) {
#if GRADCOMP_VECTOR_EXTENSIONS
  using v = typename lanes<T>::type;
  using vk = typename lanes<signed_key_t<T>>::type;
  constexpr std::size_t w = lanes<T>::count;
  const std::size_t n = g.size();
  if (n == 0) return {};
  const T* p = g.data();
  vk mask;
  for (std::size_t j = 0; j < w; ++j) {
    mask[j] = static_cast<signed_key_t<T>>(abs_key_traits<T>::mask);
  }
  v top = {};
  double sum = 0.0;
  std::size_t i = 0;
  for (; i + moments_chunk <= n; i += moments_chunk) {
    v a = {}, b = {};
    for (std::size_t q = 0; q < moments_chunk; q += 2 * w) {
      vk kx, ky;
      std::memcpy(&kx, p + i + q, sizeof(vk));
      std::memcpy(&ky, p + i + q + w, sizeof(vk));
      kx &= mask;  // clearing the sign bit: |g|
      ky &= mask;
      v x, y;
      std::memcpy(&x, &kx, sizeof(v));
      std::memcpy(&y, &ky, sizeof(v));
      a += x;
      b += y;
      top = x > top ? x : top;
      top = y > top ? y : top;
    }
    for (std::size_t j = 0; j < w; ++j) {
      sum += static_cast<double>(a[j]) + static_cast<double>(b[j]);
    }
  }
  T top_value = 0;
  for (std::size_t j = 0; j < w; ++j) top_value = std::max(top_value, top[j]);
  for (; i < n; ++i) {
    sum += std::fabs(static_cast<double>(p[i]));
    top_value = std::max(top_value, std::fabs(p[i]));
  }
  // Non-finite: NaN or Inf in g, or the T partial sums overflowed; the double loop decides.
  if (!std::isfinite(sum)) return mean_and_max_abs_double(g);
  return {sum / static_cast<double>(n), static_cast<double>(top_value)};
#else
  return mean_and_max_abs_double(g);
#endif
}

}  // namespace gradcomp::detail
