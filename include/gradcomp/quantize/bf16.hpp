// gradcomp/quantize/bf16.hpp: bfloat16 (the top 16 bits of a float), round to nearest even.
// Summable as gradcomp::bfloat16; its float-sized exponent range needs no prescaling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/detail/host_simd.hpp>
#include <gradcomp/detail/quantizer_layout.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

// Finite values that would round to Inf are sent as +-3.3895e38, for the same reason as fp16:
// the residual keeps the excess. NaN and Inf pass through.
struct bf16 {
  static constexpr quantizer_id id = quantizer_id::bf16;
  static constexpr bool summable = true;
  using sum_type = bfloat16;
  static constexpr bool prescale_before_sum = false;

  [[nodiscard]] constexpr unsigned bits_per_value() const noexcept { return 16; }
  [[nodiscard]] constexpr quantizer_params params() const noexcept { return {}; }

  void encode(std::span<const float> values, const call_id& /*unused: deterministic*/,
              payload& out) const {
    detail::begin_encode("bf16::encode", out, values.size(), id, 16, {});
#if GRADCOMP_VECTOR_EXTENSIONS
    if (detail::encode_vector(values.data(), values.size(), values.size() + 1, 16,
                               out.values.data(), nullptr, detail::simd16::bf16_codec{})) {
      return;
    }
#endif
    detail::pack_codes_with(out.values.data(), values.size(), 16, [values](std::size_t i) {
      return static_cast<std::uint32_t>(detail::float_to_bf16_bits(values[i]));
    });
  }

  void decode(const payload& in, std::span<float> decoded) const {
    detail::check_decode("bf16::decode", in, decoded.size(), id, 16, {});
    detail::unpack_codes_with(
        in.values.data(), decoded.size(), 16, [decoded](std::size_t i, std::uint32_t c) {
          decoded[i] = detail::bf16_bits_to_float(static_cast<std::uint16_t>(c));
        });
  }

  // On device memory: on_device(q).encode(...) and .decode(...) (gradcomp/cuda/quantize.cuh,
  // nvcc), with the same bytes and side values as the host's.
};

static_assert(gradcomp::quantizer<gradcomp::bf16>);
static_assert(gradcomp::summable_quantizer<gradcomp::bf16>);

}  // namespace gradcomp
