// gradcomp/detail/select/scan.hpp: the blocked scan every host selector's pass is built on:
// blocks of 32 values tested at once for "any |g| above the threshold", and the exact
// per-element visit of the blocks that pass.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include <gradcomp/config.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/simd.hpp>

namespace gradcomp::detail {

// The blocked scan. Blocks of 32 elements are first tested with a vectorisable "any key > t";
// only blocks that pass do exact per-element work. With thresholds near the top of the
// distribution almost every block fails the test, so the scan runs at about the speed of a
// plain streaming read.

inline constexpr std::size_t scan_block = 32;

// key > t <=> t - key < 0 (no overflow: key >= 0, t >= -1), so OR-ing the differences and
// testing the sign answers "any" with a subtract and an OR per element: no compares, and it
// vectorises with SSE2 for 64-bit keys too.
#if GRADCOMP_VECTOR_EXTENSIONS
// GCC 12 at -O3 inlines this into loops over inputs whose allocation it knows is shorter than
// a block and then warns (-Warray-bounds) about the block loads, although the callers only
// reach them with a full block: a false positive, silenced here only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#endif
template <class T>
inline bool block_any_above(const T* p, signed_key_t<T> t) noexcept {
  using S = signed_key_t<T>;
  typedef S v __attribute__((vector_size(16)));
  constexpr std::size_t w = 16 / sizeof(S);
  // Broadcasts, which the compiler hoists out of the callers' loops.
  const v tt = v{} + t;
  const v mm = v{} + static_cast<S>(abs_key_traits<T>::mask);
  v a = {}, b = {};
  for (std::size_t j = 0; j < scan_block; j += 2 * w) {
    v x, y;
    std::memcpy(&x, p + j, sizeof(v));
    std::memcpy(&y, p + j + w, sizeof(v));
    a |= tt - (x & mm);
    b |= tt - (y & mm);
  }
  return any_negative(a | b);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#else
template <class T>
GRADCOMP_HOST_DEVICE bool block_any_above(const T* p, signed_key_t<T> t) noexcept {
  signed_key_t<T> acc = 0;
  for (std::size_t j = 0; j < scan_block; ++j) acc |= t - signed_abs_key(p[j]);
  return acc < 0;
}
#endif

// Calls f(j, key) for every j < len (len <= scan_block) with key(p[j]) > t, in order. Hot blocks
// hold a few such elements among 32: on x86 a compare mask visits just those (a bit scan each)
// instead of testing all 32; elsewhere, and for double keys (SSE2 has no 64-bit compare), the
// plain loop does.
#if GRADCOMP_VECTOR_EXTENSIONS && defined(__SSE2__)
#define GRADCOMP_SSE2_MASKS 1
// Bit j is set iff key(p[j]) > t, for the scan_block floats at p.
inline std::uint32_t block_mask_above(const float* p, std::int32_t t) noexcept {
  const __m128i tt = _mm_set1_epi32(t);
  const __m128i mask = _mm_set1_epi32(0x7fffffff);
  std::uint32_t bits = 0;
  for (unsigned j = 0; j < scan_block / 4; ++j) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * j));
    const __m128i gt = _mm_cmpgt_epi32(_mm_and_si128(x, mask), tt);  // keys are >= 0: signed is fine
    bits |= static_cast<std::uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(gt))) << (4 * j);
  }
  return bits;
}
#else
#define GRADCOMP_SSE2_MASKS 0
#endif

template <class T, class F>
inline void for_each_above(const T* p, std::size_t len, signed_key_t<T> t, F&& f) {
#if GRADCOMP_SSE2_MASKS
  if constexpr (std::is_same_v<T, float>) {
    if (len == scan_block) {
      for (std::uint32_t bits = block_mask_above(p, t); bits != 0; bits &= bits - 1) {
        const auto j = static_cast<std::size_t>(std::countr_zero(bits));
        f(j, abs_key(p[j]));
      }
      return;
    }
  }
#endif
  for (std::size_t j = 0; j < len; ++j) {
    const abs_key_t<T> kk = abs_key(p[j]);
    if (static_cast<signed_key_t<T>>(kk) > t) f(j, kk);
  }
}

// Calls hot(begin, end) for every block [begin, end) of g that holds a key > t, in index order;
// t = -1 visits every block. The last, partial block is always visited.
template <class T, class Hot>
void for_blocks_above(std::span<const T> g, signed_key_t<T> t, Hot&& hot) {
  const T* p = g.data();
  const std::size_t n = g.size();
  std::size_t i = 0;
  for (; i + scan_block <= n; i += scan_block) {
    if (block_any_above(p + i, t)) hot(i, i + scan_block);
  }
  // n - i < scan_block already; the min tells the compiler so (GCC otherwise warns that an
  // unbounded tail loop could overflow the index).
  if (i < n) hot(i, i + std::min(scan_block, n - i));
}

}  // namespace gradcomp::detail
