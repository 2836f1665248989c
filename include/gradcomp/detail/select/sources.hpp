// gradcomp/detail/select/sources.hpp: where a selection pass reads its values: g as it is, or
// e + g with error feedback's accumulation fused into the pass (written to e itself, or to a
// second buffer so that e stays as it was until the step commits).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>
#include <string_view>
#include <utility>

#include <gradcomp/error.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/scan.hpp>
#include <gradcomp/detail/simd.hpp>

namespace gradcomp::detail {

// Sources: where a selection pass gets its values. read_source reads g. sum_source makes the
// pass also do error feedback's accumulate, out = e + g, block by block just before it scans
// the block, so that accumulating and selecting cost one read of g and e and one write of
// out instead of two passes. Both offer
//   size()               n
//   at(i)                the value the pass will see at i, with no side effect (for samples)
//   block(b, len)        the values of [b, b + len), called once per range in index order
//   hot_block(b, t)      block(b, scan_block) if it holds a key > t, else null
//   finish(b)            completes the side effects for [b, n) when a pass stops early
//   values()             what holds the values once the pass is done (g, or e = acc)

// The sum of squares of x[0, m) in double, element by element: the exact fallback for a
// chunk whose squares overflowed T's lanes.
template <class T>
inline double squares_in_double(const T* x, std::size_t m) noexcept {
  double s = 0.0;
  for (std::size_t i = 0; i < m; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

// The squares' partial sums of a chunk of sums just written to out, in T lanes, added to
// *energy in double; a chunk whose lanes overflowed (|x| above about 1.8e19 for float) is
// summed again in double from out.
template <class T>
inline void add_energy(double lanes, const T* out, std::size_t m, double* energy) noexcept {
  *energy += std::isfinite(lanes) ? lanes : squares_in_double(out, m);
}

// With `energy`, also adds the sum of the sums' squares to *energy, in the same loop (partial
// sums in T lanes over chunks of at most 256 values, added in double; see add_energy).
template <class T>
inline void sum_into_energy(T* out, const T* e, const T* g, std::size_t len,
                            double* energy) noexcept {
  while (len > 0) {
    const std::size_t m = len < 256 ? len : 256;
    std::size_t i = 0;
    double chunk = 0.0;
#if GRADCOMP_VECTOR_EXTENSIONS
    typedef T v __attribute__((vector_size(16)));
    constexpr std::size_t w = 16 / sizeof(T);
    v q0 = {}, q1 = {};
    for (; i + 2 * w <= m; i += 2 * w) {
      v a, b, c, d;
      std::memcpy(&a, e + i, sizeof(v));
      std::memcpy(&b, g + i, sizeof(v));
      std::memcpy(&c, e + i + w, sizeof(v));
      std::memcpy(&d, g + i + w, sizeof(v));
      a += b;
      c += d;
      std::memcpy(out + i, &a, sizeof(v));
      std::memcpy(out + i + w, &c, sizeof(v));
      q0 += a * a;
      q1 += c * c;
    }
    q0 += q1;
    for (std::size_t j = 0; j < w; ++j) chunk += static_cast<double>(q0[j]);
#endif
    for (; i < m; ++i) {
      out[i] = e[i] + g[i];
      chunk += static_cast<double>(out[i]) * static_cast<double>(out[i]);
    }
    add_energy(chunk, out, m, energy);
    out += m;
    e += m;
    g += m;
    len -= m;
  }
}

// out[i] = e[i] + g[i] for i < len; out may be e itself (e += g). The vector form makes no
// difference to the sums (each lane is the same IEEE addition), but the compiler cannot
// vectorise the plain loop on its own without knowing how the arrays overlap.
template <class T>
inline void sum_into(T* out, const T* e, const T* g, std::size_t len) noexcept {
#if GRADCOMP_VECTOR_EXTENSIONS
  typedef T v __attribute__((vector_size(16)));
  constexpr std::size_t w = 16 / sizeof(T);
  const std::size_t pairs = len / (2 * w);
  for (std::size_t j = 0; j < pairs; ++j, out += 2 * w, e += 2 * w, g += 2 * w) {
    v a, b, c, d;
    std::memcpy(&a, e, sizeof(v));
    std::memcpy(&b, g, sizeof(v));
    std::memcpy(&c, e + w, sizeof(v));
    std::memcpy(&d, g + w, sizeof(v));
    a += b;
    c += d;
    std::memcpy(out, &a, sizeof(v));
    std::memcpy(out + w, &c, sizeof(v));
  }
  len %= 2 * w;
#endif
  for (std::size_t i = 0; i < len; ++i) out[i] = e[i] + g[i];
}

// out[0, scan_block) = e + g over the block (out may be e), and whether any of the sums has a
// key > t: the block test on the sums while they are still in registers.
// With Energy, also adds the block's sum of squares to *energy (as sum_into_energy).
template <class T, bool Energy = false>
inline bool sum_block_any_above(T* out, const T* e, const T* g, signed_key_t<T> t,
                                [[maybe_unused]] double* energy = nullptr) noexcept {
#if GRADCOMP_VECTOR_EXTENSIONS
  using S = signed_key_t<T>;
  typedef T v __attribute__((vector_size(16)));
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
    std::memcpy(out + j, &x, sizeof(v));
    std::memcpy(out + j + w, &y, sizeof(v));
    sv kx, ky;
    std::memcpy(&kx, &x, sizeof(v));
    std::memcpy(&ky, &y, sizeof(v));
    a |= tt - (kx & mm);
    b |= tt - (ky & mm);
    if constexpr (Energy) {
      q0 += x * x;
      q1 += y * y;
    }
  }
  if constexpr (Energy) {
    q0 += q1;
    double lanes = 0.0;
    for (std::size_t j = 0; j < w; ++j) lanes += static_cast<double>(q0[j]);
    add_energy(lanes, static_cast<const T*>(out), scan_block, energy);
  }
  return any_negative(a | b);
#else
  if constexpr (Energy) {
    sum_into_energy(out, e, g, scan_block, energy);
  } else {
    sum_into(out, e, g, scan_block);
  }
  return block_any_above(static_cast<const T*>(out), t);
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
template <class T>
struct sum_source {
  std::span<T> out;
  std::span<const T> e;
  std::span<const T> g;
  double* energy = nullptr;

  std::size_t size() const noexcept { return g.size(); }
  T at(std::size_t i) const noexcept { return e[i] + g[i]; }
  const T* block(std::size_t b, std::size_t len) const noexcept {
    add(b, len);
    return out.data() + b;
  }
  const T* hot_block(std::size_t b, signed_key_t<T> t) const noexcept {
    T* p = out.data() + b;
    if (energy != nullptr) {
      return sum_block_any_above<T, true>(p, e.data() + b, g.data() + b, t, energy) ? p
                                                                                     : nullptr;
    }
    return sum_block_any_above(p, e.data() + b, g.data() + b, t) ? p : nullptr;
  }
  void finish(std::size_t b) const noexcept { add(b, g.size() - b); }
  void add(std::size_t b, std::size_t len) const noexcept {
    if (energy != nullptr) {
      sum_into_energy(out.data() + b, e.data() + b, g.data() + b, len, energy);
    } else {
      sum_into(out.data() + b, e.data() + b, g.data() + b, len);
    }
  }
  std::span<const T> values() const noexcept { return out; }
};
// The sizes a select_accumulate_into(out, e, g, ...) must agree on: e and out as long as g.
inline void check_accumulate_sizes(std::string_view where, std::size_t out, std::size_t e, std::size_t g) {
  for (const auto& [arg, size] : {std::pair{"e.size()", e}, std::pair{"out.size()", out}}) {
    if (size != g) throw_invalid_argument(where, arg, size, concat("g.size() (", g, ")"));
  }
}

}  // namespace gradcomp::detail
