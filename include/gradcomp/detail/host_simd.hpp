// gradcomp/detail/host_simd.hpp: the host quantizers' vector paths. Their loops are written
// once, with GCC/Clang vector extensions on chunks of 16 values, and compiled three times:
// for the build's own target (SSE2 on a plain x86-64 build, or whatever -march says), and,
// on x86, for AVX2 and for AVX-512 (F, BW, DQ, VL), picked at run time by what the CPU
// offers (detail/host_dispatch.hpp). A header-only library cannot assume its users build with
// -march=native; the dispatch gives them the wide paths anyway.
//
// Every path computes the same bits as the portable per-element loop (the device kernels'
// arithmetic, detail/quantize_math.hpp and detail/float16.hpp): integer and exactly-rounded
// float operations only, each the one the portable loop performs, and no fused multiply-add,
// so that the paths agree under any MXCSR setting (QSGD's and TernGrad's divisions follow its
// rounding mode and flush-to-zero on every path alike). The one hardware conversion used,
// fp16's F16C encoder, takes its rounding from its operand and ignores flush-to-zero (see
// half_encode_hardware, a function of its own per instruction set). The bucket sums, which
// GCC's vector extensions compile badly, use the AVX2 and AVX-512 intrinsics of the clone they
// run in (isa_tag), TernGrad's encoder has a loop of its own on AVX-512 with BMI2
// (terngrad_encode_hardware), and scaled sign's codes on AVX-512 are one compare into a mask
// register per 16 values (sign_codes_avx512).
// tests/quantize/same_bits_test.cpp runs every path against the portable one and against
// hashes recorded before the vector paths existed.
//
// detail::limit_host_isa lowers the ceiling (tests, and benchmarks that compare paths), as
// does the environment variable GRADCOMP_HOST_ISA=portable|baseline|avx2|avx512 read once at
// the first call; portable turns the vector paths off, as does GRADCOMP_NO_VECTOR_EXTENSIONS.
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
// bytes at out, as detail::pack_codes_with does. Below 8 bits: each code is shifted to its
// place within its byte and narrowed to a byte of its own; the 8 / bits bytes that make one
// output byte hold disjoint bits, so a multiply by 0x0101... adds (ORs) them into the top
// byte of their word without carries.
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
      const u8 b = __builtin_convertvector(codes << ((lane & 1u) * 4u), u8);
      const u16x8 w = __builtin_bit_cast(u16x8, b);
      store(out, __builtin_convertvector((w * std::uint16_t{0x0101}) >> 8, u8x8));
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

// ---------------------------------------------------------------------------------------
// Bucket statistics in the order of detail/quantize_math.hpp.

typedef float f32x4 __attribute__((vector_size(16)));
typedef double f64x4 __attribute__((vector_size(32)));

// chain4_sum(p, n, square_term or abs_term) with the four partial sums as the lanes of one
// vector: lane j receives the values 4q + j in increasing q, as partial j does, and the
// n % 4 values after the last whole quad go to lane 0 in order. The same additions in the
// same order, so the same bits.
template <bool Squares>
[[gnu::always_inline]] inline void chain4_term(const f32x4& x, f64x4& acc) {
  const f64x4 d = __builtin_convertvector(x, f64x4);
  if constexpr (Squares) {
    acc += d * d;
  } else {
    acc += __builtin_bit_cast(f64x4, __builtin_bit_cast(u64x4, d) & 0x7fffffffffffffffULL);
  }
}

template <bool Squares>
[[gnu::always_inline]] inline double chain4_finish(const f64x4& acc, const float* p,
                                                   std::size_t from, std::size_t n) {
  double s0 = acc[0];
  for (std::size_t i = from; i < n; ++i) {
    const auto d = static_cast<double>(p[i]);
    s0 += Squares ? d * d : std::fabs(d);
  }
  return (s0 + acc[1]) + (acc[2] + acc[3]);
}

template <bool Squares>
[[gnu::always_inline]] inline double chain4(const float* p, std::size_t n) {
  f64x4 acc{};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    f32x4 x;
    load(x, p + i);
    chain4_term<Squares>(x, acc);
  }
  return chain4_finish<Squares>(acc, p, i, n);
}

// chain4 of `chains` runs of n values each, `stride` values apart, into out[0 .. chains): each
// run's additions in chain4's order, but the runs' chains interleaved in one loop. One chain
// waits on its previous addition (4 values per addition's latency, about a quarter of what
// the memory delivers); `chains` independent ones keep up with it. Same bits as chain4 per run.
inline constexpr std::size_t chains = 8;

// The chains' lanes, 4 per run, back in chain4's form.
template <bool Squares>
[[gnu::always_inline]] inline void chain4_many_finish(const double* lanes, const float* p,
                                                      std::size_t stride, std::size_t i,
                                                      std::size_t n, double* out) {
  for (std::size_t r = 0; r < chains; ++r) {
    const f64x4 acc = {lanes[4 * r], lanes[4 * r + 1], lanes[4 * r + 2], lanes[4 * r + 3]};
    out[r] = chain4_finish<Squares>(acc, p + r * stride, i, n);
  }
}

// The AVX-512 and AVX2 clones take intrinsics: from the vector-extension form GCC 12 emits
// each 4-float to 4-double conversion as two half-width ones and an insert, and the loop ran
// at half the memory's speed. Products d * d of floats are exact in double, so whether the
// compiler fuses the multiply and the add makes no difference to the bits.
#if GRADCOMP_HOST_DISPATCH
// Runs of a few KB are too short for the hardware prefetcher to follow 8 of them at once
// (512 values each, QSGD's default: 2.0-2.4x the time of a streaming read, in scratch
// timings on the development machine). When the runs are back to back, the loops below
// fetch the next group of runs (`next`, chains * n values after this group's start) into L2
// as they go, two lines per step of 4 values, so that the whole group has been fetched when
// the step count runs out: 1.11x a streaming read at runs of 512 in the same timings. (Into
// L1 it measured 1.7x at every run length.)
[[gnu::always_inline]] inline void fetch_next_group(const float* next, std::size_t i) {
  _mm_prefetch(reinterpret_cast<const char*>(next + i * chains), _MM_HINT_T2);
  _mm_prefetch(reinterpret_cast<const char*>(next + i * chains + 16), _MM_HINT_T2);
}

template <bool Squares>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl")]] inline void
chain4_many_avx512(const float* p, std::size_t stride, std::size_t n, double* out,
                   bool fetch_next) {
  // Register r holds runs 2r (lanes 0-3) and 2r + 1 (lanes 4-7).
  __m512d acc[chains / 2];
  for (auto& a : acc) a = _mm512_setzero_pd();
  const __m512i abs_mask = _mm512_set1_epi64(0x7fffffffffffffffLL);
  const float* next = p + chains * stride;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if (fetch_next) fetch_next_group(next, i);
#pragma GCC unroll 4
    for (std::size_t r = 0; r < chains / 2; ++r) {
      const __m256 x = _mm256_set_m128(_mm_loadu_ps(p + (2 * r + 1) * stride + i),
                                       _mm_loadu_ps(p + 2 * r * stride + i));
      const __m512d d = _mm512_maskz_cvtps_pd(0xff, x);
      if constexpr (Squares) {
        acc[r] += d * d;
      } else {
        acc[r] += _mm512_castsi512_pd(_mm512_castpd_si512(d) & abs_mask);
      }
    }
  }
  alignas(64) double lanes[4 * chains];
  for (std::size_t r = 0; r < chains / 2; ++r) _mm512_store_pd(lanes + 8 * r, acc[r]);
  chain4_many_finish<Squares>(lanes, p, stride, i, n, out);
}

template <bool Squares>
[[gnu::target("avx2")]] inline void chain4_many_avx2(const float* p, std::size_t stride,
                                                     std::size_t n, double* out,
                                                     bool fetch_next) {
  __m256d acc[chains];
  for (auto& a : acc) a = _mm256_setzero_pd();
  const __m256i abs_mask = _mm256_set1_epi64x(0x7fffffffffffffffLL);
  const float* next = p + chains * stride;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if (fetch_next) fetch_next_group(next, i);
#pragma GCC unroll 8
    for (std::size_t r = 0; r < chains; ++r) {
      const __m256d d = _mm256_cvtps_pd(_mm_loadu_ps(p + r * stride + i));
      if constexpr (Squares) {
        acc[r] += d * d;
      } else {
        acc[r] += _mm256_castsi256_pd(_mm256_castpd_si256(d) & abs_mask);
      }
    }
  }
  alignas(32) double lanes[4 * chains];
  for (std::size_t r = 0; r < chains; ++r) _mm256_store_pd(lanes + 4 * r, acc[r]);
  chain4_many_finish<Squares>(lanes, p, stride, i, n, out);
}
#endif

// fetch_next: the runs are back to back (stride == n) and the next `chains` runs exist, to
// be prefetched.
template <bool Squares, host_isa Isa>
[[gnu::always_inline]] inline void chain4_many(const float* p, std::size_t stride,
                                               std::size_t n, double* out, bool fetch_next) {
#if GRADCOMP_HOST_DISPATCH
  if constexpr (Isa == host_isa::avx512) {
    chain4_many_avx512<Squares>(p, stride, n, out, fetch_next);
    return;
  } else if constexpr (Isa == host_isa::avx2) {
    chain4_many_avx2<Squares>(p, stride, n, out, fetch_next);
    return;
  }
#endif
  (void)fetch_next;
  f64x4 acc[chains] = {};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
#pragma GCC unroll 8
    for (std::size_t r = 0; r < chains; ++r) {
      f32x4 x;
      load(x, p + r * stride + i);
      chain4_term<Squares>(x, acc[r]);
    }
  }
  double lanes[4 * chains];
  for (std::size_t r = 0; r < chains; ++r) {
    for (std::size_t j = 0; j < 4; ++j) lanes[4 * r + j] = acc[r][j];
  }
  chain4_many_finish<Squares>(lanes, p, stride, i, n, out);
}

// detail::sum_of_squares (Squares) or detail::sum_of_abs of n values: detail::tree_reduce with
// the leaves above (the levels above them are few and stay scalar). The leaf loop is written
// out here rather than passed to tree_reduce: the compiler may keep tree_reduce out of line,
// which compiles the leaves for the build's target instead of the clone's (measured 2.5x
// slower for scaled sign's encoder). Whole leaves go `chains` at a time. After each group of
// leaves has been summed, visit(begin, end) is called with the group's range of p
// (consecutive, covering [0, n) in order, each begin a multiple of stat_block), while the
// cache still holds those values.
struct no_visit {
  void operator()(std::size_t, std::size_t) const noexcept {}
};

template <bool Squares, host_isa Isa, class Visit = no_visit>
[[gnu::always_inline]] inline double sum_tree(const float* p, std::size_t n, Visit&& visit = {}) {
  if (n <= stat_block) {
    const double sum = chain4<Squares>(p, n);
    visit(std::size_t{0}, n);
    return sum;
  }
  std::vector<double> level(stat_nodes(n));
  const std::size_t whole = n / stat_block;
  std::size_t c = 0;
  for (; c + chains <= whole; c += chains) {
    chain4_many<Squares, Isa>(p + c * stat_block, stat_block, stat_block, level.data() + c,
                              c + 2 * chains <= whole);
    visit(c * stat_block, (c + chains) * stat_block);
  }
  for (; c < level.size(); ++c) {
    const std::size_t first = c * stat_block;
    const std::size_t len = n - first < stat_block ? n - first : stat_block;
    level[c] = chain4<Squares>(p + first, len);
    visit(first, first + len);
  }
  return reduce_levels(level, sum_squares_reducer{});  // nodes are added as they are
}

// detail::max_abs_bits (exact in any order).
[[gnu::always_inline]] inline std::uint32_t max_abs_bits(const float* p, std::size_t n) {
  u32 m{};
  std::size_t i = 0;
  for (; i + width <= n; i += width) {
    u32 x;
    load(x, p + i);
    x &= 0x7fffffffu;
    m = x > m ? x : m;
  }
  std::uint32_t best = 0;
  for (std::size_t j = 0; j < width; ++j) best = m[j] > best ? m[j] : best;
  for (; i < n; ++i) {
    const std::uint32_t a = abs_bits(p[i]);
    best = a > best ? a : best;
  }
  return best;
}

// Whether a stream of `bits`-bit codes packs 16 codes into whole bytes the vector way.
constexpr bool packs(unsigned bits) noexcept {
  return bits == 1 || bits == 2 || bits == 4 || bits == 8 || bits == 16;
}

// Whether path Isa computes a chunk's per-value arithmetic as two halves of 8 lanes (see
// lane_types): the AVX2 clone, and the build's own target when that has AVX2 but not AVX-512.
template <host_isa Isa>
inline constexpr bool split_chunks = Isa == host_isa::avx2
#if defined(__AVX2__) && !defined(__AVX512F__)
                                     || Isa == host_isa::baseline
#endif
    ;

// codec.chunk_codes on the chunk of 16 values at v[i], whole or (split_chunks) as two halves.
template <host_isa Isa, class Codec>
[[gnu::always_inline]] inline void chunk_codes(const Codec& codec, const float* v, std::size_t i,
                                               float sv, u32& codes) {
  if constexpr (split_chunks<Isa>) {
    f32h lo, hi;
    load(lo, v + i);
    load(hi, v + i + width / 2);
    u32h clo, chi;
    codec.chunk_codes(lo, sv, i, clo);
    codec.chunk_codes(hi, sv, i + width / 2, chi);
    join_halves(clo, chi, codes);
  } else {
    f32 x;
    load(x, v + i);
    codec.chunk_codes(x, sv, i, codes);
  }
}

// codec.chunk_values of 16 codes into out[0, 16), whole or (split_chunks) as two halves.
template <host_isa Isa, class Codec>
[[gnu::always_inline]] inline void chunk_values(const Codec& codec, const u32& codes, float sv,
                                                float* out) {
  if constexpr (split_chunks<Isa>) {
    u32h clo, chi;
    split_halves(codes, clo, chi);
    f32h lo, hi;
    codec.chunk_values(clo, sv, lo);
    codec.chunk_values(chi, sv, hi);
    store(out, lo);
    store(out + width / 2, hi);
  } else {
    f32 x;
    codec.chunk_values(codes, sv, x);
    store(out, x);
  }
}

#if GRADCOMP_HOST_DISPATCH
// Scaled sign's codes on AVX-512, `chunks` chunks of 16 values: code j is v < 0 (an ordered
// compare, so -0 and NaN give 0, as scaled_sign_code does), and a chunk's 16 codes are its two
// bytes with code j in bit j, the packing's order. One compare into a mask register per chunk,
// where the generic clone builds a vector of codes and gathers their bits with a multiply.
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl")]] inline void sign_codes_avx512(
    const float* v, std::size_t chunks, std::byte* out) {
  for (std::size_t c = 0; c < chunks; ++c) {
    const auto word = static_cast<std::uint16_t>(
        _mm512_cmp_ps_mask(_mm512_loadu_ps(v + width * c), _mm512_setzero_ps(), _CMP_LT_OQ));
    std::memcpy(out + 2 * c, &word, sizeof word);
  }
}
#endif

// One bucket's codes, values [i, end) with side value sv: 16 at a time by
// codec.chunk_codes(chunk, side value, index of the chunk's first value, codes), the rest by
// codec.code(value, side value, index), the per-element function of the portable loop.
template <host_isa Isa, class Codec>
[[gnu::always_inline]] inline void encode_codes(const float* v, std::size_t i, std::size_t end,
                                                float sv, unsigned bits, std::byte* out,
                                                const Codec& codec) {
#if GRADCOMP_HOST_DISPATCH
  if constexpr (Isa == host_isa::avx512 && requires { requires Codec::sign_compare; }) {
    if (bits == 1) {  // i is a bucket's or a leaf group's start: a multiple of 16 (vector_layout)
      const std::size_t chunks = (end - i) / width;
      sign_codes_avx512(v + i, chunks, out + i / 8);
      i += chunks * width;
    }
  }
#endif
  // A count of chunks, not i + width <= end: GCC 12 (-Warray-bounds) otherwise sees a
  // wrapped i + width and a chunk read from a 3-value vector.
  for (std::size_t chunks = (end - i) / width; chunks > 0; --chunks, i += width) {
    u32 codes;
    chunk_codes<Isa>(codec, v, i, sv, codes);
    if constexpr (split_chunks<Isa>) {
      pack_halves(out + i * bits / 8, codes, bits);
    } else {
      pack(out + i * bits / 8, codes, bits);
    }
  }
  if (i < end) {
    pack_codes_with(out + i * bits / 8, end - i, bits, [&](std::size_t j) {
      return static_cast<std::uint32_t>(codec.code(v[i + j], sv, i + j));
    });
  }
}

// Codecs whose side value is a sum over the bucket (of squares, or of |v|) say so with
// `squares` and side_of_sum(sum, count); the others compute it with side(values, count).
template <class Codec>
concept sum_side_codec = requires(const Codec& c, double sum, std::size_t n) {
  { Codec::squares } -> std::convertible_to<bool>;
  { c.side_of_sum(sum, n) } -> std::same_as<float>;
};

// Codecs whose codes depend neither on the side value nor on the value's index say so with
// codes_without_side = true: the encoder may write a bucket's codes before its side value is
// known.
template <class Codec>
concept codes_without_side = requires { requires Codec::codes_without_side; };

// The side value of the bucket of n values at p.
template <host_isa Isa, class Codec>
[[gnu::always_inline]] inline float bucket_side(const Codec& codec, const float* p,
                                                std::size_t n) {
  if constexpr (sum_side_codec<Codec>) {
    return codec.side_of_sum(sum_tree<Codec::squares, Isa>(p, n), n);
  } else {
    return codec.side(p, n);
  }
}

// The encoders' loop: for each bucket of `bucket` values (the last may be shorter), its side
// value (bucket_side; stored when side is not null), then its codes (encode_codes). Buckets
// with a sum as their side value get the sums `chains` at a time while a bucket is at most one
// leaf of the summation tree. Preconditions: packs(bits), and bucket a multiple of 16 or larger than n,
// so that only the last bucket has a partial chunk and every chunk starts on a byte.
template <host_isa Isa, class Codec>
[[gnu::always_inline]] inline void encode_buckets(const float* v, std::size_t n,
                                                  std::size_t bucket, unsigned bits,
                                                  std::byte* out, float* side,
                                                  const Codec& codec) {
  std::size_t first = 0;
  if constexpr (sum_side_codec<Codec>) {
    if (bucket <= stat_block) {
      double sums[chains];
      for (; n - first >= chains * bucket; first += chains * bucket) {
        chain4_many<Codec::squares, Isa>(v + first, bucket, bucket, sums,
                                         n - first >= 2 * chains * bucket);
        for (std::size_t r = 0; r < chains; ++r) {
          const float sv = codec.side_of_sum(sums[r], bucket);
          if (side != nullptr) *side++ = sv;
          const std::size_t at = first + r * bucket;
          encode_codes<Isa>(v, at, at + bucket, sv, bits, out, codec);
        }
      }
    }
  }
  for (; first < n; first += bucket) {
    const std::size_t end = n - first < bucket ? n : first + bucket;
    if constexpr (sum_side_codec<Codec> && codes_without_side<Codec>) {
      // Codes that do not depend on the side value (scaled sign's v < 0) are written group by
      // group as the sum goes, from the cache: one read of a large bucket instead of two.
      const double sum = sum_tree<Codec::squares, Isa>(
          v + first, end - first, [&](std::size_t b, std::size_t e) {
            encode_codes<Isa>(v, first + b, first + e, 0.0f, bits, out, codec);
          });
      const float sv = codec.side_of_sum(sum, end - first);
      if (side != nullptr) *side++ = sv;
    } else {
      const float sv = bucket_side<Isa>(codec, v + first, end - first);
      if (side != nullptr) *side++ = sv;
      encode_codes<Isa>(v, first, end, sv, bits, out, codec);
    }
  }
}

// The decoders' loop, with the same preconditions: codec.chunk_values(codes, side value,
// values) for 16 values at a time, codec.value(code, side value) for the rest.
template <host_isa Isa, class Codec>
[[gnu::always_inline]] inline void decode_buckets(const std::byte* in, std::size_t n,
                                                  std::size_t bucket, unsigned bits,
                                                  const float* side, float* out,
                                                  const Codec& codec) {
  for (std::size_t first = 0; first < n; first += bucket) {
    const std::size_t end = n - first < bucket ? n : first + bucket;
    const float sv = side != nullptr ? *side++ : 0.0f;
    std::size_t i = first;
    for (; i + width <= end; i += width) {
      u32 codes;
      unpack(in + i * bits / 8, bits, codes);
      chunk_values<Isa>(codec, codes, sv, out + i);
    }
    if (i < end) {
      unpack_codes_with(in + i * bits / 8, end - i, bits, [&](std::size_t j, std::uint32_t c) {
        out[i + j] = codec.value(c, sv);
      });
    }
  }
}

// The largest of the n codes at in (0 when n = 0), field by field within whole bytes, 64
// bytes at a time. Preconditions: bits in {1, 2, 4, 8} and the padding bits above the last
// code zero (check_decode ensures it), so that padding cannot raise the maximum.
[[gnu::always_inline]] inline std::uint32_t max_code(const std::byte* in, std::size_t n,
                                                     unsigned bits) {
  typedef std::uint8_t u8x64 __attribute__((vector_size(64)));
  const std::size_t bytes = static_cast<std::size_t>(packed_size(n, bits));
  const auto mask = static_cast<std::uint8_t>((1u << bits) - 1u);
  u8x64 maskv;  // a vector, not a scalar: GCC refuses a variable scalar wider than the lane
  std::memset(&maskv, mask, sizeof maskv);
  u8x64 m{};
  std::size_t i = 0;
  for (; i + sizeof(u8x64) <= bytes; i += sizeof(u8x64)) {
    u8x64 b;
    load(b, in + i);
    for (unsigned f = 0; f < 8; f += bits) {
      const u8x64 c = (b >> f) & maskv;
      m = c > m ? c : m;
    }
  }
  unsigned best = 0;
  for (std::size_t j = 0; j < sizeof(u8x64); ++j) best = m[j] > best ? m[j] : best;
  for (; i < bytes; ++i) {
    const auto b = static_cast<unsigned>(in[i]);
    for (unsigned f = 0; f < 8; f += bits) best = ((b >> f) & mask) > best ? (b >> f) & mask : best;
  }
  return best;
}

// The codecs: each quantizer's per-element functions (the portable loop's) and their 16-lane
// forms, for encode_buckets and decode_buckets.
struct half_codec {
  static float side(const float*, std::size_t) { return 0.0f; }
  template <class F, class U>
  [[gnu::always_inline]] static void chunk_codes(const F& x, float, std::size_t, U& c) { half_bits(x, c); }
  [[gnu::always_inline]] static std::uint32_t code(float x, float, std::size_t) { return float_to_half_bits(x); }
  template <class U, class F>
  [[gnu::always_inline]] static void chunk_values(const U& c, float, F& x) { half_to_float(c, x); }
  [[gnu::always_inline]] static float value(std::uint32_t c, float) {
    return half_bits_to_float(static_cast<std::uint16_t>(c));
  }
};

struct bf16_codec {
  static float side(const float*, std::size_t) { return 0.0f; }
  template <class F, class U>
  [[gnu::always_inline]] static void chunk_codes(const F& x, float, std::size_t, U& c) { bf16_bits(x, c); }
  [[gnu::always_inline]] static std::uint32_t code(float x, float, std::size_t) { return float_to_bf16_bits(x); }
};

struct qsgd_codec {
  counter_rng rng;
  std::uint32_t s;
  float inv_s;
  static constexpr bool squares = true;
  [[gnu::always_inline]] static float side_of_sum(double sum, std::size_t) {
    return qsgd_norm_from_sum(sum);
  }
  template <class F, class U>
  [[gnu::always_inline]] void chunk_codes(const F& x, float norm, std::size_t i, U& c) const {
    if (!(norm > 0.0f)) {
      c = U{} + s;
      return;
    }
    F u;
    uniform(rng.key, i, u);
    qsgd_codes(x, norm, s, u, c);
  }
  [[gnu::always_inline]] std::uint32_t code(float x, float norm, std::size_t i) const {
    return qsgd_code(x, norm, s, rng.uniform(i));
  }
  template <class U, class F>
  [[gnu::always_inline]] void chunk_values(const U& c, float norm, F& x) const { qsgd_values(c, norm, s, inv_s, x); }
  [[gnu::always_inline]] float value(std::uint32_t c, float norm) const { return qsgd_value(norm, c, s, inv_s); }
};

struct terngrad_codec {
  counter_rng rng;
  [[gnu::always_inline]] static float side(const float* p, std::size_t n) {
    return terngrad_max_from_bits(max_abs_bits(p, n));
  }
  template <class F, class U>
  [[gnu::always_inline]] void chunk_codes(const F& x, float max, std::size_t i, U& c) const {
    if (!(max > 0.0f)) {
      c = U{};
      return;
    }
    F u;
    uniform(rng.key, i, u);
    terngrad_codes(x, max, u, c);
  }
  [[gnu::always_inline]] std::uint32_t code(float x, float max, std::size_t i) const {
    return terngrad_code(x, max, rng.uniform(i));
  }
  template <class U, class F>
  [[gnu::always_inline]] static void chunk_values(const U& c, float max, F& x) { terngrad_values(c, max, x); }
  [[gnu::always_inline]] static float value(std::uint32_t c, float max) { return terngrad_value(c, max); }
};

struct scaled_sign_codec {
  static constexpr bool squares = false;
  static constexpr bool sign_compare = true;  // its code is v < 0: sign_codes_avx512
  static constexpr bool codes_without_side = true;  // nor on the mean
  [[gnu::always_inline]] static float side_of_sum(double sum, std::size_t n) {
    return scaled_sign_mean_from_sum(sum, n);
  }
  template <class F, class U>
  [[gnu::always_inline]] static void chunk_codes(const F& x, float, std::size_t, U& c) {
    c = __builtin_bit_cast(U, x < 0.0f) & 1u;
  }
  [[gnu::always_inline]] static std::uint32_t code(float x, float, std::size_t) { return scaled_sign_code(x); }
  template <class U, class F>
  [[gnu::always_inline]] static void chunk_values(const U& c, float mean, F& x) { scaled_sign_values(c, mean, x); }
  [[gnu::always_inline]] static float value(std::uint32_t c, float mean) { return scaled_sign_value(c, mean); }
};

}  // namespace simd16

// The quantizers' entry points. Each takes the vector path and returns true when that path is
// on and takes this layout (packs(bits), and buckets that are a multiple of 16 values or one
// bucket larger than n); otherwise it returns false having done nothing, and the caller runs
// its portable loop.
inline bool vector_layout(std::size_t n, std::size_t bucket, unsigned bits) noexcept {
  return simd16::packs(bits) && (bucket % simd16::width == 0 || bucket > n);
}

// The code width as a constant inside the clone (encode_vector and decode_vector switch on
// it): with a run-time width the packing of each chunk is chosen per chunk, which measured
// 1.2x slower for fp16's encoder.
template <unsigned Bits, class Codec>
void encode_with(host_isa isa, const float* values, std::size_t n, std::size_t bucket,
                 std::byte* out, float* side, const Codec& codec) {
  run_vector(isa, [&](auto tag) {
    simd16::encode_buckets<decltype(tag)::value>(values, n, bucket, Bits, out, side, codec);
  });
}

template <unsigned Bits, class Codec>
void decode_with(host_isa isa, const std::byte* in, std::size_t n, std::size_t bucket,
                 const float* side, float* out, const Codec& codec) {
  run_vector(isa, [&](auto tag) {
    simd16::decode_buckets<decltype(tag)::value>(in, n, bucket, Bits, side, out, codec);
  });
}

template <class Codec>
bool encode_vector(const float* values, std::size_t n, std::size_t bucket, unsigned bits,
                   std::byte* out, float* side, const Codec& codec) {
  const host_isa isa = active_host_isa();
  if (isa == host_isa::portable || !vector_layout(n, bucket, bits)) return false;
  switch (bits) {
    case 1: encode_with<1>(isa, values, n, bucket, out, side, codec); break;
    case 2: encode_with<2>(isa, values, n, bucket, out, side, codec); break;
    case 4: encode_with<4>(isa, values, n, bucket, out, side, codec); break;
    case 8: encode_with<8>(isa, values, n, bucket, out, side, codec); break;
    default: encode_with<16>(isa, values, n, bucket, out, side, codec); break;
  }
  return true;
}

template <class Codec>
bool decode_vector(const std::byte* in, std::size_t n, std::size_t bucket, unsigned bits,
                   const float* side, float* out, const Codec& codec) {
  const host_isa isa = active_host_isa();
  if (isa == host_isa::portable || !vector_layout(n, bucket, bits)) return false;
  switch (bits) {
    case 1: decode_with<1>(isa, in, n, bucket, side, out, codec); break;
    case 2: decode_with<2>(isa, in, n, bucket, side, out, codec); break;
    case 4: decode_with<4>(isa, in, n, bucket, side, out, codec); break;
    case 8: decode_with<8>(isa, in, n, bucket, side, out, codec); break;
    default: decode_with<16>(isa, in, n, bucket, side, out, codec); break;
  }
  return true;
}

// fp16's encoder on the CPU's own conversion (F16C's VCVTPS2PH, on the AVX2 and AVX-512
// paths), which rounds to nearest even by its immediate operand (not by MXCSR), keeps a
// NaN's top payload bits and sets its quiet bit, and, as the Intel and AMD manuals say,
// ignores MXCSR.FTZ (binary16 subnormals come out exact) while MXCSR.DAZ only turns float
// subnormals, which become a signed zero anyway, into that zero: the bits of
// detail::float_to_half_bits, once finite values beyond 65504 are clamped to it first (the
// conversion would give Inf). tests/quantize/same_bits_test.cpp checks every 1021st float
// bit pattern, with FTZ and DAZ set and clear. The integer emulation (half_bits above) took
// 1.7x a copy; this is memory-bound.
#if GRADCOMP_HOST_DISPATCH
// CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports does not accept "f16c").
inline bool cpu_has_f16c() noexcept {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
  }();
  return has;
}

[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,f16c")]] inline void half_encode_avx512(
    const float* v, std::size_t n, std::byte* out) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
  const __m512i max_bits = _mm512_set1_epi32(0x477fe000);  // 65504
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i x = _mm512_loadu_si512(v + i);
    // Vector operators, not the and/andnot/cvt intrinsics: GCC 12's forms of those pass an
    // undefined vector that -Wmaybe-uninitialized reports.
    const __m512i ax = x & abs_mask;
    const __mmask16 finite = _mm512_cmplt_epu32_mask(ax, inf_bits);
    const __m512i clamped = _mm512_mask_min_epu32(ax, finite, ax, max_bits);
    const __m512i y = clamped | (x & ~abs_mask);
    const __m256i h = _mm512_maskz_cvtps_ph(0xffff, _mm512_castsi512_ps(y),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i), h);
  }
  for (; i < n; ++i) {
    const std::uint16_t h = float_to_half_bits(v[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

[[gnu::target("avx2,f16c")]] inline void half_encode_avx2(const float* v, std::size_t n,
                                                           std::byte* out) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf_bits = _mm256_set1_epi32(0x7f800000);
  const __m256i max_bits = _mm256_set1_epi32(0x477fe000);  // 65504
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
    const __m256i ax = _mm256_and_si256(x, abs_mask);
    const __m256i finite = _mm256_cmpgt_epi32(inf_bits, ax);  // ax < 2^31: signed is fine
    const __m256i clamped = _mm256_blendv_epi8(ax, _mm256_min_epu32(ax, max_bits), finite);
    const __m256i y = _mm256_or_si256(clamped, _mm256_andnot_si256(abs_mask, x));
    const __m128i h = _mm256_cvtps_ph(_mm256_castsi256_ps(y),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), h);
  }
  for (; i < n; ++i) {
    const std::uint16_t h = float_to_half_bits(v[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

// Whether the CPU has BMI2 (PDEP), for TernGrad's encoder below.
inline bool cpu_has_bmi2() noexcept {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("bmi2") != 0;
  }();
  return has;
}

// Vector operators on these types rather than the shift and conversion intrinsics, whose
// GCC 12 forms pass an undefined vector that -Wmaybe-uninitialized reports.
typedef std::uint64_t u64x8 __attribute__((vector_size(64)));
typedef std::uint32_t u32x16 __attribute__((vector_size(64)));
typedef std::int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

// TernGrad's encoder on AVX-512 with BMI2. The generic clone spends most of its time turning
// each chunk's 16 comparisons into a vector of codes and narrowing that to 4 bytes (about 15
// vector instructions of some 37 per chunk, which the vector pipes execute one after another;
// the division and the draw's four 64-bit multiplies are the rest). Here the comparisons stay
// masks: the chunk's 32-bit word is the hit mask's bits where the value is not negative,
// deposited at even positions (code 1), and where it is, at odd positions (code 2), two PDEPs
// on the scalar side. The draw is counter_rng::uniform's mix64, lane by lane, on counters that
// advance by 16 a chunk. Same bits as the generic path: the same division and comparison (a
// hit needs |v| > 0, so the sign bit is v < 0 there), and the bucket's max is the codec's own
// (terngrad_codec::side, run in the AVX-512 clone).
//
// The codes of `chunks` chunks of 16 values from v[first] (first a multiple of 16) of a
// bucket whose max is > 0, into the 4 * chunks bytes at out + first / 4.
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,bmi2")]] inline void terngrad_chunks_avx512(
    const float* v, std::size_t first, std::size_t chunks, float max, std::uint64_t key,
    std::byte* out) {
  constexpr std::uint64_t c = 0x9e3779b97f4a7c15ULL;
  // Lane j of the chunk at i draws counter_rng::bits(i + j): mix64(key + (i + j + 1) * c).
  u64x8 z_lo{};
  u64x8 z_hi{};
  for (std::uint64_t j = 0; j < 8; ++j) {
    z_lo[j] = key + (first + j + 1) * c;
    z_hi[j] = key + (first + j + 9) * c;
  }
  const __m512i low_halves =
      _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const f32x16 maxv = f32x16{} + max;
  for (std::size_t k = 0, i = first; k < chunks; ++k, i += 16) {
    u64x8 a = z_lo;
    u64x8 b = z_hi;
    a = (a ^ (a >> 30)) * 0xbf58476d1ce4e5b9ULL;
    b = (b ^ (b >> 30)) * 0xbf58476d1ce4e5b9ULL;
    a = (a ^ (a >> 27)) * 0x94d049bb133111ebULL;
    b = (b ^ (b >> 27)) * 0x94d049bb133111ebULL;
    // mix64's last step, z ^ (z >> 31), leaves the top 24 bits as they are.
    const __m512i top24 = _mm512_permutex2var_epi32(reinterpret_cast<__m512i>(a >> 40),
                                                    low_halves,
                                                    reinterpret_cast<__m512i>(b >> 40));
    const f32x16 u =
        __builtin_convertvector(reinterpret_cast<i32x16>(top24), f32x16) * 0x1.0p-24f;
    u32x16 x;
    std::memcpy(&x, v + i, sizeof x);
    const f32x16 q = reinterpret_cast<f32x16>(x & 0x7fffffffu) / maxv;
    const auto hit = static_cast<std::uint32_t>(
        _mm512_cmp_ps_mask(reinterpret_cast<__m512>(u), reinterpret_cast<__m512>(q), _CMP_LT_OQ));
    const auto neg = static_cast<std::uint32_t>(_mm512_movepi32_mask(reinterpret_cast<__m512i>(x)));
    const std::uint32_t word =
        _pdep_u32(hit & ~neg, 0x55555555u) | _pdep_u32(hit & neg, 0xaaaaaaaau);
    std::memcpy(out + i / 4, &word, 4);
    z_lo += 16 * c;
    z_hi += 16 * c;
  }
}
#endif

// TernGrad's encoder on AVX-512 with BMI2: true when the active path is avx512, the CPU has
// BMI2 and the layout is the vector paths' (vector_layout), having written the codes and one
// max per bucket; false having done nothing otherwise.
inline bool terngrad_encode_hardware(const float* v, std::size_t n, std::size_t bucket,
                                     const counter_rng& rng, std::byte* out, float* side) {
#if GRADCOMP_HOST_DISPATCH
  if (active_host_isa() != host_isa::avx512 || !cpu_has_bmi2() ||
      !vector_layout(n, bucket, 2)) {
    return false;
  }
  for (std::size_t first = 0; first < n; first += bucket) {
    const std::size_t end = n - first < bucket ? n : first + bucket;
    float max = 0.0f;
    run_avx512([&](auto) { max = simd16::terngrad_codec::side(v + first, end - first); });
    *side++ = max;
    const std::size_t chunks = (end - first) / simd16::width;
    if (max > 0.0f) {
      terngrad_chunks_avx512(v, first, chunks, max, rng.key, out);
    } else {
      std::memset(out + first / 4, 0, 4 * chunks);
    }
    const std::size_t i = first + chunks * simd16::width;
    if (i < end) {
      pack_codes_with(out + i / 4, end - i, 2, [&](std::size_t j) {
        return terngrad_code(v[i + j], max, rng.uniform(i + j));
      });
    }
  }
  return true;
#else
  (void)v;
  (void)n;
  (void)bucket;
  (void)rng;
  (void)out;
  (void)side;
  return false;
#endif
}

// fp16's encoder on the hardware conversion: true when the active path has it (AVX2 or
// AVX-512, and F16C), having written the n codes; false having done nothing otherwise.
inline bool half_encode_hardware(const float* v, std::size_t n, std::byte* out) {
#if GRADCOMP_HOST_DISPATCH
  const host_isa isa = active_host_isa();
  if (!cpu_has_f16c() || (isa != host_isa::avx2 && isa != host_isa::avx512)) return false;
  if (isa == host_isa::avx512) {
    half_encode_avx512(v, n, out);
  } else {
    half_encode_avx2(v, n, out);
  }
  return true;
#else
  (void)v;
  (void)n;
  (void)out;
  return false;
#endif
}

// detail::max_code's vector form for bits in {1, 2, 4, 8}: true with the maximum in `best`.
inline bool max_code_vector(const std::byte* in, std::size_t n, unsigned bits,
                            std::uint32_t& best) {
  const host_isa isa = active_host_isa();
  if (isa == host_isa::portable || !(bits == 1 || bits == 2 || bits == 4 || bits == 8)) {
    return false;
  }
  run_vector(isa, [&](auto) { best = simd16::max_code(in, n, bits); });
  return true;
}

#endif  // GRADCOMP_VECTOR_EXTENSIONS

}  // namespace gradcomp::detail
