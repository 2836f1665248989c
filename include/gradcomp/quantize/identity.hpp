// gradcomp/quantize/identity.hpp: the fp32 "quantizer": values travel as their IEEE float
// bits, 32 per value, unchanged (NaN payloads and Inf included). Summable as float.
#pragma once

#include <bit>
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/detail/quantizer_layout.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

struct identity {
  static constexpr quantizer_id id = quantizer_id::identity;
  static constexpr bool summable = true;
  using sum_type = float;
  static constexpr bool prescale_before_sum = false;

  [[nodiscard]] constexpr unsigned bits_per_value() const noexcept { return 32; }
  [[nodiscard]] constexpr quantizer_params params() const noexcept { return {}; }

  void encode(std::span<const float> values, const call_id& /*unused: deterministic*/,
              payload& out) const {
    detail::begin_encode("identity::encode", out, values.size(), id, 32, {});
    if (values.empty()) return;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(out.values.data(), values.data(), values.size() * sizeof(float));
    } else {
      for (std::size_t i = 0; i < values.size(); ++i) {
        detail::store_le32(out.values.data() + 4 * i, detail::float_to_bits(values[i]));
      }
    }
  }

  void decode(const payload& in, std::span<float> decoded) const {
    detail::check_decode("identity::decode", in, decoded.size(), id, 32, {});
    if (decoded.empty()) return;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(decoded.data(), in.values.data(), decoded.size() * sizeof(float));
    } else {
      for (std::size_t i = 0; i < decoded.size(); ++i) {
        decoded[i] = detail::bits_to_float(detail::load_le32(in.values.data() + 4 * i));
      }
    }
  }

  // On device memory: on_device(q).encode(...) and .decode(...) (gradcomp/cuda/quantize.cuh,
  // nvcc), with the same bytes and side values as the host's.
};

static_assert(gradcomp::quantizer<gradcomp::identity>);
static_assert(gradcomp::summable_quantizer<gradcomp::identity>);

}  // namespace gradcomp
