// gradcomp/detail/select/sources.hpp: where a selection pass reads its values: g as it is, or
// e + g with error feedback's accumulation fused into the pass (written to e itself, or to a
// second buffer so that e stays as it was until the step commits).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>
#include <string_view>
#include <utility>

#include <gradcomp/error.hpp>
#include <gradcomp/detail/energy.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/scan.hpp>
#include <gradcomp/detail/simd.hpp>
#include <gradcomp/detail/stream_store.hpp>

namespace gradcomp::detail {

// Sources: where a selection pass gets its values. read_source reads g. sum_source makes the
// pass also do error feedback's accumulate, out = e + g, block by block just before it scans
// the block, so that accumulating and selecting cost one read of g and e and one write of
// out instead of two passes. Both offer
//   size()               n
//   at(i)                the value the pass will see at i, with no side effect (for samples)
//   block(b, len)        the values of [b, b + len), called once per range in index order
//   hot_block(b, t)      block(b, scan_block) if it holds a key > t, else null
//   finish(b)            completes the side effects for [b, n): when a pass stops early, and
//                        (finish(n)) at its end
//   values()             what holds the values once the pass is done (g, or e = acc)

// out[0, len) = e + g (out may be e itself), and whether any of the sums is NaN or Inf (with e
// finite: g held one, or a sum overflowed). With Energy, also adds the sums' squares to
// *energy, in the same loop (partial sums in T lanes over chunks of at most 256 values, added
// in double; see add_energy). With Stream, out must be 16-byte aligned and is written with
// streaming stores (detail/stream_store.hpp). The vector form makes no difference to the sums
// (each lane is the same IEEE addition), but the compiler cannot vectorise the plain loop on
// its own without knowing how the arrays overlap.
template <class T, bool Energy, bool Stream = false>
inline bool sum_range(T* out, const T* e, const T* g, std::size_t len,
                      [[maybe_unused]] double* energy) noexcept {
  bool bad = false;
  while (len > 0) {
    const std::size_t m = len < 256 ? len : 256;
    std::size_t i = 0;
    [[maybe_unused]] double chunk = 0.0;
#if GRADCOMP_VECTOR_EXTENSIONS
    using S = signed_key_t<T>;
    typedef T v __attribute__((vector_size(16)));
    typedef S sv __attribute__((vector_size(16)));
    constexpr std::size_t w = 16 / sizeof(T);
    const sv fm = sv{} + finite_key_max<T>;
    const sv mm = sv{} + static_cast<S>(abs_key_traits<T>::mask);
    [[maybe_unused]] v q0 = {}, q1 = {};
    sv f = {};
    for (; i + 2 * w <= m; i += 2 * w) {
      v a, b, c, d;
      std::memcpy(&a, e + i, sizeof(v));
      std::memcpy(&b, g + i, sizeof(v));
      std::memcpy(&c, e + i + w, sizeof(v));
      std::memcpy(&d, g + i + w, sizeof(v));
      a += b;
      c += d;
      if constexpr (Stream) {
        stream_vector(out + i, a);
        stream_vector(out + i + w, c);
      } else {
        std::memcpy(out + i, &a, sizeof(v));
        std::memcpy(out + i + w, &c, sizeof(v));
      }
      sv ka, kc;
      std::memcpy(&ka, &a, sizeof(v));
      std::memcpy(&kc, &c, sizeof(v));
      f |= (fm - (ka & mm)) | (fm - (kc & mm));  // negative lanes: key > finite_key_max
      if constexpr (Energy) {
        q0 += square_unfused(a);
        q1 += square_unfused(c);
      }
    }
    bad = bad || any_negative(f);
    if constexpr (Energy) {
      q0 += q1;
      for (std::size_t j = 0; j < w; ++j) chunk += static_cast<double>(q0[j]);
    }
#endif
    for (; i < m; ++i) {
      out[i] = e[i] + g[i];
      bad = bad || signed_abs_key(out[i]) > finite_key_max<T>;
      if constexpr (Energy) chunk += square_unfused(static_cast<double>(out[i]));  // T = double
    }
    if constexpr (Energy) add_energy(chunk, static_cast<const T*>(out), m, energy);
    out += m;
    e += m;
    g += m;
    len -= m;
  }
  return bad;
}

// Where sum_source gathers the squares of the blocks it sums: 16-byte lanes of T (one T
// without vector extensions), moved to double every 256 values.
#if GRADCOMP_VECTOR_EXTENSIONS
template <class T>
using square_lanes = typename lanes<T>::type;
#else
template <class T>
using square_lanes = T;
#endif

// out[0, scan_block) = e + g over the block (out may be e), and whether any of the sums has a
// key > t: the block test on the sums while they are still in registers. With Energy, also adds
// the sums' squares to the lanes *q. With Stream, out (16-byte aligned) is written with
// streaming stores and `copy` gets the sums too, for the caller to read.
template <class T, bool Energy = false, bool Stream = false>
inline bool sum_block_any_above(T* out, [[maybe_unused]] T* copy, const T* e, const T* g,
                                signed_key_t<T> t,
                                [[maybe_unused]] square_lanes<T>* q = nullptr) noexcept {
#if GRADCOMP_VECTOR_EXTENSIONS
  using S = signed_key_t<T>;
  using v = square_lanes<T>;
  typedef S sv __attribute__((vector_size(16)));
  constexpr std::size_t w = 16 / sizeof(T);
  const sv tt = sv{} + t;
  const sv mm = sv{} + static_cast<S>(abs_key_traits<T>::mask);
  sv a = {}, b = {};
  [[maybe_unused]] v q0 = {}, q1 = {};
  for (std::size_t j = 0; j < scan_block; j += 2 * w) {
    v x, y, gx, gy;
    std::memcpy(&x, e + j, sizeof(v));
    std::memcpy(&gx, g + j, sizeof(v));
    std::memcpy(&y, e + j + w, sizeof(v));
    std::memcpy(&gy, g + j + w, sizeof(v));
    x += gx;
    y += gy;
    if constexpr (Stream) {
      stream_vector(out + j, x);
      stream_vector(out + j + w, y);
      std::memcpy(copy + j, &x, sizeof(v));
      std::memcpy(copy + j + w, &y, sizeof(v));
    } else {
      std::memcpy(out + j, &x, sizeof(v));
      std::memcpy(out + j + w, &y, sizeof(v));
    }
    sv kx, ky;
    std::memcpy(&kx, &x, sizeof(v));
    std::memcpy(&ky, &y, sizeof(v));
    a |= tt - (kx & mm);
    b |= tt - (ky & mm);
    if constexpr (Energy) {
      q0 += square_unfused(x);
      q1 += square_unfused(y);
    }
  }
  if constexpr (Energy) *q += q0 + q1;
  return any_negative(a | b);
#else
  T* sums = Stream ? copy : out;
  for (std::size_t j = 0; j < scan_block; ++j) {
    sums[j] = e[j] + g[j];
    if constexpr (Energy) *q += sums[j] * sums[j];
  }
  if constexpr (Stream) std::memcpy(out, copy, scan_block * sizeof(T));
  return block_any_above(static_cast<const T*>(sums), t);
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

// The values e + g, written to `out` as the pass goes (out may be e itself: error feedback's
// e += g folded into the selector's pass). `e` and `g` are read once, `out` written once.
// With `energy` set (start it at 0), the pass also adds up the sum of squares of e + g there:
// every value is written exactly once through block, hot_block or finish, so after the pass
// *energy is ||e + g||^2 (the top-k contraction's denominator), at no extra read.
// With `nonfinite` set (start it at false), the pass sets it when a sum is NaN or Inf: the check
// compressor<> would otherwise make with a read of g before the step (a staged step, which
// writes a second buffer, can let the pass make it: on failure nothing it keeps has changed).
// Hot blocks are tested against a threshold no higher than the largest finite key, so that a
// block holding a non-finite sum is always hot, and only hot blocks need the second test.
// With `stream` (make it with accumulating_source), out is a buffer apart from e and beyond the
// caches: its lines are written with streaming stores, so they are never read from memory
// first, and block and hot_block hand out a cached copy of the block they wrote (reading the
// streamed lines back would fetch them from memory). The pointer they return is valid until
// the next call on the same source object.
template <class T>
struct sum_source {
  std::span<T> out;
  std::span<const T> e;
  std::span<const T> g;
  double* energy = nullptr;
  bool* nonfinite = nullptr;
  bool stream = false;
  alignas(16) mutable T copy[scan_block] = {};
  // hot_block's squares since they last moved to *energy, for the blocks [from, to): a
  // conversion to double and an add through `energy` per block of 32 cost more than the pass's
  // memory traffic once the step streams its output.
  // (Kept as T values, not as a vector type, so that the struct has one layout in every
  // translation unit, with or without vector extensions: nvcc builds have none.)
  alignas(16) mutable T squares[16 / sizeof(T)] = {};
  mutable std::size_t squares_from = 0;
  mutable std::size_t squares_to = 0;

  std::size_t size() const noexcept { return g.size(); }
  T at(std::size_t i) const noexcept { return e[i] + g[i]; }
  const T* block(std::size_t b, std::size_t len) const noexcept {
    if (stream && len <= scan_block) {
      flush_squares();
      sum_to<false>(copy, b, len);
      stream_copy(out.data() + b, static_cast<const T*>(copy), len);
      return copy;
    }
    add(b, len);
    return out.data() + b;
  }
  const T* hot_block(std::size_t b, signed_key_t<T> t) const noexcept {
    T* o = out.data() + b;
    const T* ep = e.data() + b;
    const T* gp = g.data() + b;
    // A block holding a NaN or Inf sum must come out hot, so that only hot blocks need the
    // second test below.
    const signed_key_t<T> tt = nonfinite != nullptr ? std::min(t, finite_key_max<T>) : t;
    bool hot;
    if (energy != nullptr) {
      if (b != squares_to) flush_squares(b);
      square_lanes<T> q;
      std::memcpy(&q, squares, sizeof(q));
      hot = stream ? sum_block_any_above<T, true, true>(o, copy, ep, gp, tt, &q)
                   : sum_block_any_above<T, true>(o, copy, ep, gp, tt, &q);
      std::memcpy(squares, &q, sizeof(q));
      squares_to = b + scan_block;
      if (squares_to - squares_from >= 256) flush_squares(squares_to);
    } else {
      hot = stream ? sum_block_any_above<T, false, true>(o, copy, ep, gp, tt)
                   : sum_block_any_above<T, false>(o, copy, ep, gp, tt);
    }
    if (!hot) return nullptr;
    const T* p = stream ? copy : o;
    if (nonfinite != nullptr) flag(block_any_above(p, finite_key_max<T>));
    return p;
  }
  void finish(std::size_t b) const noexcept { add(b, g.size() - b); }
  void add(std::size_t b, std::size_t len) const noexcept {
    flush_squares();
    T* o = out.data() + b;
    // Streaming needs o 16-byte aligned: every b a pass calls with is a multiple of scan_block.
    if (stream && stream_aligned(o)) {
      sum_to<true>(o, b, len);
    } else {
      sum_to<false>(o, b, len);
    }
  }
  // dst[0, len) = e + g over [b, b + len), its squares added to *energy where that is set, a
  // NaN or Inf flagged.
  template <bool Stream>
  void sum_to(T* dst, std::size_t b, std::size_t len) const noexcept {
    const T* ep = e.data() + b;
    const T* gp = g.data() + b;
    flag(energy != nullptr ? sum_range<T, true, Stream>(dst, ep, gp, len, energy)
                           : sum_range<T, false, Stream>(dst, ep, gp, len, nullptr));
  }
  // Moves the gathered squares to *energy (summed again in double from out where they
  // overflowed T) and starts gathering at `next`.
  void flush_squares(std::size_t next = 0) const noexcept {
    if (squares_to > squares_from) {
      double lanes = 0.0;
      for (const T x : squares) lanes += static_cast<double>(x);
      add_energy(lanes, static_cast<const T*>(out.data() + squares_from), squares_to - squares_from,
                 energy);
    }
    for (T& x : squares) x = T(0);
    squares_from = squares_to = next;
  }
  void flag(bool bad) const noexcept {
    if (bad && nonfinite != nullptr) *nonfinite = true;
  }
  std::span<const T> values() const noexcept { return out; }
};

// The sum_source of a selector's fused accumulation, out = e + g: streaming when out is a
// second buffer (a staged step's), large enough to be beyond the caches, and 16-byte aligned.
template <class T>
sum_source<T> accumulating_source(std::span<T> out, std::span<const T> e, std::span<const T> g,
                                  double* energy, bool* nonfinite) {
  const bool stream = GRADCOMP_STREAM_STORES && out.data() != e.data() &&
                      out.size() * sizeof(T) >= stream_min_bytes && stream_aligned(out.data());
  return sum_source<T>{out, e, g, energy, nonfinite, stream};
}

// The sizes a select_accumulate_into(out, e, g, ...) must agree on: e and out as long as g.
inline void check_accumulate_sizes(std::string_view where, std::size_t out, std::size_t e, std::size_t g) {
  for (const auto& [arg, size] : {std::pair{"e.size()", e}, std::pair{"out.size()", out}}) {
    if (size != g) throw_invalid_argument(where, arg, size, concat("g.size() (", g, ")"));
  }
}

}  // namespace gradcomp::detail
