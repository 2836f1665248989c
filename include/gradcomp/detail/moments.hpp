// gradcomp/detail/moments.hpp: the one-pass statistics of the threshold selectors: mean and
// standard deviation of g (Gaussian-k), mean and maximum of |g| (RedSync).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/sources.hpp>
#include <gradcomp/detail/simd.hpp>

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
// types avoid both (see GRADCOMP_VECTOR_EXTENSIONS in detail/simd.hpp).
inline constexpr std::size_t moments_chunk = 256;


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
      s2[j] += square_unfused(d);
    }
  }
  for (; i < n; ++i) {
    const double d = static_cast<double>(g[i]) - shift;
    s1[0] += d;
    s2[0] += square_unfused(d);
  }
  const double sum = (s1[0] + s1[1]) + (s1[2] + s1[3]);
  const double sq = (s2[0] + s2[1]) + (s2[2] + s2[3]);
  const double nd = static_cast<double>(n);
  return {shift + sum / nd, std::sqrt(std::max((sq - sum * sum / nd) / nd, 0.0))};
}

// Where the fused pass below puts the indices (and keys) of the values above its threshold,
// in index order. The buffers hold cap + moments_chunk entries; once more than cap are found
// the pass stops collecting and sets overflow (the list is then incomplete).
template <class T>
struct above_list {
  std::uint32_t* indices = nullptr;
  abs_key_t<T>* keys = nullptr;
  std::size_t cap = 0;
  std::size_t count = 0;
  bool overflow = false;
};

// Mean and population standard deviation of the source's values, computed as in mean_and_sd;
// with Collect also the indices and keys of the values with key > t into `list`, and with
// Count the number of values with key > tc into `*counted`: Gaussian-k's statistics, a
// superset of its selection and a bound for one more of its counts, in one read. Values are
// shifted by the first value before squaring so that a large common offset does not cancel the
// variance away. The source's side effects (e += g) are always completed.
template <class T, bool Collect, bool Count, class Source>
mean_sd moments_pass(const Source& source, [[maybe_unused]] signed_key_t<T> t,
                     [[maybe_unused]] above_list<T>* list, [[maybe_unused]] signed_key_t<T> tc,
                     [[maybe_unused]] std::size_t* counted) {
  const Source src = source;  // see bracket_pass
  const std::size_t n = src.size();
  if constexpr (Count) *counted = 0;
  if (n == 0) return {};
#if GRADCOMP_VECTOR_EXTENSIONS
  using S = signed_key_t<T>;
  using v = typename lanes<T>::type;
  using sv = typename lanes<S>::type;
  constexpr std::size_t w = lanes<T>::count;
  const T shift = src.at(0);
  const v sh = v{} + shift;
  const sv km = sv{} + static_cast<S>(abs_key_traits<T>::mask);
  [[maybe_unused]] sv tt = sv{} + t;
  [[maybe_unused]] const sv tcv = sv{} + tc;
  [[maybe_unused]] sv cnt = {};  // minus the count per lane (a true compare is -1)
  double sum = 0.0;
  double sq = 0.0;
  [[maybe_unused]] std::size_t c = 0;
  [[maybe_unused]] bool collecting = Collect;
  [[maybe_unused]] auto hot = [&](const T* p, std::size_t b, std::size_t len) {
    std::uint32_t* const out = list->indices;
    abs_key_t<T>* const keys = list->keys;
    for_each_above(p, len, t, [&](std::size_t j, abs_key_t<T> kk) {
      out[c] = static_cast<std::uint32_t>(b + j);
      keys[c++] = kk;
    });
  };
  // Four vectors a step, summed pairwise before they join the two accumulators: few enough
  // registers that nothing spills with the block test and the counter in the same loop (which
  // keeps the pass bound by memory, not arithmetic), and a dependency chain of 16 adds per
  // chunk. Each lane of a chunk sum adds 64 values in T before the total moves to double.
  std::size_t i = 0;
  for (; i + moments_chunk <= n; i += moments_chunk) {
    v a = {}, q = {};
    for (std::size_t blk = 0; blk < moments_chunk; blk += scan_block) {
      const T* p = src.block(i + blk, scan_block);
      [[maybe_unused]] sv any = {};
      for (std::size_t o = 0; o < scan_block; o += 4 * w) {
        v x0, x1, x2, x3;
        std::memcpy(&x0, p + o, sizeof(v));
        std::memcpy(&x1, p + o + w, sizeof(v));
        std::memcpy(&x2, p + o + 2 * w, sizeof(v));
        std::memcpy(&x3, p + o + 3 * w, sizeof(v));
        if constexpr (Collect || Count) {
          sv k0, k1, k2, k3;
          std::memcpy(&k0, &x0, sizeof(v));
          std::memcpy(&k1, &x1, sizeof(v));
          std::memcpy(&k2, &x2, sizeof(v));
          std::memcpy(&k3, &x3, sizeof(v));
          k0 &= km;
          k1 &= km;
          k2 &= km;
          k3 &= km;
          if constexpr (Collect) any |= (tt - k0) | (tt - k1) | (tt - k2) | (tt - k3);
          if constexpr (Count) cnt += ((k0 > tcv) + (k1 > tcv)) + ((k2 > tcv) + (k3 > tcv));
        }
        x0 -= sh;
        x1 -= sh;
        x2 -= sh;
        x3 -= sh;
        a += (x0 + x1) + (x2 + x3);
        q += (square_unfused(x0) + square_unfused(x1)) +
             (square_unfused(x2) + square_unfused(x3));
      }
      if constexpr (Collect) {
        if (any_negative(any)) {
          if (c > list->cap) {
            collecting = false;
            tt = km;  // no key is above: the test is off from here on
          } else {
            hot(p, i + blk, scan_block);
          }
        }
      }
    }
    for (std::size_t j = 0; j < w; ++j) {
      sum += static_cast<double>(a[j]);
      sq += static_cast<double>(q[j]);
    }
  }
  const double shift_d = static_cast<double>(shift);
  if (i < n) {
    // n - i < moments_chunk already; the min tells the compiler (see for_blocks_above).
    const std::size_t len = std::min(moments_chunk, n - i);
    const T* p = src.block(i, len);
    for (std::size_t j = 0; j < len; ++j) {
      const double dd = static_cast<double>(p[j]) - shift_d;
      sum += dd;
      sq += square_unfused(dd);
      if constexpr (Count) *counted += signed_abs_key(p[j]) > tc;
    }
    if constexpr (Collect) {
      if (collecting && c <= list->cap) {
        hot(p, i, len);
      } else {
        collecting = false;
      }
    }
  }
  if constexpr (Count) {
    for (std::size_t j = 0; j < w; ++j) *counted += static_cast<std::size_t>(-cnt[j]);
  }
  if constexpr (Collect) {
    list->count = c;
    list->overflow = !collecting;
  }
  if (!std::isfinite(sum) || !std::isfinite(sq)) return mean_and_sd_double(src.values());
  const double nd = static_cast<double>(n);
  return {shift_d + sum / nd, std::sqrt(std::max((sq - sum * sum / nd) / nd, 0.0))};
#else
  src.finish(0);
  const std::span<const T> g = src.values();
  if constexpr (Collect) list->overflow = true;  // nothing collected: callers count in passes
  if constexpr (Count) {
    for (const T x : g) *counted += signed_abs_key(x) > tc;
  }
  return mean_and_sd_double(g);
#endif
}

// Mean and population standard deviation of g.
template <class T>
mean_sd mean_and_sd(std::span<const T> g) {
  return moments_pass<T, false, false>(read_source<T>{g}, 0, nullptr, 0, nullptr);
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
