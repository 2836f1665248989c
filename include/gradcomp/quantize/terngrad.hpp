// gradcomp/quantize/terngrad.hpp: TernGrad (Wen et al.): each value becomes 0 or
// +-max|v| of its bucket, +-max with probability |v|/max; unbiased, 2 bits per value plus one
// float max per bucket.
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
#include <gradcomp/sparse.hpp>

namespace gradcomp {

namespace detail {

// max|v| of a bucket, or 0 when the bucket holds NaN or Inf (it then encodes as all zeros).
GRADCOMP_DETAIL_NOINLINE inline float terngrad_max(const float* v, std::size_t n) {
  return terngrad_max_from_bits(max_abs_bits(v, n));
}

}  // namespace detail

// Not summable. Non-finite inputs: a bucket holding NaN or Inf is sent as zeros with max 0
// (with error feedback the residual keeps the non-finite values).
struct terngrad {
  static constexpr quantizer_id id = quantizer_id::terngrad;
  static constexpr bool summable = false;

  constexpr terngrad() noexcept = default;
  // bucket_size 0 means one bucket for the whole payload.
  constexpr explicit terngrad(unsigned bucket_size) noexcept : bucket_size_(bucket_size) {}

  [[nodiscard]] constexpr unsigned bucket_size() const noexcept { return bucket_size_; }
  [[nodiscard]] constexpr unsigned bits_per_value() const noexcept { return 2; }
  [[nodiscard]] constexpr quantizer_params params() const noexcept { return {.levels = 0, .bucket_size = bucket_size_}; }

  void encode(std::span<const float> values, const call_id& call, payload& out) const {
    detail::begin_encode("terngrad::encode", out, values.size(), id, 2, params());
    const detail::counter_rng rng{detail::stream_key(call, detail::stream_tag::quantize)};
    const std::size_t n = values.size();
    const std::size_t bucket = bucket_size_ == 0 ? n + 1 : bucket_size_;
#if GRADCOMP_VECTOR_EXTENSIONS
    if (detail::terngrad_encode_hardware(values.data(), n, bucket, rng, out.values.data(),
                                         out.side.data())) {
      return;
    }
    if (detail::encode_vector(values.data(), n, bucket, 2, out.values.data(), out.side.data(),
                               detail::simd16::terngrad_codec{rng})) {
      return;
    }
#endif
    float* side = out.side.data();
    std::size_t bucket_end = 0;
    float max = 0.0f;
    detail::pack_codes_with(out.values.data(), n, 2, [&](std::size_t i) {
      if (i == bucket_end) [[unlikely]] {
        bucket_end = std::min<std::size_t>(n, i + bucket);
        max = detail::terngrad_max(values.data() + i, bucket_end - i);
        *side++ = max;
      }
      return detail::terngrad_code(values[i], max, rng.uniform(i));
    });
  }

  void decode(const payload& in, std::span<float> decoded) const {
    constexpr std::string_view where = "terngrad::decode";
    detail::check_decode(where, in, decoded.size(), id, 2, params());
    if (detail::max_code(in) > 2u)
      detail::throw_invalid_code(where, in, 2u, "0, 1 = +max, 2 = -max");
    const std::size_t n = decoded.size();
    const std::size_t bucket = bucket_size_ == 0 ? n + 1 : bucket_size_;
    const float* side = in.side.data();
#if GRADCOMP_VECTOR_EXTENSIONS
    if (detail::decode_vector(in.values.data(), n, bucket, 2, side, decoded.data(),
                               detail::simd16::terngrad_codec{})) {
      return;
    }
#endif
    std::size_t bucket_end = 0;
    // The bucket's three values, detail::terngrad_value(c, max) for c = 0, 1, 2 (the device
    // decoder calls that function), looked up by code: faster on the host than computing them.
    float level[3] = {0.0f, 0.0f, 0.0f};
    detail::unpack_codes_with(in.values.data(), n, 2, [&](std::size_t i, std::uint32_t c) {
      if (i == bucket_end) [[unlikely]] {
        bucket_end = std::min<std::size_t>(n, i + bucket);
        const float max = *side++;
        for (std::uint32_t code = 0; code < 3; ++code) level[code] = detail::terngrad_value(code, max);
      }
      decoded[i] = level[c];
    });
  }

  // On device memory: on_device(q).encode(...) and .decode(...) (gradcomp/cuda/quantize.cuh,
  // nvcc), with the same bytes and side values as the host's.

 private:
  std::uint32_t bucket_size_ = 0;
};

static_assert(gradcomp::quantizer<gradcomp::terngrad>);

}  // namespace gradcomp
