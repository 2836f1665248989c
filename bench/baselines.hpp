// The baselines the selectors are measured against, in the same binary so that ratios come
// from one run: a streaming read (the floor for anything that looks at every element once),
// a copy, e + g streamed into a second buffer (the floor of a staged step, which reads two
// arrays and writes one), and the textbook
// exact top-k with std::nth_element or std::partial_sort on a copy of |g|.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace gradcomp_bench {

// Sum of |g|, 16-byte lanes and eight independent accumulators: enough to keep the adds off
// the critical path, so that this runs at the memory's read bandwidth, not at the latency of
// one dependent add per vector.
inline double sum_abs(std::span<const float> g) {
  typedef float v4 __attribute__((vector_size(16)));
  typedef std::int32_t i4 __attribute__((vector_size(16)));
  const i4 mask = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
  const float* p = g.data();
  const std::size_t n = g.size();
  v4 acc[8] = {};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (std::size_t j = 0; j < 8; ++j) {
      i4 bits;
      std::memcpy(&bits, p + i + 4 * j, sizeof(bits));
      bits &= mask;
      v4 x;
      std::memcpy(&x, &bits, sizeof(x));
      acc[j] += x;
    }
  }
  const v4 s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  double total = static_cast<double>(s[0]) + s[1] + s[2] + s[3];
  for (; i < n; ++i) total += std::fabs(p[i]);
  return total;
}

// out = e + g with streaming (non-temporal) stores: the memory traffic a staged compression
// step cannot avoid (read the feedback state and the gradient, write the next state; the
// library streams that write too, detail/stream_store.hpp). Plain stores where SSE2 or the
// alignment is missing.
inline void accumulate_streamed(std::span<const float> e, std::span<const float> g,
                                std::span<float> out) {
  typedef float v4 __attribute__((vector_size(16)));
  const std::size_t n = g.size();
  std::size_t i = 0;
#if defined(__SSE2__)
  for (; i < n && reinterpret_cast<std::uintptr_t>(out.data() + i) % 16 != 0; ++i) {
    out[i] = e[i] + g[i];
  }
  for (; i + 4 <= n; i += 4) {
    v4 a, b;
    std::memcpy(&a, e.data() + i, sizeof(a));
    std::memcpy(&b, g.data() + i, sizeof(b));
    a += b;
    __m128 x;
    std::memcpy(&x, &a, sizeof(x));
    _mm_stream_ps(out.data() + i, x);
  }
  _mm_sfence();
#endif
  for (; i < n; ++i) out[i] = e[i] + g[i];
}

// A plain copy with 16-byte loads and ordinary stores, written out so that the compiler does
// not turn it into a memcpy call: glibc's memcpy switches to non-temporal stores above a size
// threshold, which on the machine of docs/performance.md is slower than this loop (both are in
// the suite: baseline/copy and baseline/memcpy).
inline void copy_floats(std::span<const float> src, std::span<float> dst) {
  typedef float v4 __attribute__((vector_size(16)));
  const float* s = src.data();
  float* d = dst.data();
  const std::size_t n = src.size();
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v4 a, b, c, e;
    std::memcpy(&a, s + i, sizeof(a));
    std::memcpy(&b, s + i + 4, sizeof(b));
    std::memcpy(&c, s + i + 8, sizeof(c));
    std::memcpy(&e, s + i + 12, sizeof(e));
    std::memcpy(d + i, &a, sizeof(a));
    std::memcpy(d + i + 4, &b, sizeof(b));
    std::memcpy(d + i + 8, &c, sizeof(c));
    std::memcpy(d + i + 12, &e, sizeof(e));
  }
  for (; i < n; ++i) d[i] = s[i];
}

// The indices of the k largest |g| (1 <= k <= n), ties to the lower index, given the k-th
// largest value: the final pass the textbook methods share.
inline void indices_from_kth(std::span<const float> g, float kth, std::size_t above,
                             std::size_t k, std::vector<std::uint32_t>& out) {
  out.resize(k);
  std::size_t ties_left = k - above;
  std::size_t w = 0;
  for (std::size_t i = 0; i < g.size() && w < k; ++i) {
    const float a = std::fabs(g[i]);
    if (a > kth || (a == kth && ties_left > 0)) {
      ties_left -= (a == kth);
      out[w++] = static_cast<std::uint32_t>(i);
    }
  }
}

// std::nth_element on a copy of |g| (`scratch`, n floats) for the k-th value, then one pass
// for the indices.
inline void topk_nth_element(std::span<const float> g, std::size_t k, std::vector<float>& scratch,
                             std::vector<std::uint32_t>& out) {
  for (std::size_t i = 0; i < g.size(); ++i) scratch[i] = std::fabs(g[i]);
  const auto kth_it = scratch.begin() + static_cast<std::ptrdiff_t>(k - 1);
  std::nth_element(scratch.begin(), kth_it, scratch.end(), std::greater<float>{});
  const float kth = *kth_it;
  const auto above = static_cast<std::size_t>(
      std::count_if(scratch.begin(), kth_it, [kth](float a) { return a > kth; }));
  indices_from_kth(g, kth, above, k, out);
}

// The same with std::partial_sort (a heap of the k best, then sorted).
inline void topk_partial_sort(std::span<const float> g, std::size_t k, std::vector<float>& scratch,
                              std::vector<std::uint32_t>& out) {
  for (std::size_t i = 0; i < g.size(); ++i) scratch[i] = std::fabs(g[i]);
  const auto mid = scratch.begin() + static_cast<std::ptrdiff_t>(k);
  std::partial_sort(scratch.begin(), mid, scratch.end(), std::greater<float>{});
  const float kth = *(mid - 1);
  const auto above = static_cast<std::size_t>(
      std::lower_bound(scratch.begin(), mid, kth, std::greater<float>{}) - scratch.begin());
  indices_from_kth(g, kth, above, k, out);
}

}  // namespace gradcomp_bench
