// gradcomp/detail/stream_store.hpp: writes of a large output that bypass the caches. A plain
// store to a line that is not cached first reads the line from memory (to own it), so writing
// a vector that the caches cannot hold costs a read and a write of it; a streaming
// (non-temporal) store writes the line without reading it. On an earlier session's machine a
// streaming fill of 102 MB took about a third of a plain one; on the 2026-11-26 machine
// 16-byte streaming stores were slower than plain ones and 64-byte ones faster, in most runs
// (docs/performance.md), hence stream_lines_avx512 below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <gradcomp/detail/host_dispatch.hpp>
#include <gradcomp/detail/simd.hpp>

namespace gradcomp::detail {

// From this many bytes an output is written with streaming stores: well beyond the private
// caches, where the lines written would be evicted before anyone read them. Smaller outputs are
// written with plain stores and stay cached for the caller.
inline constexpr std::size_t stream_min_bytes = std::size_t{8} << 20;

#if GRADCOMP_VECTOR_EXTENSIONS && defined(__SSE2__)
#define GRADCOMP_STREAM_STORES 1
#else
#define GRADCOMP_STREAM_STORES 0
#endif

// Stores one 16-byte vector v (of float or double lanes) at p, which must be 16-byte aligned,
// without reading the line first.
template <class T, class V>
inline void stream_vector(T* p, const V& v) noexcept {
  static_assert(sizeof(V) == 16);
#if GRADCOMP_STREAM_STORES
  if constexpr (std::is_same_v<T, float>) {
    __m128 x;
    std::memcpy(&x, &v, 16);
    _mm_stream_ps(p, x);
  } else {
    __m128d x;
    std::memcpy(&x, &v, 16);
    _mm_stream_pd(p, x);
  }
#else
  std::memcpy(p, &v, 16);
#endif
}

// Whether p may take stream_vector stores (16-byte aligned); elements before the boundary are
// written with plain stores by the callers.
template <class T>
inline bool stream_aligned(const T* p) noexcept {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

// dst[i] = f(src[i]) for i < len, f taking and giving 16-byte vectors of T (and T itself for
// the ends), with streaming stores from dst's first 16-byte boundary: plain ones before it and
// for a tail of less than 16 bytes. Call stream_fence() before another thread may read dst.
template <class T, class F>
inline void stream_transform(T* dst, const T* src, std::size_t len, F f) noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  std::size_t i = 0;
#if GRADCOMP_STREAM_STORES
  typedef T v __attribute__((vector_size(16)));
  constexpr std::size_t w = 16 / sizeof(T);
  for (; i < len && !stream_aligned(dst + i); ++i) dst[i] = f(src[i]);
  for (; i + w <= len; i += w) {
    v x;
    std::memcpy(&x, src + i, 16);
    stream_vector(dst + i, f(x));
  }
#endif
  for (; i < len; ++i) dst[i] = f(src[i]);
}

#if GRADCOMP_STREAM_STORES && GRADCOMP_HOST_DISPATCH
// stream_transform for the two functions below with 64-byte streaming stores, a whole cache
// line per store, from dst's first 64-byte boundary (plain stores before it and for a tail of
// less than 64 bytes). On the 2026-11-26 machine a streaming fill of 102 MB, 64 KiB at a
// time from a cached buffer, took about 0.7x as long with 64-byte stores as with 16-byte ones
// in 5 of 7 runs, 0.75-0.83x in the other 2 (docs/performance.md). Each lane is the same IEEE
// operation as in stream_transform, so the results are the same bits.
template <bool Scaled, class T>
[[gnu::target("avx512f")]] inline void stream_lines_avx512(T* dst, const T* src, std::size_t len,
                                                           T scale) noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  const auto f = [scale](T x) { return Scaled ? x * scale : x; };
  std::size_t i = 0;
  for (; i < len && reinterpret_cast<std::uintptr_t>(dst + i) % 64 != 0; ++i) dst[i] = f(src[i]);
  constexpr std::size_t w = 64 / sizeof(T);
  if constexpr (std::is_same_v<T, float>) {
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + w <= len; i += w) {
      __m512 x = _mm512_loadu_ps(src + i);
      if constexpr (Scaled) x = _mm512_mul_ps(x, s);
      _mm512_stream_ps(dst + i, x);
    }
  } else {
    const __m512d s = _mm512_set1_pd(scale);
    for (; i + w <= len; i += w) {
      __m512d x = _mm512_loadu_pd(src + i);
      if constexpr (Scaled) x = _mm512_mul_pd(x, s);
      _mm512_stream_pd(dst + i, x);
    }
  }
  for (; i < len; ++i) dst[i] = f(src[i]);
}
#endif

// From this many bytes stream_copy and stream_scaled use 64-byte stores where the CPU has
// AVX-512 (and the ceiling of detail/host_dispatch.hpp allows it): a short range (a selection
// pass's block) keeps the 16-byte stores, whose lines the next range completes, where the
// partial lines at the ends of 64-byte-aligned stretches would each be read from memory.
inline constexpr std::size_t stream_lines_min_bytes = 4096;

// Whether stream_copy and stream_scaled write len values of T with 64-byte stores now.
template <class T>
inline bool stream_lines_used(std::size_t len) noexcept {
#if GRADCOMP_STREAM_STORES && GRADCOMP_HOST_DISPATCH
  return len * sizeof(T) >= stream_lines_min_bytes && active_host_isa() == host_isa::avx512;
#else
  (void)len;
  return false;
#endif
}

// dst[0, len) = src[0, len), bit for bit.
template <class T>
inline void stream_copy(T* dst, const T* src, std::size_t len) noexcept {
#if GRADCOMP_STREAM_STORES && GRADCOMP_HOST_DISPATCH
  if (stream_lines_used<T>(len)) {
    stream_lines_avx512<false>(dst, src, len, T(1));
    return;
  }
#endif
  stream_transform(dst, src, len, [](auto x) { return x; });
}

// dst[0, len) = src[0, len) * scale.
template <class T>
inline void stream_scaled(T* dst, const T* src, std::size_t len, T scale) noexcept {
#if GRADCOMP_STREAM_STORES && GRADCOMP_HOST_DISPATCH
  if (stream_lines_used<T>(len)) {
    stream_lines_avx512<true>(dst, src, len, scale);
    return;
  }
#endif
  stream_transform(dst, src, len, [scale](auto x) { return x * scale; });
}

// Orders the streaming stores before every later store, so that a thread which synchronises
// with this one afterwards (a lock, a barrier) sees them. The thread that made them always
// sees its own stores.
inline void stream_fence() noexcept {
#if GRADCOMP_STREAM_STORES
  _mm_sfence();
#endif
}

}  // namespace gradcomp::detail
