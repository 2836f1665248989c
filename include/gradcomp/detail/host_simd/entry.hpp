// gradcomp/detail/host_simd/entry.hpp: the quantizers' entry points into the vector paths, and the
// CPU's own conversions (F16C for fp16, BMI2 for TernGrad) behind feature probes.
// Part of the host quantizers' vector paths (detail/host_simd.hpp says how they are built and
// checked).
#pragma once

#include <gradcomp/detail/host_simd/codecs.hpp>

namespace gradcomp::detail {

#if GRADCOMP_VECTOR_EXTENSIONS

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
