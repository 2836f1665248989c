// gradcomp/detail/host_simd/codecs.hpp: the loops over buckets (encode, decode, the largest code)
// and the codecs: each quantizer's per-element functions and their 16-lane forms.
// Part of the host quantizers' vector paths (detail/host_simd.hpp says how they are built and
// checked).
#pragma once

#include <gradcomp/detail/host_simd/draws_avx2.hpp>
#include <gradcomp/detail/host_simd/sums.hpp>

namespace gradcomp::detail {

#if GRADCOMP_VECTOR_EXTENSIONS

namespace simd16 {

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
  // The stochastic codecs on AVX2 (draws_avx2.hpp), where the CPU and the width allow.
  if constexpr (Isa == host_isa::avx2 &&
                requires { codec.codes_avx2(v, i, std::size_t{}, sv, bits, out); }) {
    const std::size_t chunks = (end - i) / width;
    if (chunks > 0 && codec.codes_avx2(v, i, chunks, sv, bits, out)) i += chunks * width;
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
#if GRADCOMP_HOST_DISPATCH
  // The codes of `chunks` chunks from v[i] on AVX2 (avx2::qsgd_chunks): false, having done
  // nothing, for widths it does not pack and a zero norm (every code s).
  bool codes_avx2(const float* v, std::size_t i, std::size_t chunks, float norm, unsigned bits,
                  std::byte* out) const {
    if (!(bits == 2 || bits == 4 || bits == 8) || !(norm > 0.0f)) return false;
    avx2::qsgd_chunks(v, i, chunks, norm, s, bits, rng.key, out);
    return true;
  }
#endif
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
#if GRADCOMP_HOST_DISPATCH
  // The codes of `chunks` chunks from v[i] on AVX2 with BMI2 (avx2::terngrad_chunks): false,
  // having done nothing, without BMI2 or for a zero max (every code 0).
  bool codes_avx2(const float* v, std::size_t i, std::size_t chunks, float max, unsigned bits,
                  std::byte* out) const {
    if (bits != 2 || !cpu_has_bmi2() || !(max > 0.0f)) return false;
    avx2::terngrad_chunks(v, i, chunks, max, rng.key, out);
    return true;
  }
#endif
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

#endif  // GRADCOMP_VECTOR_EXTENSIONS

}  // namespace gradcomp::detail
