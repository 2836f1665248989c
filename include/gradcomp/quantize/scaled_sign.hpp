// gradcomp/quantize/scaled_sign.hpp: 1-bit scaled sign (EF-SignSGD): each value becomes
// +-mean|v| of its bucket by its sign. Biased: use it with error feedback. 1 bit per value
// plus one float mean per bucket.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/host_simd.hpp>
#include <gradcomp/detail/quantize_math.hpp>
#include <gradcomp/detail/quantizer_layout.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

namespace detail {

// mean|v| of a bucket, or 0 when the bucket holds NaN or Inf (it then decodes to +-0).
GRADCOMP_DETAIL_NOINLINE inline float scaled_sign_mean(const float* v, std::size_t n) {
  return scaled_sign_mean_from_sum(sum_of_abs(v, n), n);
}

}  // namespace detail

// Not summable. Non-finite inputs: a bucket holding NaN or Inf is sent with mean 0, so it
// decodes to +-0 (with error feedback the residual keeps the non-finite values).
struct scaled_sign {
  static constexpr quantizer_id id = quantizer_id::scaled_sign;
  static constexpr bool summable = false;

  constexpr scaled_sign() noexcept = default;
  // bucket_size 0 means one bucket for the whole payload.
  constexpr explicit scaled_sign(unsigned bucket_size) noexcept : bucket_size_(bucket_size) {}

  [[nodiscard]] constexpr unsigned bucket_size() const noexcept { return bucket_size_; }
  [[nodiscard]] constexpr unsigned bits_per_value() const noexcept { return 1; }
  [[nodiscard]] constexpr quantizer_params params() const noexcept { return {.levels = 0, .bucket_size = bucket_size_}; }

  // Code 1 = negative, 0 = non-negative (-0 and NaN included). Deterministic: the call id is
  // not used.
  void encode(std::span<const float> values, const call_id& /*call*/, payload& out) const {
    detail::begin_encode("scaled_sign::encode", out, values.size(), id, 1, params());
    const std::size_t n = values.size();
    const std::size_t bucket = bucket_size_ == 0 ? n + 1 : bucket_size_;
#if GRADCOMP_VECTOR_EXTENSIONS
    if (detail::encode_vector(values.data(), n, bucket, 1, out.values.data(), out.side.data(),
                               detail::simd16::scaled_sign_codec{})) {
      return;
    }
#endif
    float* side = out.side.data();
    std::size_t bucket_end = 0;
    detail::pack_codes_with(out.values.data(), n, 1, [&](std::size_t i) {
      if (i == bucket_end) [[unlikely]] {  // the bucket is still in cache for its signs
        bucket_end = std::min<std::size_t>(n, i + bucket);
        *side++ = detail::scaled_sign_mean(values.data() + i, bucket_end - i);
      }
      return detail::scaled_sign_code(values[i]);
    });
  }

  void decode(const payload& in, std::span<float> decoded) const {
    detail::check_decode("scaled_sign::decode", in, decoded.size(), id, 1, params());
    const std::size_t n = decoded.size();
    const std::size_t bucket = bucket_size_ == 0 ? n + 1 : bucket_size_;
    const float* side = in.side.data();
#if GRADCOMP_VECTOR_EXTENSIONS
    if (detail::decode_vector(in.values.data(), n, bucket, 1, side, decoded.data(),
                               detail::simd16::scaled_sign_codec{})) {
      return;
    }
#endif
    std::size_t bucket_end = 0;
    // The bucket's two values, detail::scaled_sign_value(c, mean) (the device decoder calls
    // that function), looked up by code: faster on the host than computing them.
    float level[2] = {0.0f, 0.0f};
    detail::unpack_codes_with(in.values.data(), n, 1, [&](std::size_t i, std::uint32_t c) {
      if (i == bucket_end) [[unlikely]] {
        bucket_end = std::min<std::size_t>(n, i + bucket);
        const float mean = *side++;
        level[0] = detail::scaled_sign_value(0u, mean);
        level[1] = detail::scaled_sign_value(1u, mean);
      }
      decoded[i] = level[c];
    });
  }

  // On device memory: on_device(q).encode(...) and .decode(...) (gradcomp/cuda/quantize.cuh,
  // nvcc), with the same bytes and side values as the host's.

 private:
  std::uint32_t bucket_size_ = 0;
};

static_assert(gradcomp::quantizer<gradcomp::scaled_sign>);

}  // namespace gradcomp
