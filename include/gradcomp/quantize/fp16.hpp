// gradcomp/quantize/fp16.hpp: IEEE binary16, round to nearest even, 16 bits per value.
// Summable as gradcomp::half, but P payloads of large values overflow a half sum, so an
// exchange divides by P before adding (prescale_before_sum).
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

// Finite values beyond +-65504 are sent as +-65504 (not Inf): with error feedback the residual
// keeps the excess and sends it later, where an Inf would poison it. NaN and Inf pass through.
struct fp16 {
  static constexpr quantizer_id id = quantizer_id::fp16;
  static constexpr bool summable = true;
  using sum_type = half;
  static constexpr bool prescale_before_sum = true;

  [[nodiscard]] constexpr unsigned bits_per_value() const noexcept { return 16; }
  [[nodiscard]] constexpr quantizer_params params() const noexcept { return {}; }

  void encode(std::span<const float> values, const call_id& /*unused: deterministic*/,
              payload& out) const {
    detail::begin_encode("fp16::encode", out, values.size(), id, 16, {});
#if GRADCOMP_VECTOR_EXTENSIONS
    if (detail::half_encode_hardware(values.data(), values.size(), out.values.data())) return;
    if (detail::encode_vector(values.data(), values.size(), values.size() + 1, 16,
                               out.values.data(), nullptr, detail::simd16::half_codec{})) {
      return;
    }
#endif
    detail::pack_codes_with(out.values.data(), values.size(), 16, [values](std::size_t i) {
      return static_cast<std::uint32_t>(detail::float_to_half_bits(values[i]));
    });
  }

  void decode(const payload& in, std::span<float> decoded) const {
    detail::check_decode("fp16::decode", in, decoded.size(), id, 16, {});
#if GRADCOMP_VECTOR_EXTENSIONS
    if (detail::decode_vector(in.values.data(), decoded.size(), decoded.size() + 1, 16, nullptr,
                               decoded.data(), detail::simd16::half_codec{})) {
      return;
    }
#endif
    detail::unpack_codes_with(
        in.values.data(), decoded.size(), 16, [decoded](std::size_t i, std::uint32_t c) {
          decoded[i] = detail::half_bits_to_float(static_cast<std::uint16_t>(c));
        });
  }

  // On device memory: on_device(q).encode(...) and .decode(...) (gradcomp/cuda/quantize.cuh,
  // nvcc), with the same bytes and side values as the host's.
};

static_assert(gradcomp::quantizer<gradcomp::fp16>);
static_assert(gradcomp::summable_quantizer<gradcomp::fp16>);

}  // namespace gradcomp
