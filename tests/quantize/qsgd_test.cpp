// QSGD: settings and their validation, bits per level count, side data = bucket L2 norms,
// every decoded value on one of the two levels around s|v|/norm, and unbiasedness over
// independent steps within a Bernstein bound built from the known per-element variance.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gradcomp/quantize/qsgd.hpp>

#include "quantize_test_support.hpp"

namespace gq = gradcomp;
using gradcomp_test::blank;
using gradcomp_test::bernstein_bound;
using gradcomp_test::normal_values;

namespace {

double bucket_norm(const std::vector<float>& v, std::size_t first, std::size_t last) {
  double s = 0;
  for (std::size_t i = first; i < last; ++i) s += static_cast<double>(v[i]) * v[i];
  return std::sqrt(s);
}

// Mean of decoded values over `steps` encodings; `vary` false reuses one call id.
std::vector<double> mean_decoded(const gq::qsgd& q, const std::vector<float>& v, std::size_t steps,
                                 bool vary) {
  std::vector<double> mean(v.size(), 0.0);
  gq::payload p = blank(v.size());
  std::vector<float> out(v.size());
  for (std::size_t t = 0; t < steps; ++t) {
    q.encode(v, gq::call_id{99, vary ? t : 0, 4}, p);
    q.decode(p, out);
    for (std::size_t i = 0; i < v.size(); ++i) mean[i] += out[i];
  }
  for (auto& m : mean) m /= static_cast<double>(steps);
  return mean;
}

}  // namespace

TEST_CASE("qsgd: settings, bits and validation") {
  static_assert(gq::qsgd{}.levels() == 7 && gq::qsgd{}.bucket_size() == 512);
  static_assert(gq::qsgd{}.bits_per_value() == 4);
  static_assert(gq::qsgd::with_bits(4).levels() == 7);
  CHECK(gq::qsgd(1).bits_per_value() == 2);  // ternary
  CHECK(gq::qsgd(2).bits_per_value() == 3);
  CHECK(gq::qsgd(3).bits_per_value() == 3);
  CHECK(gq::qsgd(4).bits_per_value() == 4);
  CHECK(gq::qsgd(127).bits_per_value() == 8);
  CHECK(gq::qsgd(128).bits_per_value() == 9);
  CHECK(gq::qsgd(32767).bits_per_value() == 16);
  for (unsigned b = 2; b <= 16; ++b) {
    const auto q = gq::qsgd::with_bits(b, 100);
    CHECK(q.bits_per_value() == b);
    CHECK(q.levels() == (1u << (b - 1)) - 1);
    CHECK(q.bucket_size() == 100);
    CHECK(q.params() == gq::quantizer_params{.levels = q.levels(), .bucket_size = 100});
  }
  CHECK_THROWS_AS(gq::qsgd(0), gq::invalid_argument);
  CHECK_THROWS_AS(gq::qsgd(32768), gq::invalid_argument);
  CHECK_THROWS_AS(gq::qsgd(7, 0), gq::invalid_argument);
  CHECK_THROWS_AS(gq::qsgd(7, (1u << 24) + 1), gq::invalid_argument);
  CHECK_NOTHROW(gq::qsgd(32767, 1u << 24));
  CHECK_THROWS_AS(gq::qsgd::with_bits(1), gq::invalid_argument);
  CHECK_THROWS_AS(gq::qsgd::with_bits(17), gq::invalid_argument);
  try {
    gq::qsgd q(7, 0);
    FAIL("no throw");
  } catch (const gq::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("bucket_size") != std::string::npos);
    CHECK(what.find("16777216") != std::string::npos);
  }
}

TEST_CASE("qsgd: side = bucket L2 norms; each value on a level next to s|v|/norm") {
  for (const auto& q : {gq::qsgd(1, 512), gq::qsgd(7, 100), gq::qsgd(127, 1000), gq::qsgd(5, 3),
                        gq::qsgd::with_bits(16, 64)}) {
    for (const std::size_t n : {1, 2, 3, 511, 512, 513, 100000}) {
      const auto v = normal_values(n, n * 31 + q.levels());
      gq::payload p = blank(n);
      q.encode(v, gq::call_id{1, 2, 3}, p);
      std::vector<float> out(n);
      q.decode(p, out);
      const double s = q.levels();
      for (std::size_t b = 0; b < p.side.size(); ++b) {
        const std::size_t first = b * q.bucket_size();
        const std::size_t last = std::min(n, first + q.bucket_size());
        const double norm = bucket_norm(v, first, last);
        REQUIRE(p.side[b] == doctest::Approx(norm).epsilon(1e-6));
        for (std::size_t i = first; i < last; ++i) {
          const double r = s * std::fabs(static_cast<double>(v[i])) / norm;
          const double level = std::fabs(static_cast<double>(out[i])) * s / p.side[b];
          const double rounded = std::round(level);
          CAPTURE(r);
          CAPTURE(level);
          REQUIRE(std::fabs(level - rounded) < 1e-4 + 1e-6 * s);  // float rounding
          REQUIRE(rounded >= std::floor(r - 1e-4));
          REQUIRE(rounded <= std::ceil(r + 1e-4));
          if (out[i] != 0.0f) REQUIRE(std::signbit(out[i]) == std::signbit(v[i]));
        }
      }
    }
  }
}

TEST_CASE("qsgd: unbiased: the mean over steps is within a Bernstein bound of v") {
  constexpr std::size_t steps = 1500;
  for (const auto& q : {gq::qsgd(1, 64), gq::qsgd(3, 1000), gq::qsgd(7, 100)}) {
    CAPTURE(q.levels());
    auto v = normal_values(1000, q.levels());
    v[10] = 0.0f;
    v[500] = 1e-6f;  // tiny values: rare round-ups
    const auto mean = mean_decoded(q, v, steps, true);
    const auto same = mean_decoded(q, v, steps, false);  // one call id: no averaging at all
    gq::payload p = blank(v.size());
    q.encode(v, gq::call_id{}, p);  // side data does not depend on the step
    std::size_t outside_when_not_random = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double norm = p.side[i / q.bucket_size()];
      const double step = norm / q.levels();
      const double r = q.levels() * std::fabs(static_cast<double>(v[i])) / norm;
      const double f = r - std::floor(r);
      const double bound = bernstein_bound(step * step * f * (1 - f), step, steps) +
                           1e-6 * std::fabs(static_cast<double>(v[i])) + 1e-9;
      CAPTURE(i);
      CAPTURE(v[i]);
      REQUIRE(std::fabs(mean[i] - v[i]) <= bound);
      if (std::fabs(same[i] - v[i]) > bound) ++outside_when_not_random;
    }
    // The test has power: without fresh randomness per step most values miss the bound.
    CHECK(outside_when_not_random > v.size() / 2);
  }
}

TEST_CASE("qsgd: zero, overflowing and non-finite buckets") {
  const gq::qsgd q(7, 4);
  constexpr float big = std::numeric_limits<float>::max();
  const std::vector<float> v = {0.0f,
                                0.0f,
                                -0.0f,
                                0.0f,  // zero
                                3e38f,
                                -3e38f,
                                1.0f,
                                big,  // overflow
                                1.0f,
                                std::numeric_limits<float>::quiet_NaN(),
                                2.0f,
                                3.0f,  // NaN
                                -std::numeric_limits<float>::infinity(),
                                1.0f,
                                1.0f,
                                1.0f,
                                3.0f,
                                4.0f};
  gq::payload p = blank(v.size());
  q.encode(v, gq::call_id{}, p);
  REQUIRE(p.side.size() == 5);
  CHECK(p.side[0] == 0.0f);
  CHECK(p.side[1] == big);  // saturated, not Inf
  CHECK(p.side[2] == 0.0f);
  CHECK(p.side[3] == 0.0f);
  CHECK(p.side[4] == 5.0f);
  std::vector<float> out(v.size());
  q.decode(p, out);
  for (std::size_t i = 0; i < 4; ++i) CHECK(out[i] == 0.0f);
  for (std::size_t i = 4; i < 8; ++i) CHECK(std::isfinite(out[i]));
  CHECK(out[7] == big);  // |v| == norm: the top level, exactly
  for (std::size_t i = 8; i < 16; ++i) CHECK(out[i] == 0.0f);
  // A one-element bucket or |v| == norm is deterministic and exact.
  const gq::qsgd one(3, 1);
  const std::vector<float> w = {-2.5f, 7.0f, 0.0f};
  gq::payload p1 = blank(w.size());
  one.encode(w, gq::call_id{}, p1);
  std::vector<float> out1(w.size());
  one.decode(p1, out1);
  CHECK(out1 == w);
}

TEST_CASE("qsgd: an invalid code is reported with its position") {
  const gq::qsgd q(5, 8);  // 4 bits, codes 0..10 valid
  const auto v = normal_values(20, 3);
  gq::payload p = blank(v.size());
  q.encode(v, gq::call_id{}, p);
  gq::detail::store_code(p.values.data(), 13, 4, 11);
  std::vector<float> out(v.size(), 1.0f);
  try {
    q.decode(p, out);
    FAIL("no throw");
  } catch (const gq::payload_error& e) {
    const std::string what = e.what();
    CHECK(what.find("code 11 at value 13") != std::string::npos);
  }
  for (const float x : out) CHECK(x == 1.0f);
}

TEST_CASE("qsgd: the per-element helper never returns a code above 2s") {
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  constexpr float inf = std::numeric_limits<float>::infinity();
  for (const std::uint32_t s : {1u, 7u, 32767u}) {
    for (const float v : {nan, inf, -inf, 5.0f, -5.0f, 1.0f, 0.0f}) {
      for (const float norm : {1.0f, 1e-38f, nan, inf, 0.0f, -1.0f}) {
        for (const float u : {0.0f, 0.5f, 0x1.fffffep-1f}) {
          REQUIRE(gq::detail::qsgd_code(v, norm, s, u) <= 2 * s);
        }
      }
    }
  }
}
