// gradcomp/detail/host_simd/lanes.hpp: one chunk of 16 values as vector lanes: the lane types,
// packing codes into bytes and back, and each codec's per-value arithmetic lane by lane (the
// portable loop's, exactly).
// Part of the host quantizers' vector paths (detail/host_simd.hpp says how they are built and
// checked).
#pragma once

#include <atomic>
#include <cmath>
#include <concepts>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/detail/host_dispatch.hpp>
#include <gradcomp/detail/quantize_math.hpp>
#include <gradcomp/detail/random.hpp>
#include <gradcomp/detail/simd.hpp>

namespace gradcomp::detail {

#if GRADCOMP_VECTOR_EXTENSIONS

// The helpers below take vectors by reference and return them through out-parameters: a
// vector wider than 16 bytes passed by value has an ABI that depends on the instruction set,
// which GCC reports (-Wpsabi) for every such function, inlined or not.
namespace simd16 {

// One chunk: 16 values in lanes of 4 bytes, and the narrower forms codes pass through.
typedef float f32 __attribute__((vector_size(64)));
typedef std::uint32_t u32 __attribute__((vector_size(64)));
typedef std::int32_t i32 __attribute__((vector_size(64)));
typedef std::uint64_t u64 __attribute__((vector_size(128)));
typedef std::uint16_t u16 __attribute__((vector_size(32)));
typedef std::uint8_t u8 __attribute__((vector_size(16)));
typedef std::uint16_t u16x8 __attribute__((vector_size(16)));
typedef std::uint32_t u32x4 __attribute__((vector_size(16)));
typedef std::uint64_t u64x2 __attribute__((vector_size(16)));
typedef std::uint8_t u8x8 __attribute__((vector_size(8)));
typedef std::uint8_t u8x4 __attribute__((vector_size(4)));
typedef std::uint8_t u8x2 __attribute__((vector_size(2)));
typedef std::uint64_t u64x4 __attribute__((vector_size(32)));
typedef std::uint64_t u64x8 __attribute__((vector_size(64)));

// The per-value arithmetic below (the codecs' codes and values, and the random draw) is
// written for lane vectors of any width: N = 16 is the chunk, N = 8 half of it. The AVX2 path
// computes each chunk as two halves (split_chunks): GCC 12 lowers the conditional selects of a
// 64-byte vector to pieces and element moves on AVX2, which made the AVX2 encoders of bf16,
// QSGD and TernGrad slower than the portable loop; a 32-byte half is one register there.
template <std::size_t N>
struct lane_types {
  typedef float f __attribute__((vector_size(4 * N)));
  typedef std::uint32_t u __attribute__((vector_size(4 * N)));
  typedef std::int32_t i __attribute__((vector_size(4 * N)));
  typedef std::uint64_t u64 __attribute__((vector_size(8 * N)));
};
// The lane types of vectors with as many 4-byte lanes as V.
template <class V>
using lanes_like = lane_types<sizeof(V) / 4>;
typedef lane_types<8>::f f32h;
typedef lane_types<8>::u u32h;

// {1, 2, ..., lanes of V} as a V (a constant, not a function: a wide vector returned by
// value has an ABI that depends on the instruction set).
template <class V, class Lanes>
struct one_based_lanes;
template <class V, std::size_t... J>
struct one_based_lanes<V, std::index_sequence<J...>> {
  static constexpr V value{static_cast<std::remove_cvref_t<decltype(V{}[0])>>(J + 1)...};
};

inline constexpr std::size_t width = 16;

template <class V>
[[gnu::always_inline]] inline void load(V& v, const void* p) {
  std::memcpy(&v, p, sizeof v);
}
template <class V>
[[gnu::always_inline]] inline void store(void* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// Packs 16 codes (each below 2^bits, bits in {1, 2, 4, 8, 16}) LSB-first into 2 * bits
// bytes at out, as detail::pack_codes_with does. 4 bits: two codes to a 64-bit lane, ORed into
// its low byte. 2 and 1 bits: each code is shifted to its place within its byte and narrowed
// to a byte of its own; the 8 / bits bytes that make one output byte hold disjoint bits, so a
// multiply by 0x0101... adds (ORs) them into the top byte of their word without carries.
[[gnu::always_inline]] inline void pack(std::byte* out, const u32& codes, unsigned bits) {
  if (bits == 16) {
    store(out, __builtin_convertvector(codes, u16));
    return;
  }
  if (bits == 8) {
    store(out, __builtin_convertvector(codes, u8));
    return;
  }
  const u32 lane = u32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  switch (bits) {
    case 4: {
      // Two codes to a 64-bit lane: its low byte, after q | q >> 28, is c0 | c1 << 4 (c0 is
      // below 16, so nothing of it reaches the byte from above). On AVX-512: one shift, one
      // OR and one narrowing of 8 lanes (vpmovqb), where narrowing 16 lanes to bytes and adding
      // pairs took twice the instructions and was the most sampled part of QSGD 4-bit's encoder
      // (docs/performance.md). The baseline path's speed did not change (measured on x86-64).
      const u64x8 q = __builtin_bit_cast(u64x8, codes);
      store(out, __builtin_convertvector(q | (q >> 28), u8x8));
      return;
    }
    case 2: {
      const u8 b = __builtin_convertvector(codes << ((lane & 3u) * 2u), u8);
      const u32x4 w = __builtin_bit_cast(u32x4, b);
      store(out, __builtin_convertvector((w * 0x01010101u) >> 24, u8x4));
      return;
    }
    default: {  // 1
      const u8 b = __builtin_convertvector(codes << (lane & 7u), u8);
      const u64x2 w = __builtin_bit_cast(u64x2, b);
      store(out, __builtin_convertvector((w * 0x0101010101010101ULL) >> 56, u8x2));
      return;
    }
  }
}

// v's low and high halves (lanes [0, N/2) and [N/2, N)), and back.
template <class V, class H>
[[gnu::always_inline]] inline void split_halves(const V& v, H& lo, H& hi) {
  static_assert(sizeof(V) == 2 * sizeof(H));
  load(lo, &v);
  load(hi, reinterpret_cast<const std::byte*>(&v) + sizeof(H));
}
template <class H, class V>
[[gnu::always_inline]] inline void join_halves(const H& lo, const H& hi, V& v) {
  static_assert(sizeof(V) == 2 * sizeof(H));
  store(&v, lo);
  store(reinterpret_cast<std::byte*>(&v) + sizeof(H), hi);
}

// pack() for the paths that split chunks (split_chunks): codes below 8 bits (each below
// 2^bits, as for pack()) are shifted to their place in a 32-bit word, 8 codes to a word, and
// each word's 8 lanes are ORed together, which stays in AVX2 registers; pack()'s narrowing to
// bytes does not (GCC 12 moves each byte through a general register there). Same bytes as
// pack().
[[gnu::always_inline]] inline void pack_halves(std::byte* out, const u32& codes, unsigned bits) {
  if (bits >= 8) {
    pack(out, codes, bits);
    return;
  }
  u32h lo, hi;
  split_halves(codes, lo, hi);
  const u32h shifts = u32h{0, 1, 2, 3, 4, 5, 6, 7} * bits;
  auto or_lanes = [](const u32h& v) {  // memcpy, not __builtin_shufflevector (GCC 12 and later)
    u32x4 a, b;
    split_halves(v, a, b);
    const u64x2 q = __builtin_bit_cast(u64x2, a | b);
    const std::uint64_t w = q[0] | q[1];
    return static_cast<std::uint32_t>(w | (w >> 32));
  };
  // Codes 0-7 fill bits [0, 8 bits), codes 8-15 the next 8 bits; little-endian bytes.
  const std::uint64_t w = static_cast<std::uint64_t>(or_lanes(lo << shifts)) |
                          (static_cast<std::uint64_t>(or_lanes(hi << shifts)) << (8 * bits));
  switch (bits) {  // 2 * bits bytes, in sizes the compiler can see
    case 4: std::memcpy(out, &w, 8); break;
    case 2: std::memcpy(out, &w, 4); break;
    default: std::memcpy(out, &w, 2); break;  // 1
  }
}

// The 16 codes of the 2 * bits bytes at in (bits in {1, 2, 4, 8, 16}); reads only those.
[[gnu::always_inline]] inline void unpack(const std::byte* in, unsigned bits, u32& codes) {
  if (bits == 16) {
    u16 h;
    load(h, in);
    codes = __builtin_convertvector(h, u32);
    return;
  }
  if (bits == 8) {
    u8 b;
    load(b, in);
    codes = __builtin_convertvector(b, u32);
    return;
  }
  std::uint64_t w = 0;  // the 2 * bits bytes, in sizes the compiler can see
  switch (bits) {
    case 4: std::memcpy(&w, in, 8); break;
    case 2: std::memcpy(&w, in, 4); break;
    default: std::memcpy(&w, in, 2); break;  // 1
  }
  const u64 shifts = u64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * bits;
  codes = __builtin_convertvector((u64{} + w) >> shifts, u32) & ((1u << bits) - 1u);
}

// counter_rng::uniform(i) for i = first .. first + lanes - 1 (detail/random.hpp): the same
// mix64, lane by lane.
template <class F>
[[gnu::always_inline]] inline void uniform(std::uint64_t key, std::uint64_t first, F& u) {
  using U64 = typename lanes_like<F>::u64;
  using I = typename lanes_like<F>::i;
  // key + (first + j) * c modulo 2^64, as key + first * c + j * c: one multiply per chunk.
  constexpr std::uint64_t c = 0x9e3779b97f4a7c15ULL;
  constexpr U64 steps =
      one_based_lanes<U64, std::make_index_sequence<sizeof(F) / 4>>::value * c;
  U64 z = (key + first * c) + steps;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  // mix64 ends with z ^ (z >> 31), whose top 24 bits are z's own: (z >> 31) >> 40 is 0.
  const I top24 = __builtin_convertvector(z >> 40, I);  // < 2^24: exact in float
  u = __builtin_convertvector(top24, F) * 0x1.0p-24f;
}

// detail::float_to_half_bits, lane by lane, integer-only like it.
template <class F>
[[gnu::always_inline]] inline void half_bits(const F& f, typename lanes_like<F>::u& out) {
  using U = typename lanes_like<F>::u;
  using I = typename lanes_like<F>::i;
  const U x = __builtin_bit_cast(U, f);
  const U sign = (x >> 16) & 0x8000u;
  const U ax = x & 0x7fffffffu;
  const I sax = __builtin_bit_cast(I, ax);  // < 2^31: signed comparisons order it
  // Normal half: rebias in place, round to nearest even.
  const U r = ax - 0x38000000u;
  const U normal = (r + 0x0fffu + ((r >> 13) & 1u)) >> 13;
  // Subnormal half (and zero): the 24-bit significand shifted right by 126 - e, rounded to
  // nearest even; shifts of 25 and more give 0, as everything below 2^-25 rounds to zero.
  I shift = 126 - __builtin_bit_cast(I, ax >> 23);
  shift = shift < 1 ? I{} + 1 : shift;
  shift = shift > 31 ? I{} + 31 : shift;
  const U sh = __builtin_bit_cast(U, shift);
  const U mant = (ax & 0x7fffffu) | 0x800000u;
  const U sub = (mant + (((U{} + 1u) << (sh - 1u)) - 1u) + ((mant >> sh) & 1u)) >> sh;
  U h = sax >= 0x38800000 ? normal : sub;
  h = sax >= 0x477ff000 ? U{} + 0x7bffu : h;  // finite overflow saturates
  const U nan_bits = __builtin_bit_cast(U, sax > 0x7f800000) & (0x200u | ((ax >> 13) & 0x3ffu));
  h = sax >= 0x7f800000 ? 0x7c00u | nan_bits : h;
  out = sign | h;
}

// detail::half_bits_to_float, lane by lane (h below 2^16).
template <class U>
[[gnu::always_inline]] inline void half_to_float(const U& h, typename lanes_like<U>::f& out) {
  using F = typename lanes_like<U>::f;
  using I = typename lanes_like<U>::i;
  const U sign = (h & 0x8000u) << 16;
  const I e = __builtin_bit_cast(I, (h >> 10) & 0x1fu);
  const U m = h & 0x3ffu;
  const U normal = ((__builtin_bit_cast(U, e) + 112u) << 23) | (m << 13);
  // Inf, or NaN made quiet.
  const U special = 0x7f800000u | (m << 13) | (__builtin_bit_cast(U, m != 0u) & 0x400000u);
  // m * 2^-24 is exact in float (m < 2^10, a normal result): the subnormal's value.
  const U sub =
      __builtin_bit_cast(U, __builtin_convertvector(__builtin_bit_cast(I, m), F) * 0x1.0p-24f);
  U bits = e == 0 ? sub : normal;
  bits = e == 0x1f ? special : bits;
  out = __builtin_bit_cast(F, sign | bits);
}

// detail::float_to_bf16_bits, lane by lane.
template <class F>
[[gnu::always_inline]] inline void bf16_bits(const F& f, typename lanes_like<F>::u& out) {
  using U = typename lanes_like<F>::u;
  using I = typename lanes_like<F>::i;
  const U x = __builtin_bit_cast(U, f);
  const I sax = __builtin_bit_cast(I, x & 0x7fffffffu);
  U b = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  b = sax >= 0x7f7f8000 ? ((x >> 16) & 0x8000u) | 0x7f7fu : b;
  b = sax == 0x7f800000 ? x >> 16 : b;
  out = sax > 0x7f800000 ? (x >> 16) | 0x40u : b;
}

// detail::qsgd_code, lane by lane, for one bucket's norm > 0.
template <class F>
[[gnu::always_inline]] inline void qsgd_codes(const F& v, float norm, std::uint32_t s,
                                              const F& u, typename lanes_like<F>::u& out) {
  using U = typename lanes_like<F>::u;
  using I = typename lanes_like<F>::i;
  const float fs = static_cast<float>(s);
  const F absv = __builtin_bit_cast(F, __builtin_bit_cast(U, v) & 0x7fffffffu);
  F r = fs * (absv / norm);
  r = r <= fs ? r : F{} + fs;                       // NaN included
  const I low = __builtin_convertvector(r, I);  // r in [0, s]: truncation is floor
  const F frac = r - __builtin_convertvector(low, F);
  const U level = __builtin_bit_cast(U, low) - __builtin_bit_cast(U, u < frac);  // true: -1
  out = v < 0.0f ? s - level : s + level;
}

// detail::qsgd_value, lane by lane.
template <class U>
[[gnu::always_inline]] inline void qsgd_values(const U& codes, float norm, std::uint32_t s,
                                               float inv_s, typename lanes_like<U>::f& out) {
  using F = typename lanes_like<U>::f;
  using I = typename lanes_like<U>::i;
  const I level = __builtin_bit_cast(I, codes) - static_cast<std::int32_t>(s);
  out = norm * (__builtin_convertvector(level, F) * inv_s);
}

// detail::terngrad_code, lane by lane, for one bucket's max > 0.
template <class F>
[[gnu::always_inline]] inline void terngrad_codes(const F& v, float max, const F& u,
                                                  typename lanes_like<F>::u& out) {
  using U = typename lanes_like<F>::u;
  const F absv = __builtin_bit_cast(F, __builtin_bit_cast(U, v) & 0x7fffffffu);
  const U hit = __builtin_bit_cast(U, u < absv / max) & 1u;
  const U neg = __builtin_bit_cast(U, v < 0.0f) & 1u;
  out = hit << neg;
}

// detail::terngrad_value, lane by lane (codes <= 2).
template <class U>
[[gnu::always_inline]] inline void terngrad_values(const U& codes, float max, typename lanes_like<U>::f& out) {
  using F = typename lanes_like<U>::f;
  const U keep = __builtin_bit_cast(U, codes != 0u);
  out = __builtin_bit_cast(F, (__builtin_bit_cast(std::uint32_t, max) & keep) | ((codes >> 1) << 31));
}

// detail::scaled_sign_value, lane by lane.
template <class U>
[[gnu::always_inline]] inline void scaled_sign_values(const U& codes, float mean, typename lanes_like<U>::f& out) {
  using F = typename lanes_like<U>::f;
  out = __builtin_bit_cast(F, __builtin_bit_cast(std::uint32_t, mean) ^ ((codes & 1u) << 31));
}

}  // namespace simd16

#endif  // GRADCOMP_VECTOR_EXTENSIONS

}  // namespace gradcomp::detail
