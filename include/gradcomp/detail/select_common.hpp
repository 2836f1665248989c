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
template <class T>
inline bool block_any_above(const T* p, signed_key_t<T> t) noexcept {
  using S = signed_key_t<T>;
  typedef S v __attribute__((vector_size(16)));
  constexpr std::size_t w = 16 / sizeof(S);
  const S mask = static_cast<S>(abs_key_traits<T>::mask);
  v a = {}, b = {}, tt, mm;
  for (std::size_t j = 0; j < w; ++j) {
    tt[j] = t;
    mm[j] = mask;
  }
  for (std::size_t j = 0; j < scan_block; j += 2 * w) {
    v x, y;
    std::memcpy(&x, p + j, sizeof(v));
    std::memcpy(&y, p + j + w, sizeof(v));
    a |= tt - (x & mm);
    b |= tt - (y & mm);
  }
  a |= b;
  S acc = 0;
  for (std::size_t j = 0; j < w; ++j) acc |= a[j];
  return acc < 0;
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
    for (std::size_t i = b; i < e; ++i) {
      o[c] = static_cast<std::uint32_t>(i);  // written always, kept only if selected
      c += signed_abs_key(p[i]) > t;
    }
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
      for (std::size_t i = b; i < e; ++i) {
        out[c] = static_cast<std::uint32_t>(i);
        c += signed_abs_key(p[i]) > t;
      }
    } else {
      std::size_t local = 0;
      for (std::size_t i = b; i < e; ++i) local += signed_abs_key(p[i]) > t;
      c += local;
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
