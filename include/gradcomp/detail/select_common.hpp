// gradcomp/detail/select_common.hpp: the pieces every host selector is built from: the
// integer key of |g|, thresholds expressed as keys, the blocked compaction pass
// "indices where key > t", the exact top-k finish on a candidate list and the radix select.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/config.hpp>
#include <gradcomp/error.hpp>

#if defined(__SSE2__) && !defined(__CUDACC__)
#include <emmintrin.h>
#endif

namespace gradcomp::detail {

// ---------------------------------------------------------------------------------------
// Keys. Clearing the sign bit of an IEEE value leaves an unsigned pattern whose integer
// order is the order of |g| for finite values and +Inf; NaN patterns land above +Inf, and
// -0 and +0 share key 0. The sign bit is always clear, so the key also fits the signed type
// of the same width: thresholds use -1 for "everything", and the block test below can work
// with signed arithmetic.

template <class T>
struct abs_key_traits;

template <>
struct abs_key_traits<float> {
  using key = std::uint32_t;
  using signed_key = std::int32_t;
  static constexpr key mask = 0x7fffffffu;
  static constexpr unsigned bits = 31;  // significant key bits
};

template <>
struct abs_key_traits<double> {
  using key = std::uint64_t;
  using signed_key = std::int64_t;
  static constexpr key mask = 0x7fffffffffffffffull;
  static constexpr unsigned bits = 63;
};

template <class T>
using abs_key_t = typename abs_key_traits<T>::key;
template <class T>
using signed_key_t = typename abs_key_traits<T>::signed_key;

template <class T>
GRADCOMP_HOST_DEVICE constexpr abs_key_t<T> abs_key(T x) noexcept {
  return std::bit_cast<abs_key_t<T>>(x) & abs_key_traits<T>::mask;
}

// Same key as a signed integer (never negative).
template <class T>
GRADCOMP_HOST_DEVICE constexpr signed_key_t<T> signed_abs_key(T x) noexcept {
  return static_cast<signed_key_t<T>>(abs_key(x));
}

// |g| of a key, the inverse of abs_key on non-negative values.
template <class T>
GRADCOMP_HOST_DEVICE constexpr T key_magnitude(abs_key_t<T> k) noexcept {
  return std::bit_cast<T>(k);
}

// Radix digit `width` bits wide starting at bit `shift`.
template <class Key>
GRADCOMP_HOST_DEVICE constexpr unsigned radix_digit(Key key, unsigned shift,
                                                    unsigned width) noexcept {
  return static_cast<unsigned>((key >> shift) & ((Key{1} << width) - 1));
}

inline constexpr unsigned radix_digit_bits = 11;

// ---------------------------------------------------------------------------------------
// Thresholds as keys: the selectors compute thresholds in double, the scan compares keys,
// and "key > t" must mean exactly "|g| > v" (or ">= v") in the element type T, including
// when v falls between two floats.

// Largest representable T not above v (v >= 0, may be +Inf), as a signed key: then
// key(x) > t <=> |x| > v for every non-NaN x. Negative v gives -1 (everything).
template <class T>
signed_key_t<T> key_threshold_above(double v) {
  if (v < 0.0) return -1;
  T f;
  if constexpr (std::is_same_v<T, float>) {
    if (v >= static_cast<double>(std::numeric_limits<float>::max())) {
      // Out of float range: the conversion itself would be undefined behaviour.
      f = std::isinf(v) ? std::numeric_limits<float>::infinity()
                        : std::numeric_limits<float>::max();
    } else {
      f = static_cast<float>(v);
      if (static_cast<double>(f) > v) f = std::nextafter(f, 0.0f);
    }
  } else {
    f = v;
  }
  return static_cast<signed_key_t<T>>(abs_key(f));
}

// Key t with key(x) > t <=> |x| >= v for every non-NaN x (v >= 0). v <= 0 gives -1.
template <class T>
signed_key_t<T> key_threshold_at_least(double v) {
  if (!(v > 0.0)) return -1;
  signed_key_t<T> t = key_threshold_above<T>(v);
  // The largest value <= v equals v: step one key down to the largest value < v.
  if (static_cast<double>(key_magnitude<T>(static_cast<abs_key_t<T>>(t))) == v) --t;
  return t;
}

// Indices are uint32: n - 1 must fit.
inline void check_index_range(std::string_view where, std::size_t n) {
  if (static_cast<std::uint64_t>(n) > (std::uint64_t{1} << 32)) {
    throw_invalid_argument(where, "g.size()", n, "n <= 2^32 (indices are 32-bit)");
  }
}

// ---------------------------------------------------------------------------------------
// Scratch memory. Index and key buffers are written by branchless appends past their
// logical end, so they are sized before use and must not pay for zero-filling.

template <class T>
struct uninit_allocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = uninit_allocator<U>;
  };
  uninit_allocator() = default;
  template <class U>
  uninit_allocator(const uninit_allocator<U>&) noexcept {}

  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-initialise: no zeroing
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T>
using uninit_vector = std::vector<T, uninit_allocator<T>>;

// Buffers a selector reuses between calls. Copying a selector copies its settings, not its
// scratch: a copy starts with empty buffers.
struct select_scratch {
  uninit_vector<std::uint32_t> list_a;
  uninit_vector<std::uint32_t> list_b;
  uninit_vector<std::uint32_t> keys32;
  uninit_vector<std::uint64_t> keys64;
  uninit_vector<std::uint32_t> keys32_b;
  uninit_vector<std::uint64_t> keys64_b;

  select_scratch() = default;
  select_scratch(const select_scratch&) noexcept {}
  select_scratch(select_scratch&&) noexcept = default;
  select_scratch& operator=(const select_scratch&) noexcept { return *this; }
  select_scratch& operator=(select_scratch&&) noexcept = default;
  ~select_scratch() = default;

  template <class T>
  uninit_vector<abs_key_t<T>>& keys() {
    if constexpr (std::is_same_v<abs_key_t<T>, std::uint32_t>) {
      return keys32;
    } else {
      return keys64;
    }
  }
  template <class T>
  uninit_vector<abs_key_t<T>>& keys_b() {
    if constexpr (std::is_same_v<abs_key_t<T>, std::uint32_t>) {
      return keys32_b;
    } else {
      return keys64_b;
    }
  }
};

// Grow `v` to at least `size` elements (never shrinks, so capacity is kept between calls).
template <class V>
void ensure_size(V& v, std::size_t size) {
  if (v.size() < size) v.resize(size);
}

// ---------------------------------------------------------------------------------------
// The blocked scan. Blocks of 32 elements are first tested with a vectorisable "any key > t";
// only blocks that pass do exact per-element work. With thresholds near the top of the
// distribution almost every block fails the test, so the scan runs at about the speed of a
// plain streaming read.

inline constexpr std::size_t scan_block = 32;

// GCC and Clang vector extensions (16-byte lanes, SSE2 on x86-64) for the hot reductions:
// the plain loops are also vectorised, but at -O2 GCC leaves them as loops of tiny
// iterations (or, for double sums, cannot reorder them at all). Define
// GRADCOMP_NO_VECTOR_EXTENSIONS to build the portable loops instead (tests do both).
#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(GRADCOMP_NO_VECTOR_EXTENSIONS)
#define GRADCOMP_VECTOR_EXTENSIONS 1
#else
#define GRADCOMP_VECTOR_EXTENSIONS 0
#endif

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
// Whether any lane of a 16-byte vector of signed keys is negative: the sign bits in one
// instruction on x86 (the lane loop compiles to a chain of shuffles and ORs).
template <class V>
inline bool any_negative(V a) noexcept {
#if defined(__SSE2__)
  if constexpr (sizeof(a[0]) == 4) {
    return _mm_movemask_ps(std::bit_cast<__m128>(a)) != 0;
  } else {
    return _mm_movemask_pd(std::bit_cast<__m128d>(a)) != 0;
  }
#else
  auto acc = a[0];
  for (std::size_t j = 1; j < sizeof(V) / sizeof(a[0]); ++j) acc |= a[j];
  return acc < 0;
#endif
}

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

// Index of the first NaN or Inf of g, or g.size() when every value is finite. NaN and Inf are
// exactly the keys above that of the largest finite value. The test runs over chunks of
// nonfinite_chunk values with one horizontal reduction each: a check that is almost never
// positive need not stop every 32 values. (Scanning from the back, so that the front of g
// would still be cached for the pass that follows, did not measure faster.)
inline constexpr std::size_t nonfinite_chunk = 1024;

template <class T>
std::size_t first_nonfinite(std::span<const T> g) {
  using S = signed_key_t<T>;
  constexpr auto finite_max = static_cast<S>(abs_key(std::numeric_limits<T>::max()));
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

// ---------------------------------------------------------------------------------------
// Sources: where a selection pass gets its values. read_source reads g. accumulate_source
// makes the pass also do error feedback's accumulate, e += g, block by block just before it
// scans the block, so that accumulating and selecting cost one read of g and e and one write
// of e instead of two passes. Both offer
//   size()               n
//   at(i)                the value the pass will see at i, with no side effect (for samples)
//   block(b, len)        the values of [b, b + len), called once per range in index order
//   hot_block(b, t)      block(b, scan_block) if it holds a key > t, else null
//   finish(b)            completes the side effects for [b, n) when a pass stops early
//   values()             what holds the values once the pass is done (g, or e = acc)

// e[i] += g[i] for i < len. The vector form makes no difference to the sums (each lane is
// the same IEEE addition), but the compiler cannot vectorise the plain loop on its own
// without knowing that e and g do not overlap.
template <class T>
inline void add_into(T* e, const T* g, std::size_t len) noexcept {
#if GRADCOMP_VECTOR_EXTENSIONS
  typedef T v __attribute__((vector_size(16)));
  constexpr std::size_t w = 16 / sizeof(T);
  const std::size_t pairs = len / (2 * w);
  for (std::size_t j = 0; j < pairs; ++j, e += 2 * w, g += 2 * w) {
    v a, b, c, d;
    std::memcpy(&a, e, sizeof(v));
    std::memcpy(&b, g, sizeof(v));
    std::memcpy(&c, e + w, sizeof(v));
    std::memcpy(&d, g + w, sizeof(v));
    a += b;
    c += d;
    std::memcpy(e, &a, sizeof(v));
    std::memcpy(e + w, &c, sizeof(v));
  }
  len %= 2 * w;
#endif
  for (std::size_t i = 0; i < len; ++i) e[i] += g[i];
}

// e[0, scan_block) += g[0, scan_block), and whether any of the sums has a key > t: the block
// test on the sums while they are still in registers.
template <class T>
inline bool add_block_any_above(T* e, const T* g, signed_key_t<T> t) noexcept {
#if GRADCOMP_VECTOR_EXTENSIONS
  using S = signed_key_t<T>;
  typedef T v __attribute__((vector_size(16)));
  typedef S sv __attribute__((vector_size(16)));
  constexpr std::size_t w = 16 / sizeof(T);
  const sv tt = sv{} + t;
  const sv mm = sv{} + static_cast<S>(abs_key_traits<T>::mask);
  sv a = {}, b = {};
  for (std::size_t j = 0; j < scan_block; j += 2 * w) {
    v x, y, gx, gy;
    std::memcpy(&x, e + j, sizeof(v));
    std::memcpy(&gx, g + j, sizeof(v));
    std::memcpy(&y, e + j + w, sizeof(v));
    std::memcpy(&gy, g + j + w, sizeof(v));
    x += gx;
    y += gy;
    std::memcpy(e + j, &x, sizeof(v));
    std::memcpy(e + j + w, &y, sizeof(v));
    sv kx, ky;
    std::memcpy(&kx, &x, sizeof(v));
    std::memcpy(&ky, &y, sizeof(v));
    a |= tt - (kx & mm);
    b |= tt - (ky & mm);
  }
  return any_negative(a | b);
#else
  add_into(e, g, scan_block);
  return block_any_above(e, t);
#endif
}

template <class T>
struct read_source {
  std::span<const T> g;

  std::size_t size() const noexcept { return g.size(); }
  T at(std::size_t i) const noexcept { return g[i]; }
  const T* block(std::size_t b, std::size_t /*len*/) const noexcept { return g.data() + b; }
  // The full block at b when it holds a key > t, else null.
  const T* hot_block(std::size_t b, signed_key_t<T> t) const noexcept {
    const T* p = g.data() + b;
    return block_any_above(p, t) ? p : nullptr;
  }
  void finish(std::size_t /*b*/) const noexcept {}
  std::span<const T> values() const noexcept { return g; }
};

template <class T>
struct accumulate_source {
  std::span<T> e;
  std::span<const T> g;

  std::size_t size() const noexcept { return g.size(); }
  T at(std::size_t i) const noexcept { return e[i] + g[i]; }
  const T* block(std::size_t b, std::size_t len) const noexcept {
    add_into(e.data() + b, g.data() + b, len);
    return e.data() + b;
  }
  const T* hot_block(std::size_t b, signed_key_t<T> t) const noexcept {
    T* p = e.data() + b;
    return add_block_any_above(p, g.data() + b, t) ? p : nullptr;
  }
  void finish(std::size_t b) const noexcept {
    add_into(e.data() + b, g.data() + b, g.size() - b);
  }
  std::span<const T> values() const noexcept { return e; }
};

// Calls f(j, value) for the values at the positions floor(j n / s), j < s (1 <= s <= n). The
// positions advance by quotient and remainder (no division per sample); the loads are
// independent, so the out-of-order core overlaps their cache misses.
template <class Source, class F>
void for_each_strided(const Source& src, std::size_t s, F&& f) {
  const std::size_t n = src.size();
  const std::size_t q = n / s;
  const std::size_t r = n % s;
  std::size_t pos = 0;
  std::size_t rem = 0;
  for (std::size_t j = 0; j < s; ++j) {
    f(j, src.at(pos));
    pos += q;
    rem += r;
    if (rem >= s) {
      rem -= s;
      ++pos;
    }
  }
}

// The keys at those positions, into keys[0..s).
template <class T, class Source>
void strided_sample_keys(const Source& src, std::size_t s, abs_key_t<T>* keys) {
  for_each_strided(src, s, [keys](std::size_t j, T x) { keys[j] = abs_key(x); });
}

// Indices i with key(g[i]) > t, ascending, into `out` (resized to the count).
template <class T>
std::size_t collect_above(std::span<const T> g, signed_key_t<T> t,
                          std::vector<std::uint32_t>& out) {
  const T* p = g.data();
  std::size_t c = 0;
  if (out.size() < scan_block) out.resize(scan_block);
  for_blocks_above(g, t, [&](std::size_t b, std::size_t e) {
    if (c + scan_block > out.size()) out.resize(std::max(out.size() * 2, c + scan_block));
    std::uint32_t* o = out.data();
    for_each_above(p + b, e - b, t,
                   [&](std::size_t j, abs_key_t<T>) { o[c++] = static_cast<std::uint32_t>(b + j); });
  });
  out.resize(c);
  return c;
}

// Counts keys > t and, while the count stays within `cap`, writes their indices to `out`,
// which must hold cap + scan_block entries. Returns the count; `out` holds the selection
// exactly when the count is <= cap. This fuses "count" and "write" into one read for the
// adaptive-threshold selectors, whose final count is usually close to the target.
template <class T>
std::size_t count_collect_above(std::span<const T> g, signed_key_t<T> t, std::uint32_t* out,
                                std::size_t cap) {
  const T* p = g.data();
  std::size_t c = 0;
  for_blocks_above(g, t, [&](std::size_t b, std::size_t e) {
    if (c <= cap) {
      for_each_above(p + b, e - b, t, [&](std::size_t j, abs_key_t<T>) {
        out[c++] = static_cast<std::uint32_t>(b + j);
      });
    } else {
      for_each_above(p + b, e - b, t, [&](std::size_t, abs_key_t<T>) { ++c; });
    }
  });
  return c;
}

// ---------------------------------------------------------------------------------------
// Exact top-k finish on a candidate list.

// Of the indices in `list` (ascending), keeps the `need` (1 <= need <= list.size()) with the
// largest keys, ties broken by lower index, compacted in place at the front of `list` in
// ascending order. Returns the need-th largest key. `keys` is scratch.
template <class T>
abs_key_t<T> keep_top_of_list(std::span<const T> g, std::span<std::uint32_t> list, std::size_t need,
                              uninit_vector<abs_key_t<T>>& keys) {
  using key = abs_key_t<T>;
  const std::size_t m = list.size();
  ensure_size(keys, m);
  for (std::size_t i = 0; i < m; ++i) keys[i] = abs_key(g[list[i]]);
  auto first = keys.begin();
  std::nth_element(first, first + static_cast<std::ptrdiff_t>(need - 1),
                   first + static_cast<std::ptrdiff_t>(m), std::greater<key>{});
  const key kth = keys[need - 1];
  // After nth_element only the first need-1 keys can exceed the pivot.
  std::size_t greater = 0;
  for (std::size_t i = 0; i + 1 < need; ++i) greater += keys[i] > kth;
  std::size_t ties_left = need - greater;
  std::size_t w = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const key k = abs_key(g[list[i]]);
    if (k > kth || (k == kth && ties_left > 0)) {
      ties_left -= (k == kth);
      list[w++] = list[i];
    }
  }
  return kth;
}

// The same finish when the pass kept each candidate's key next to its index (keys[i] is the
// key of list[i]): no access to g at all, which for a candidate list spread over a large
// tensor saves a cache miss per candidate. `sorted` is scratch of at least list.size() keys.
template <class Key>
Key keep_top_by_keys(std::span<std::uint32_t> list, const Key* keys, std::size_t need,
                     Key* sorted) {
  const std::size_t m = list.size();
  std::copy_n(keys, m, sorted);
  std::nth_element(sorted, sorted + static_cast<std::ptrdiff_t>(need - 1),
                   sorted + static_cast<std::ptrdiff_t>(m), std::greater<Key>{});
  const Key kth = sorted[need - 1];
  std::size_t greater = 0;
  for (std::size_t i = 0; i + 1 < need; ++i) greater += sorted[i] > kth;
  std::size_t ties_left = need - greater;
  std::size_t w = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const Key k = keys[i];
    const bool tie = k == kth && ties_left > 0;
    list[w] = list[i];  // w <= i: a stale copy is overwritten or cut off by the final count
    w += (k > kth) | tie;
    ties_left -= tie;
  }
  return kth;
}

// ---------------------------------------------------------------------------------------
// Radix select: the exact k-th largest key of g (1 <= k <= n), 11-bit digits from the most
// significant (3 passes for float keys, 6 for double). Robust against any distribution, ties
// included; the finish then takes every key above the k-th and the lowest-index ties.

template <class T>
struct radix_result {
  abs_key_t<T> kth = 0;   // the k-th largest key
  std::size_t above = 0;  // elements with a larger key (< k)
  unsigned passes = 0;    // histogram passes made
};

namespace radix {

inline constexpr unsigned buckets = 1u << radix_digit_bits;

// Picks the bucket holding the rank-th largest (1-based) of the counted keys, and turns
// rank into the rank within that bucket; adds the elements of higher buckets to `above`.
inline unsigned pick_bucket(const std::uint64_t* hist, unsigned width, std::size_t& rank,
                            std::size_t& above) {
  for (unsigned d = (1u << width); d-- > 0;) {
    if (hist[d] >= rank) return d;
    rank -= hist[d];
    above += hist[d];
  }
  check_invariant(false, "radix select: rank exceeds the element count");
  return 0;
}

// Counts per digit in four interleaved sub-histograms: with many equal keys (ties, zeros) a
// single counter would serialise the increments on store-to-load forwarding.
struct histogram {
  std::vector<std::uint32_t> sub = std::vector<std::uint32_t>(4 * buckets);
  std::vector<std::uint64_t> total = std::vector<std::uint64_t>(buckets);

  void clear() { std::fill(sub.begin(), sub.end(), 0u); }
  void add(std::size_t lane, unsigned digit) { ++sub[(lane & 3) * buckets + digit]; }
  // Folds the sub-histograms. Lanes rotate with the element position, so each sub-histogram
  // takes at most n/4 <= 2^30 counts per pass: uint32 cannot overflow.
  void fold() {
    for (unsigned d = 0; d < buckets; ++d) {
      total[d] =
          std::uint64_t{sub[d]} + sub[buckets + d] + sub[2 * buckets + d] + sub[3 * buckets + d];
    }
  }
};

}  // namespace radix

// Scans keys (from g or from the key list) in passes of one digit. A pass that narrows the
// candidates (the chosen bucket is not all of them) also copies the survivors' keys into the
// list, fused with the next digit's histogram; a pass that does not narrow (ties) only
// histograms. The first pass reads g; the second reads g again unless the first narrowed
// nothing; later passes read the shrinking list.
template <class T>
radix_result<T> radix_kth_largest(std::span<const T> g, std::size_t k,
                                  uninit_vector<abs_key_t<T>>& list) {
  using key = abs_key_t<T>;
  radix_result<T> res;
  const std::size_t n = g.size();
  const T* p = g.data();
  radix::histogram hist;
  std::size_t rank = k;
  std::size_t total = n;  // candidates: keys sharing the prefix fixed so far
  bool from_g = true;
  key prefix = 0;
  key fixed_mask = 0;  // bits of the prefix fixed so far
  unsigned remaining = abs_key_traits<T>::bits;
  unsigned width = std::min(radix_digit_bits, remaining);
  unsigned shift = remaining - width;

  // First digit: all of g counts.
  hist.clear();
  for (std::size_t i = 0; i < n; ++i) hist.add(i, radix_digit(abs_key(p[i]), shift, width));
  for (;;) {
    hist.fold();
    ++res.passes;
    const unsigned digit = radix::pick_bucket(hist.total.data(), width, rank, res.above);
    const std::uint64_t bucket = hist.total[digit];
    prefix = static_cast<key>(prefix | (key{digit} << shift));
    fixed_mask = static_cast<key>(fixed_mask | (((key{1} << width) - 1) << shift));
    remaining = shift;
    if (remaining == 0) break;
    width = std::min(radix_digit_bits, remaining);
    shift = remaining - width;
    hist.clear();
    if (bucket == total) {
      // Nothing narrowed: every candidate has the prefix; just count the next digit.
      if (from_g) {
        for (std::size_t i = 0; i < n; ++i) hist.add(i, radix_digit(abs_key(p[i]), shift, width));
      } else {
        for (std::size_t i = 0; i < total; ++i) hist.add(i, radix_digit(list[i], shift, width));
      }
      continue;
    }
    // Branchless compaction: every key is written at the end of the list and kept only if it
    // matches; the histogram gets +0 for the others. Buckets with a large share of g (ties at
    // the k-th value) would otherwise mispredict on every other element.
    std::size_t m = 0;
    auto keep = [&](key kk) {
      const bool match = (kk & fixed_mask) == prefix;
      hist.sub[(m & 3) * radix::buckets + radix_digit(kk, shift, width)] += match;
      list[m] = kk;
      m += match;
    };
    if (from_g) {
      ensure_size(list, static_cast<std::size_t>(bucket) + 1);
      for (std::size_t i = 0; i < n; ++i) keep(abs_key(p[i]));
      from_g = false;
    } else {
      for (std::size_t i = 0; i < total; ++i) keep(list[i]);
    }
    total = m;
  }
  res.kth = prefix;
  return res;
}

// Writes the k indices of largest key given the k-th largest key `kth` and the number of
// keys above it: every key > kth and the lowest-index (k - above) keys equal to kth; stops
// reading g once all k are found. `out` must hold k entries.
template <class T>
void take_top_by_kth(std::span<const T> g, abs_key_t<T> kth, std::size_t above, std::size_t k,
                     std::uint32_t* out) {
  using key = abs_key_t<T>;
  std::size_t ties_left = k - above;
  std::size_t w = 0;
  const T* p = g.data();
  const std::size_t n = g.size();
  const auto t = static_cast<signed_key_t<T>>(kth) - 1;  // blocks with a key >= kth
  for (std::size_t b = 0; b < n && w < k; b += scan_block) {
    const std::size_t e = std::min(n, b + scan_block);
    if (e - b == scan_block && !block_any_above(p + b, t)) continue;
    if (w + (e - b) <= k) {
      // Room for the whole block: branchless, as the take/skip pattern is data-dependent.
      for (std::size_t i = b; i < e; ++i) {
        const key kk = abs_key(p[i]);
        const bool tie = kk == kth && ties_left > 0;
        out[w] = static_cast<std::uint32_t>(i);
        w += (kk > kth) | tie;
        ties_left -= tie;
      }
    } else {
      for (std::size_t i = b; i < e && w < k; ++i) {
        const key kk = abs_key(p[i]);
        if (kk > kth || (kk == kth && ties_left > 0)) {
          ties_left -= (kk == kth);
          out[w++] = static_cast<std::uint32_t>(i);
        }
      }
    }
  }
  check_invariant(w == k, "radix select: final pass count differs from k");
}

}  // namespace gradcomp::detail
