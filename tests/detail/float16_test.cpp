// Conversions float <-> binary16 / bfloat16: exhaustive over the 16-bit patterns, and against
// the compiler's _Float16 and an independent bfloat16 reference over random and edge floats.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gradcomp/detail/float16.hpp>

namespace {

using gradcomp::detail::bf16_bits_to_float;
using gradcomp::detail::float_to_bf16_bits;
using gradcomp::detail::float_to_half_bits;
using gradcomp::detail::half_bits_to_float;

bool half_is_nan(std::uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0u; }
bool bf16_is_nan(std::uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0u; }

// Edge floats plus many random bit patterns (all exponents equally likely) and random floats
// concentrated in the binary16 range, where the rounding decisions are.
std::vector<float> test_floats() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          -65504.0f,
                          65505.0f,
                          65519.99f,
                          65520.0f,
                          -65520.0f,
                          65536.0f,
                          1e6f,
                          -1e30f,
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::min(),
                          0x1p-14f,
                          0x1p-24f,
                          0x1p-25f,
                          0x1.000002p-25f,
                          0x1.8p-24f,
                          0x1.8p-23f,
                          0x1p-26f,
                          0x1.ffcp-15f,
                          0x1.ffep-15f,
                          0x1.ffdp-15f,
                          0x1.002p0f,
                          0x1.006p0f,
                          0x1.001p0f,
                          0x1.003p0f,
                          3.14159265f,
                          -2.71828f};
  // Every halfway and neighbour around each binary16 value of a few binades.
  for (std::uint32_t h = 0; h < 0x7c00u; h += 37) {
    const float lo = half_bits_to_float(static_cast<std::uint16_t>(h));
    const float hi = half_bits_to_float(static_cast<std::uint16_t>(h + 1));
    const float mid = lo + (hi - lo) / 2;  // exact in float
    v.insert(v.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), -mid});
  }
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 200000; ++i)
    v.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  std::uniform_real_distribution<float> exp(-27.0f, 17.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::exp2(exp(rng));
    v.push_back((rng() & 1u) != 0u ? x : -x);
  }
  return v;
}

}  // namespace

TEST_CASE("binary16: every bit pattern converts to float and back unchanged") {
  // The only change is canonicalisation of signalling NaNs, which come back quiet with the
  // same payload (bit 9 set), as hardware conversions do.
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f = half_bits_to_float(bits);
    const std::uint16_t back = float_to_half_bits(f);
    if (half_is_nan(bits)) {
      REQUIRE(std::isnan(f));
      REQUIRE(back == (bits | 0x200u));
    } else {
      REQUIRE(back == bits);
      REQUIRE(f == static_cast<float>(std::bit_cast<_Float16>(bits)));
    }
  }
}

TEST_CASE("binary16: float -> half rounds like _Float16, except that overflow saturates") {
  std::size_t saturated = 0;
  for (const float f : test_floats()) {
    const std::uint16_t ours = float_to_half_bits(f);
    const auto ref = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
    if (std::isnan(f)) {
      REQUIRE(half_is_nan(ours));
      REQUIRE((ours & 0x200u) != 0u);  // quiet
      continue;
    }
    if (std::isfinite(f) && std::fabs(f) >= 65520.0f) {
      // IEEE (and _Float16) give Inf here; we saturate at the largest finite half.
      REQUIRE((ref & 0x7fffu) == 0x7c00u);
      REQUIRE(ours == (std::signbit(f) ? 0xfbffu : 0x7bffu));
      ++saturated;
      continue;
    }
    INFO("f = " << f << " bits " << std::bit_cast<std::uint32_t>(f));
    REQUIRE(ours == ref);
  }
  CHECK(saturated > 1000);
}

TEST_CASE("binary16: saturation and special values") {
  CHECK(float_to_half_bits(65504.0f) == 0x7bffu);
  CHECK(float_to_half_bits(65519.0f) == 0x7bffu);
  CHECK(float_to_half_bits(65520.0f) == 0x7bffu);
  CHECK(float_to_half_bits(-1e30f) == 0xfbffu);
  CHECK(float_to_half_bits(std::numeric_limits<float>::infinity()) == 0x7c00u);
  CHECK(float_to_half_bits(-std::numeric_limits<float>::infinity()) == 0xfc00u);
  CHECK(float_to_half_bits(-0.0f) == 0x8000u);
  CHECK(float_to_half_bits(0x1p-25f) == 0x0000u);         // tie to even zero
  CHECK(float_to_half_bits(0x1.000002p-25f) == 0x0001u);  // just above the tie
  CHECK(float_to_half_bits(0x1.8p-24f) == 0x0002u);       // 1.5 ulp: tie to even 2
  // A signalling float NaN whose top payload bits are zero stays NaN, not Inf.
  CHECK(half_is_nan(float_to_half_bits(std::bit_cast<float>(0x7f800001u))));
  CHECK(half_is_nan(float_to_half_bits(std::bit_cast<float>(0xff800001u))));
}

TEST_CASE("bfloat16: saturation and special values") {
  CHECK(float_to_bf16_bits(std::numeric_limits<float>::max()) == 0x7f7fu);
  CHECK(float_to_bf16_bits(std::bit_cast<float>(0x7f7f7fffu)) == 0x7f7fu);
  CHECK(float_to_bf16_bits(std::bit_cast<float>(0x7f7f8000u)) == 0x7f7fu);  // IEEE: Inf
  CHECK(float_to_bf16_bits(std::bit_cast<float>(0xff7f8000u)) == 0xff7fu);
  CHECK(float_to_bf16_bits(std::numeric_limits<float>::infinity()) == 0x7f80u);
  CHECK(float_to_bf16_bits(1.0f + 0x1p-8f) == 0x3f80u);  // tie to even (down)
  CHECK(float_to_bf16_bits(1.0f + 0x3p-8f) == 0x3f82u);  // tie to even (up)
  CHECK(bf16_is_nan(float_to_bf16_bits(std::bit_cast<float>(0x7f800001u))));
}

TEST_CASE("bfloat16: every bit pattern converts to float and back unchanged") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float f = bf16_bits_to_float(bits);
    const std::uint16_t back = float_to_bf16_bits(f);
    if (bf16_is_nan(bits)) {
      REQUIRE(std::isnan(f));
      REQUIRE(back == (bits | 0x40u));
    } else {
      REQUIRE(std::bit_cast<std::uint32_t>(f) == static_cast<std::uint32_t>(b) << 16);
      REQUIRE(back == bits);
    }
  }
}

TEST_CASE("bfloat16: float -> bf16 is the nearest value, ties to even, saturating") {
  // Reference: the two candidates are the truncation and the next bfloat16 up in magnitude;
  // compare distances exactly in double; then saturate where IEEE would give Inf.
  for (const float f : test_floats()) {
    const std::uint16_t ours = float_to_bf16_bits(f);
    if (std::isnan(f)) {
      REQUIRE(bf16_is_nan(ours));
      continue;
    }
    if (std::isinf(f)) {
      REQUIRE(ours == (std::bit_cast<std::uint32_t>(f) >> 16));
      continue;
    }
    const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    const auto lo = static_cast<std::uint16_t>(x >> 16);
    const auto hi = static_cast<std::uint16_t>(lo + 1);
    const double a = std::fabs(static_cast<double>(f));
    const double dlo = a - std::fabs(static_cast<double>(bf16_bits_to_float(lo)));
    // The bfloat16 above 0x7f7f is Inf; as a rounding candidate it stands for 2^128.
    const double hi_mag = (hi & 0x7fffu) == 0x7f80u
                              ? std::ldexp(1.0, 128)
                              : std::fabs(static_cast<double>(bf16_bits_to_float(hi)));
    const double dhi = hi_mag - a;
    std::uint16_t ref = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1u) == 0u ? lo : hi);
    if ((ref & 0x7fffu) == 0x7f80u) ref = static_cast<std::uint16_t>((ref & 0x8000u) | 0x7f7fu);
    INFO("f = " << f);
    REQUIRE(ours == ref);
  }
}

TEST_CASE("half and bfloat16 value types add like their formats") {
  using gradcomp::bfloat16;
  using gradcomp::half;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 100.0f);
  for (int i = 0; i < 20000; ++i) {
    const half a(nd(rng)), b(nd(rng));
    const _Float16 ra = std::bit_cast<_Float16>(a.bits), rb = std::bit_cast<_Float16>(b.bits);
    const _Float16 rs = static_cast<_Float16>(ra + rb);
    REQUIRE((a + b).bits == std::bit_cast<std::uint16_t>(rs));
    half c = a;
    c += b;
    REQUIRE(c.bits == (a + b).bits);
    REQUIRE((a < b) == (static_cast<float>(a) < static_cast<float>(b)));

    const bfloat16 x(nd(rng)), y(nd(rng));
    REQUIRE((x + y).bits == float_to_bf16_bits(static_cast<float>(x) + static_cast<float>(y)));
    REQUIRE((x == y) == (static_cast<float>(x) == static_cast<float>(y)));
  }
  CHECK(half(0.0f) == half(-0.0f));
  CHECK_FALSE(half(std::numeric_limits<float>::quiet_NaN()) ==
              half(std::numeric_limits<float>::quiet_NaN()));
  CHECK(half(60000.0f) + half(60000.0f) == half(65504.0f));  // sums saturate too
  CHECK(half{}.bits == 0u);
  CHECK(static_cast<float>(bfloat16(1.5f)) == 1.5f);
  CHECK(half::from_bits(0x3c00u) == half(1.0f));
  CHECK(bfloat16::from_bits(0x3f80u) == bfloat16(1.0f));
}
