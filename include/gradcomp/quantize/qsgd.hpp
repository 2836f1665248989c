// gradcomp/quantize/qsgd.hpp: QSGD stochastic quantization (Alistarh et al.) with s levels per
// bucket of consecutive values: unbiased, bit_width(2s) bits per value (s = 1: 2 bits,
// s = 7: 4 bits, s = 127: 8 bits) plus one float L2 norm per bucket.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/host_simd.hpp>
#include <gradcomp/detail/quantize_math.hpp>
#include <gradcomp/detail/quantizer_layout.hpp>
#include <gradcomp/detail/random.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

namespace detail {

// A bucket's L2 norm as sent (see qsgd_norm_from_sum); out of line, so that the per-element
// lambda that calls it stays small enough to be inlined into the packing loop.
GRADCOMP_DETAIL_NOINLINE inline float qsgd_norm(const float* v, std::size_t n) {
  return qsgd_norm_from_sum(sum_of_squares(v, n));
}

}  // namespace detail

// Not summable. Non-finite inputs: a bucket holding NaN or Inf is sent as zeros with norm 0
// (with error feedback the residual keeps the non-finite values); finite inputs whose norm
// overflows float are sent with norm FLT_MAX.
struct qsgd {
  static constexpr quantizer_id id = quantizer_id::qsgd;
  static constexpr bool summable = false;

  constexpr qsgd() noexcept = default;
  // levels s in [1, 2^15 - 1], bucket_size in [1, 2^24].
  constexpr explicit qsgd(unsigned levels, unsigned bucket_size = 512) {
    if (levels < 1u || levels > detail::qsgd_max_levels) {
      detail::throw_invalid_argument("qsgd", "levels", levels, "1 <= levels <= 32767");
    }
    if (bucket_size < 1u || bucket_size > detail::qsgd_max_bucket) {
      detail::throw_invalid_argument("qsgd", "bucket_size", bucket_size,
                                     "1 <= bucket_size <= 16777216 (2^24)");
    }
    levels_ = levels;
    bucket_size_ = bucket_size;
  }

  // The largest level count that fits `bits` bits: s = 2^(bits-1) - 1, bits in [2, 16].
  static constexpr qsgd with_bits(unsigned bits, unsigned bucket_size = 512) {
    if (bits < 2u || bits > 16u) {
      detail::throw_invalid_argument("qsgd::with_bits", "bits", bits, "2 <= bits <= 16");
    }
    return qsgd((1u << (bits - 1u)) - 1u, bucket_size);
  }

  [[nodiscard]] constexpr unsigned levels() const noexcept { return levels_; }
  [[nodiscard]] constexpr unsigned bucket_size() const noexcept { return bucket_size_; }
  [[nodiscard]] constexpr unsigned bits_per_value() const noexcept {
    return detail::qsgd_bits(levels_);
  }
  [[nodiscard]] constexpr quantizer_params params() const noexcept {
    return {.levels = levels_, .bucket_size = bucket_size_};
  }

  // One pass over memory: each bucket's norm is computed when its first code is needed, and
  // the bucket is still in cache for its codes.
  void encode(std::span<const float> values, const call_id& call, payload& out) const {
    const unsigned bits = bits_per_value();
    detail::begin_encode("qsgd::encode", out, values.size(), id, bits, params());
    const detail::counter_rng rng{detail::stream_key(call, detail::stream_tag::quantize)};
    const std::size_t n = values.size();
    const std::uint32_t s = levels_;
#if GRADCOMP_VECTOR_EXTENSIONS
    if (detail::encode_vector(values.data(), n, bucket_size_, bits, out.values.data(),
                               out.side.data(), detail::simd16::qsgd_codec{rng, s, 0.0f})) {
      return;
    }
#endif
    float* side = out.side.data();
    std::size_t bucket_end = 0;
    float norm = 0.0f;
    detail::pack_codes_with(out.values.data(), n, bits, [&](std::size_t i) {
      if (i == bucket_end) [[unlikely]] {
        bucket_end = std::min<std::size_t>(n, i + bucket_size_);
        norm = detail::qsgd_norm(values.data() + i, bucket_end - i);
        *side++ = norm;
      }
      return detail::qsgd_code(values[i], norm, s, rng.uniform(i));
    });
  }

  // v = norm * (code - s) / s; codes above 2s are rejected before anything is written.
  void decode(const payload& in, std::span<float> decoded) const {
    constexpr std::string_view where = "qsgd::decode";
    const unsigned bits = bits_per_value();
    detail::check_decode(where, in, decoded.size(), id, bits, params());
    const std::uint32_t s = levels_;
    if (detail::max_code(in) > 2u * s) detail::throw_invalid_code(where, in, 2u * s, "2 * levels");
    // (code - s) * (1/s) rounds to at most 1 in magnitude for s < 2^24, so |v| <= norm and a
    // norm near FLT_MAX cannot overflow.
    const float inv_s = 1.0f / static_cast<float>(s);
    const float* side = in.side.data();
    const std::size_t n = decoded.size();
#if GRADCOMP_VECTOR_EXTENSIONS
    if (detail::decode_vector(in.values.data(), n, bucket_size_, bits, side, decoded.data(),
                               detail::simd16::qsgd_codec{{}, s, inv_s})) {
      return;
    }
#endif
    std::size_t bucket_end = 0;
    float norm = 0.0f;
    detail::unpack_codes_with(in.values.data(), n, bits, [&](std::size_t i, std::uint32_t c) {
      if (i == bucket_end) [[unlikely]] {
        bucket_end = std::min<std::size_t>(n, i + bucket_size_);
        norm = *side++;
      }
      decoded[i] = detail::qsgd_value(norm, c, s, inv_s);
    });
  }

  // On device memory: on_device(q).encode(...) and .decode(...) (gradcomp/cuda/quantize.cuh,
  // nvcc), with the same bytes and side values as the host's.

 private:
  std::uint32_t levels_ = 7;
  std::uint32_t bucket_size_ = 512;
};

static_assert(gradcomp::quantizer<gradcomp::qsgd>);

}  // namespace gradcomp
