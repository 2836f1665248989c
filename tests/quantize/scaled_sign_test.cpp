// Scaled sign: side = mean|v| per bucket, decoded = +-mean by the sign of v, deterministic,
// and the bucket's L1 mass is preserved.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gradcomp/quantize/scaled_sign.hpp>

#include "quantize_test_support.hpp"

namespace gq = gradcomp;
using gradcomp_test::blank;
using gradcomp_test::bernstein_bound;
using gradcomp_test::normal_values;

namespace {

}  // namespace

TEST_CASE("scaled_sign: settings") {
  static_assert(gq::scaled_sign{}.bits_per_value() == 1);
  static_assert(gq::scaled_sign{}.bucket_size() == 0);
  static_assert(gq::scaled_sign(64).params() == gq::quantizer_params{.levels = 0, .bucket_size = 64});
}

TEST_CASE("scaled_sign: decodes to +-mean|v| of each bucket by the sign of v") {
  std::mt19937_64 rng(8);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (const unsigned bucket : {0u, 1u, 5u, 512u}) {
    const gq::scaled_sign q(bucket);
    for (const std::size_t n : {1, 2, 3, 511, 512, 513, 100000}) {
      std::vector<float> v(n);
      for (auto& x : v) x = nd(rng);
      v[0] = -0.0f;  // non-negative by the sign rule (code 0)
      gq::payload p = blank(n);
      q.encode(v, gq::call_id{1, 1, 1}, p);
      std::vector<float> out(n);
      q.decode(p, out);
      const std::size_t len = bucket == 0 ? n : bucket;
      REQUIRE(p.side.size() == (n + len - 1) / len);
      for (std::size_t b = 0; b < p.side.size(); ++b) {
        const std::size_t first = b * len, last = std::min(n, first + len);
        double l1 = 0;
        for (std::size_t i = first; i < last; ++i) l1 += std::fabs(static_cast<double>(v[i]));
        const double mean = l1 / static_cast<double>(last - first);
        REQUIRE(p.side[b] == doctest::Approx(mean).epsilon(1e-6));
        double decoded_l1 = 0;
        for (std::size_t i = first; i < last; ++i) {
          REQUIRE(out[i] == (v[i] < 0.0f ? -p.side[b] : p.side[b]));
          decoded_l1 += std::fabs(static_cast<double>(out[i]));
        }
        REQUIRE(decoded_l1 == doctest::Approx(l1).epsilon(1e-5));
      }
      // Bit i is the sign of v[i].
      for (std::size_t i = 0; i < n; ++i) {
        REQUIRE(gq::detail::code_at(p.values.data(), i, 1) == (v[i] < 0.0f ? 1u : 0u));
      }
    }
  }
}

TEST_CASE("scaled_sign: non-finite buckets decode to zeros") {
  const gq::scaled_sign q(2);
  const std::vector<float> v = {1.0f,
                                std::numeric_limits<float>::quiet_NaN(),
                                -std::numeric_limits<float>::infinity(),
                                1.0f,
                                -2.0f,
                                4.0f};
  gq::payload p = blank(v.size());
  q.encode(v, gq::call_id{}, p);
  REQUIRE(p.side == std::vector<float>{0.0f, 0.0f, 3.0f});
  std::vector<float> out(v.size());
  q.decode(p, out);
  for (std::size_t i = 0; i < 4; ++i) CHECK(out[i] == 0.0f);
  CHECK(out[4] == -3.0f);
  CHECK(out[5] == 3.0f);
}
