// gradcomp/detail/host_simd/draws_avx2.hpp: the stochastic encoders' codes on AVX2 (TernGrad,
// QSGD with 2-, 4- or 8-bit codes), written with intrinsics.
// Part of the host quantizers' vector paths (detail/host_simd.hpp says how they are built and
// checked).
//
// Why: AVX2 has no 64-bit multiply, and counter_rng's draw (mix64, two 64 x 64-bit multiplies)
// is most of a stochastic code's work. The generic clone, computing a chunk as two halves of 8
// lanes, lost its registers to the draw's 64-bit lanes (spills, and its codes narrowed and
// packed through scalar moves) and ran TernGrad's encoder at 5.9x a copy where AVX-512 runs it
// at 1.5x. Here the counters live in two registers of four 64-bit lanes (the even and the odd
// lanes of 8 values), advance by 8 with one add each, each multiply is three 32 x 32-bit
// products, and the codes stay in vector registers until one store per 8 values.
// The bits are the generic path's: the same mix64 lane by lane, the same division, product and
// comparisons (intrinsics are never contracted into fused multiply-adds), the same codes.
#pragma once

#include <gradcomp/detail/host_simd/sums.hpp>

namespace gradcomp::detail {

#if GRADCOMP_VECTOR_EXTENSIONS && GRADCOMP_HOST_DISPATCH

// Whether the CPU has BMI2 (PDEP), for TernGrad's encoders.
inline bool cpu_has_bmi2() noexcept {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("bmi2") != 0;
  }();
  return has;
}

namespace avx2 {

// counter_rng::uniform(i) for 8 consecutive i at a time: lane j of `even` holds the counter of
// value 2j, of `odd` the counter of value 2j + 1, each key + (i + 1) * c modulo 2^64
// (counter_rng::bits).
struct draws {
  __m256i even;
  __m256i odd;
};

inline constexpr std::uint64_t draw_step = 0x9e3779b97f4a7c15ULL;

// The counters of the 8 values from `first` on.
[[gnu::target("avx2"), gnu::always_inline]] inline void start_draws(draws& d, std::uint64_t key,
                                                                    std::uint64_t first) {
  constexpr std::uint64_t c = draw_step;
  const std::uint64_t base = key + first * c;
  d.even = _mm256_set_epi64x(static_cast<long long>(base + 7 * c),
                             static_cast<long long>(base + 5 * c),
                             static_cast<long long>(base + 3 * c),
                             static_cast<long long>(base + 1 * c));
  d.odd = _mm256_set_epi64x(static_cast<long long>(base + 8 * c),
                            static_cast<long long>(base + 6 * c),
                            static_cast<long long>(base + 4 * c),
                            static_cast<long long>(base + 2 * c));
}

// z * m modulo 2^64, lane by lane: lo(z) lo(m) + (hi(z) lo(m) + lo(z) hi(m)) 2^32.
template <std::uint64_t M>
[[gnu::target("avx2"), gnu::always_inline]] inline void mul64(__m256i& z) {
  const __m256i m_lo = _mm256_set1_epi64x(static_cast<long long>(M & 0xffffffffULL));
  const __m256i m_hi = _mm256_set1_epi64x(static_cast<long long>(M >> 32));
  const __m256i low = _mm256_mul_epu32(z, m_lo);
  const __m256i cross =
      _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(z, 32), m_lo), _mm256_mul_epu32(z, m_hi));
  z = _mm256_add_epi64(low, _mm256_slli_epi64(cross, 32));
}

// mix64 up to its last step, z ^ (z >> 31), which leaves the top 24 bits (all a draw uses) as
// they are.
[[gnu::target("avx2"), gnu::always_inline]] inline void mix_top(__m256i& z) {
  z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 30));
  mul64<0xbf58476d1ce4e5b9ULL>(z);
  z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 27));
  mul64<0x94d049bb133111ebULL>(z);
}

// The next 8 uniforms (counter_rng::uniform: the top 24 bits times 2^-24), in value order, and
// the counters advanced by 8.
[[gnu::target("avx2"), gnu::always_inline]] inline void next_uniforms(draws& d, __m256& u) {
  __m256i a = d.even;
  __m256i b = d.odd;
  mix_top(a);
  mix_top(b);
  // a >> 40 has the even values' 24 bits in the low 32 of each 64-bit lane, b >> 8 the odd
  // values' in the high 32 (with zeros above): blending the 32-bit lanes interleaves them.
  const __m256i top24 =
      _mm256_blend_epi32(_mm256_srli_epi64(a, 40), _mm256_srli_epi64(b, 8), 0xaa);
  u = _mm256_mul_ps(_mm256_cvtepi32_ps(top24), _mm256_set1_ps(0x1.0p-24f));
  const __m256i step = _mm256_set1_epi64x(static_cast<long long>(8 * draw_step));
  d.even = _mm256_add_epi64(d.even, step);
  d.odd = _mm256_add_epi64(d.odd, step);
}

// The sum of counter_rng{key}.uniform(i) for i < n rounded down to a multiple of 8, in 8
// lanes: the draws alone, which the benchmark quantize/draws times as what bounds the
// stochastic encoders on this path.
[[gnu::target("avx2")]] inline float uniform_sum(std::uint64_t key, std::size_t n) {
  draws d;
  start_draws(d, key, 0);
  __m256 acc = _mm256_setzero_ps();
  for (std::size_t i = 0; i + 8 <= n; i += 8) {
    __m256 u;
    next_uniforms(d, u);
    acc = _mm256_add_ps(acc, u);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float total = 0.0f;
  for (const float x : lanes) total += x;
  return total;
}

// TernGrad's codes of `chunks` chunks of 16 values from v[first] (first a multiple of 16) of a
// bucket whose max is > 0, into the 4 * chunks bytes at out + first / 4: a hit (u < |v| / max)
// is code 1, or 2 where v < 0; the 16 codes of a chunk are two PDEPs of the hit and sign masks
// (as terngrad_chunks_avx512 does). A hit needs |v| > 0, so the sign bit is v < 0 there.
[[gnu::target("avx2,bmi2")]] inline void terngrad_chunks(const float* v, std::size_t first,
                                                         std::size_t chunks, float max,
                                                         std::uint64_t key, std::byte* out) {
  draws d;
  start_draws(d, key, first);
  const __m256 maxv = _mm256_set1_ps(max);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (std::size_t k = 0, i = first; k < chunks; ++k, i += 16) {
    __m256 u0, u1;
    next_uniforms(d, u0);
    next_uniforms(d, u1);
    const __m256 x0 = _mm256_loadu_ps(v + i);
    const __m256 x1 = _mm256_loadu_ps(v + i + 8);
    const __m256 q0 = _mm256_div_ps(_mm256_and_ps(x0, abs_mask), maxv);
    const __m256 q1 = _mm256_div_ps(_mm256_and_ps(x1, abs_mask), maxv);
    const auto hit = static_cast<std::uint32_t>(
        _mm256_movemask_ps(_mm256_cmp_ps(u0, q0, _CMP_LT_OQ)) |
        (_mm256_movemask_ps(_mm256_cmp_ps(u1, q1, _CMP_LT_OQ)) << 8));
    const auto neg =
        static_cast<std::uint32_t>(_mm256_movemask_ps(x0) | (_mm256_movemask_ps(x1) << 8));
    const std::uint32_t word =
        _pdep_u32(hit & ~neg, 0x55555555u) | _pdep_u32(hit & neg, 0xaaaaaaaau);
    std::memcpy(out + i / 4, &word, 4);
  }
}

// QSGD's codes (qsgd_code, s levels, bits in {2, 4, 8}) of `chunks` chunks of 16 values from
// v[first] (first a multiple of 16) of a bucket whose norm is > 0, into out + first * bits / 8.
// Each 8 codes are shifted to their place in the stream (code j at bit j * bits, modulo 32),
// OR-ed together within each 128-bit half, and stored as bits bytes.
[[gnu::target("avx2")]] inline void qsgd_chunks(const float* v, std::size_t first,
                                                std::size_t chunks, float norm, std::uint32_t s,
                                                unsigned bits, std::uint64_t key,
                                                std::byte* out) {
  draws d;
  start_draws(d, key, first);
  const float fs = static_cast<float>(s);
  const __m256 fsv = _mm256_set1_ps(fs);
  const __m256 normv = _mm256_set1_ps(norm);
  const __m256i sv = _mm256_set1_epi32(static_cast<int>(s));
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const auto b = static_cast<int>(bits);
  const __m256i shifts = _mm256_set_epi32((7 * b) % 32, (6 * b) % 32, (5 * b) % 32, (4 * b) % 32,
                                          3 * b, 2 * b, b, 0);
  std::byte* o = out + first * bits / 8;
  for (std::size_t h = 0, i = first; h < 2 * chunks; ++h, i += 8, o += bits) {
    __m256 u;
    next_uniforms(d, u);
    const __m256 x = _mm256_loadu_ps(v + i);
    // r = s * (|v| / norm), at most s (NaN included), as qsgd_code.
    __m256 r = _mm256_mul_ps(fsv, _mm256_div_ps(_mm256_and_ps(x, abs_mask), normv));
    r = _mm256_blendv_ps(fsv, r, _mm256_cmp_ps(r, fsv, _CMP_LE_OQ));
    const __m256i low = _mm256_cvttps_epi32(r);  // r in [0, s]: truncation is floor
    const __m256 frac = _mm256_sub_ps(r, _mm256_cvtepi32_ps(low));
    const __m256i level =
        _mm256_sub_epi32(low, _mm256_castps_si256(_mm256_cmp_ps(u, frac, _CMP_LT_OQ)));
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256i code = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_add_epi32(sv, level)),
                         _mm256_castsi256_ps(_mm256_sub_epi32(sv, level)), neg));
    __m256i t = _mm256_sllv_epi32(code, shifts);
    t = _mm256_or_si256(t, _mm256_shuffle_epi32(t, 0x4e));
    t = _mm256_or_si256(t, _mm256_shuffle_epi32(t, 0xb1));
    const auto lo = static_cast<std::uint32_t>(_mm256_cvtsi256_si32(t));
    const auto hi = static_cast<std::uint32_t>(_mm256_extract_epi32(t, 4));
    if (bits == 8) {
      std::memcpy(o, &lo, 4);
      std::memcpy(o + 4, &hi, 4);
    } else {
      const std::uint32_t word = lo | hi;
      std::memcpy(o, &word, bits);  // 2 or 4 bytes, the low ones (little-endian)
    }
  }
}

}  // namespace avx2

#endif  // GRADCOMP_VECTOR_EXTENSIONS && GRADCOMP_HOST_DISPATCH

}  // namespace gradcomp::detail
