// TernGrad: side = max|v| per bucket, every decoded value in {0, +-max} with the sign of v,
// |v| == max always sent exactly, and unbiasedness over steps within a Bernstein bound.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gradcomp/quantize/terngrad.hpp>

#include "quantize_test_support.hpp"

namespace gq = gradcomp;
using gradcomp_test::blank;
using gradcomp_test::bernstein_bound;
using gradcomp_test::normal_values;

namespace {

}  // namespace

TEST_CASE("terngrad: settings") {
  static_assert(gq::terngrad{}.bits_per_value() == 2);
  static_assert(gq::terngrad{}.bucket_size() == 0);
  static_assert(gq::terngrad(128).params() == gq::quantizer_params{.levels = 0, .bucket_size = 128});
}

TEST_CASE("terngrad: side = max|v| per bucket; values in {0, +-max} with the sign of v") {
  for (const unsigned bucket : {0u, 1u, 7u, 512u}) {
    const gq::terngrad q(bucket);
    for (const std::size_t n : {1, 2, 3, 511, 512, 513, 100000}) {
      const auto v = normal_values(n, n + bucket);
      gq::payload p = blank(n);
      q.encode(v, gq::call_id{5, 6, 7}, p);
      std::vector<float> out(n);
      q.decode(p, out);
      const std::size_t len = bucket == 0 ? n : bucket;
      REQUIRE(p.side.size() == (n + len - 1) / len);
      for (std::size_t b = 0; b < p.side.size(); ++b) {
        float max = 0.0f;
        for (std::size_t i = b * len; i < std::min(n, (b + 1) * len); ++i)
          max = std::max(max, std::fabs(v[i]));
        REQUIRE(p.side[b] == max);
        for (std::size_t i = b * len; i < std::min(n, (b + 1) * len); ++i) {
          REQUIRE((out[i] == 0.0f || out[i] == std::copysign(max, v[i])));
          if (std::fabs(v[i]) == max) REQUIRE(out[i] == v[i]);
        }
      }
    }
  }
}

TEST_CASE("terngrad: unbiased: the mean over steps is within a Bernstein bound of v") {
  constexpr std::size_t steps = 2000;
  const gq::terngrad q(100);
  auto v = normal_values(1000, 17);
  v[3] = 0.0f;
  v[4] = 1e-7f;
  std::vector<double> mean(v.size(), 0.0);
  gq::payload p = blank(v.size());
  std::vector<float> out(v.size());
  for (std::size_t t = 0; t < steps; ++t) {
    q.encode(v, gq::call_id{1, t, 0}, p);
    q.decode(p, out);
    for (std::size_t i = 0; i < v.size(); ++i) mean[i] += out[i];
  }
  for (std::size_t i = 0; i < v.size(); ++i) {
    mean[i] /= steps;
    const double max = p.side[i / 100];
    const double prob = std::fabs(static_cast<double>(v[i])) / max;
    const double bound = bernstein_bound(max * max * prob * (1 - prob), max, steps) + 1e-9;
    CAPTURE(v[i]);
    REQUIRE(std::fabs(mean[i] - v[i]) <= bound);
  }
}

TEST_CASE("terngrad: zero and non-finite buckets decode to zeros") {
  const gq::terngrad q(3);
  const std::vector<float> v = {0.0f,
                                -0.0f,
                                0.0f,
                                1.0f,
                                std::numeric_limits<float>::quiet_NaN(),
                                2.0f,
                                std::numeric_limits<float>::infinity(),
                                1.0f,
                                1.0f,
                                -4.0f};
  gq::payload p = blank(v.size());
  q.encode(v, gq::call_id{}, p);
  REQUIRE(p.side == std::vector<float>{0.0f, 0.0f, 0.0f, 4.0f});
  std::vector<float> out(v.size(), 9.0f);
  q.decode(p, out);
  for (std::size_t i = 0; i < 9; ++i) CHECK(out[i] == 0.0f);
  CHECK(out[9] == -4.0f);
}
