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
#include <gradcomp/device.hpp>
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

  // Device overloads (gradcomp/cuda/quantize.cuh, nvcc): the same encode and decode on device
  // spans, given a temp_storage and a stream; the bytes and side values equal the host's.
  template <class... Args>
  decltype(auto) encode(temp_storage& tmp, Args&&... args) const {
    using impl = device_policy<typename detail::dependent_type<identity, Args...>::type>;
    return impl::encode(*this, tmp, std::forward<Args>(args)...);
  }
  template <class... Args>
  decltype(auto) decode(temp_storage& tmp, Args&&... args) const {
    using impl = device_policy<typename detail::dependent_type<identity, Args...>::type>;
    return impl::decode(*this, tmp, std::forward<Args>(args)...);
  }
};

static_assert(gradcomp::quantizer<gradcomp::identity>);
static_assert(gradcomp::summable_quantizer<gradcomp::identity>);

}  // namespace gradcomp
