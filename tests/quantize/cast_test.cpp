// identity, fp16 and bf16: exact / correctly rounded round trips, NaN and Inf kept, finite
// overflow saturated, and the summability traits exchanges rely on.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include <gradcomp/quantize.hpp>

#include "quantize_test_support.hpp"

namespace gq = gradcomp;
using gradcomp_test::blank;
using gradcomp_test::bernstein_bound;
using gradcomp_test::normal_values;

namespace {

// Random values over many magnitudes (including binary16 subnormals and overflow), plus
// specials.
std::vector<float> wide_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> e(-30.0f, 20.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = std::exp2(e(rng)) * ((rng() & 1u) != 0u ? 1.0f : -1.0f);
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::bit_cast<float>(0x7fc12345u),
                            65504.0f,
                            65520.0f,
                            -1e9f,
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min()};
  for (std::size_t i = 0; i < std::size(specials) && i < n; ++i) v[i * 7 % n] = specials[i];
  return v;
}

template <class Q>
std::vector<float> round_trip(const Q& q, const std::vector<float>& v) {
  gq::payload p = blank(v.size());
  q.encode(v, gq::call_id{}, p);
  std::vector<float> out(v.size());
  q.decode(p, out);
  return out;
}

}  // namespace

TEST_CASE("identity: every float comes back bit for bit, NaN payloads included") {
  for (const std::size_t n : {0, 1, 2, 3, 511, 512, 513, 100000}) {
    auto v = wide_values(n, n);
    std::mt19937 rng(1);
    for (std::size_t i = 0; i < n; i += 3)
      v[i] = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    const auto out = round_trip(gq::identity{}, v);
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(std::bit_cast<std::uint32_t>(out[i]) == std::bit_cast<std::uint32_t>(v[i]));
    }
  }
}

TEST_CASE("fp16: decoded = nearest binary16 (saturating), within half an ulp") {
  for (const std::size_t n : {0, 1, 2, 3, 511, 512, 513, 100000}) {
    const auto v = wide_values(n, n + 11);
    const auto out = round_trip(gq::fp16{}, v);
    for (std::size_t i = 0; i < n; ++i) {
      const float x = v[i];
      CAPTURE(x);
      if (std::isnan(x)) {
        REQUIRE(std::isnan(out[i]));
      } else if (std::isinf(x)) {
        REQUIRE(out[i] == x);
      } else if (std::fabs(x) >= 65504.0f) {
        REQUIRE(out[i] == std::copysign(65504.0f, x));  // saturated, not Inf
      } else {
        REQUIRE(std::signbit(out[i]) == std::signbit(x));
        const double err = std::fabs(static_cast<double>(out[i]) - x);
        // Half an ulp: 2^-11 relative for normals, 2^-25 absolute below 2^-14.
        REQUIRE(err <= std::max(std::fabs(static_cast<double>(x)) * 0x1p-11, 0x1p-25));
        REQUIRE(out[i] == static_cast<float>(static_cast<_Float16>(x)));
      }
    }
  }
}

TEST_CASE("bf16: decoded = nearest bfloat16 (saturating), within half an ulp") {
  for (const std::size_t n : {0, 1, 2, 3, 511, 512, 513, 100000}) {
    const auto v = wide_values(n, n + 12);
    const auto out = round_trip(gq::bf16{}, v);
    for (std::size_t i = 0; i < n; ++i) {
      const float x = v[i];
      CAPTURE(x);
      if (std::isnan(x)) {
        REQUIRE(std::isnan(out[i]));
      } else if (std::isinf(x)) {
        REQUIRE(out[i] == x);
      } else {
        REQUIRE(std::isfinite(out[i]));
        REQUIRE(std::signbit(out[i]) == std::signbit(x));
        REQUIRE(std::fabs(static_cast<double>(out[i]) - x) <=
                std::max(std::fabs(static_cast<double>(x)) * 0x1p-8, 0x1p-134));
        REQUIRE((std::bit_cast<std::uint32_t>(out[i]) & 0xffffu) == 0u);
      }
    }
  }
}

TEST_CASE("summable casts: traits an exchange relies on") {
  static_assert(std::is_same_v<gq::identity::sum_type, float>);
  static_assert(std::is_same_v<gq::fp16::sum_type, gq::half>);
  static_assert(std::is_same_v<gq::bf16::sum_type, gq::bfloat16>);
  static_assert(gq::fp16::prescale_before_sum);
  static_assert(!gq::bf16::prescale_before_sum && !gq::identity::prescale_before_sum);
  static_assert(gq::identity{}.bits_per_value() == 32 && gq::fp16{}.bits_per_value() == 16 &&
                gq::bf16{}.bits_per_value() == 16);
  // The packed values of a summable payload are the sum_type elements in little-endian order.
  const std::vector<float> v = {1.5f, -2.25f, 100.0f};
  gq::payload p = blank(v.size());
  gq::fp16{}.encode(v, gq::call_id{}, p);
  for (std::size_t i = 0; i < v.size(); ++i) {
    const auto bits = static_cast<std::uint16_t>(static_cast<unsigned>(p.values[2 * i]) |
                                                 static_cast<unsigned>(p.values[2 * i + 1]) << 8);
    CHECK(static_cast<float>(gq::half::from_bits(bits)) == v[i]);
  }
  gq::bf16{}.encode(v, gq::call_id{}, p);
  for (std::size_t i = 0; i < v.size(); ++i) {
    const auto bits = static_cast<std::uint16_t>(static_cast<unsigned>(p.values[2 * i]) |
                                                 static_cast<unsigned>(p.values[2 * i + 1]) << 8);
    CHECK(static_cast<float>(gq::bfloat16::from_bits(bits)) == v[i]);
  }
}
