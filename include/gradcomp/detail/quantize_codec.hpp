// gradcomp/detail/quantize_codec.hpp: one value <-> one code of each quantizer, given the
// bucket side values, as the device kernels (gradcomp/cuda/kernels/quantize.cuh) apply them
// element by element; and the side value of a bucket from its statistic. Host-compilable so
// that the host tests run exactly what the kernels run (tests/detail/quantize_math_test.cpp
// replays the kernels' work split on the host and compares it with the host encoders).
#pragma once

#include <cstddef>
#include <cstdint>

#include <gradcomp/config.hpp>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/detail/quantize_math.hpp>
#include <gradcomp/detail/random.hpp>

namespace gradcomp::detail {

// Codecs. Bucket sizes are never 0 here (the device dispatch turns "one bucket" into n).

struct qsgd_codec {
  counter_rng rng;
  std::uint32_t s;
  float inv_s;
  std::size_t bucket;
  GRADCOMP_HOST_DEVICE std::uint32_t code(float v, std::size_t i, const float* side) const {
    return qsgd_code(v, side[i / bucket], s, rng.uniform(i));
  }
  GRADCOMP_HOST_DEVICE float value(std::uint32_t c, std::size_t i, const float* side) const {
    return qsgd_value(side[i / bucket], c, s, inv_s);
  }
};

struct terngrad_codec {
  counter_rng rng;
  std::size_t bucket;
  GRADCOMP_HOST_DEVICE std::uint32_t code(float v, std::size_t i, const float* side) const {
    return terngrad_code(v, side[i / bucket], rng.uniform(i));
  }
  GRADCOMP_HOST_DEVICE float value(std::uint32_t c, std::size_t i, const float* side) const {
    return terngrad_value(c, side[i / bucket]);
  }
};

struct scaled_sign_codec {
  std::size_t bucket;
  GRADCOMP_HOST_DEVICE std::uint32_t code(float v, std::size_t, const float*) const {
    return scaled_sign_code(v);
  }
  GRADCOMP_HOST_DEVICE float value(std::uint32_t c, std::size_t i, const float* side) const {
    return scaled_sign_value(c, side[i / bucket]);
  }
};

struct fp16_codec {
  GRADCOMP_HOST_DEVICE std::uint32_t code(float v, std::size_t, const float*) const {
    return float_to_half_bits(v);
  }
  GRADCOMP_HOST_DEVICE float value(std::uint32_t c, std::size_t, const float*) const {
    return half_bits_to_float(static_cast<std::uint16_t>(c));
  }
};

struct bf16_codec {
  GRADCOMP_HOST_DEVICE std::uint32_t code(float v, std::size_t, const float*) const {
    return float_to_bf16_bits(v);
  }
  GRADCOMP_HOST_DEVICE float value(std::uint32_t c, std::size_t, const float*) const {
    return bf16_bits_to_float(static_cast<std::uint16_t>(c));
  }
};

// Side value of a bucket from its reduced statistic and its length.
struct qsgd_side {
  GRADCOMP_HOST_DEVICE float operator()(double sum_sq, std::size_t) const {
    return qsgd_norm_from_sum(sum_sq);
  }
};
struct scaled_sign_side {
  GRADCOMP_HOST_DEVICE float operator()(double sum_abs, std::size_t n) const {
    return scaled_sign_mean_from_sum(sum_abs, n);
  }
};
struct terngrad_side {
  GRADCOMP_HOST_DEVICE float operator()(std::uint32_t max_bits, std::size_t) const {
    return terngrad_max_from_bits(max_bits);
  }
};

// The code of element i, for detail::pack_group.
template <class Codec>
struct code_of_value {
  const float* values;
  const float* side;
  Codec codec;
  GRADCOMP_HOST_DEVICE std::uint32_t operator()(std::size_t i) const {
    return codec.code(values[i], i, side);
  }
};

}  // namespace gradcomp::detail
