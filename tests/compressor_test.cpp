// compressor<>: argument checks that leave the feedback state untouched, the non-finite
// policy, and decompression.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <vector>

#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/compressor.hpp>

#include "support/data.hpp"

namespace {

using namespace gradcomp;

}  // namespace

TEST_CASE("compressor: bad arguments throw and leave the feedback state unchanged") {
  compressor<topk, identity, residual> c;
  auto st = c.make_state(100);
  const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, 100, 1);
  payload p;
  c.compress(g, st, {0.1, {}}, p);
  const auto before = st.e;
  for (double bad : {0.0, -0.5, 1.5, static_cast<double>(NAN)}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(c.compress(g, st, {bad, {}}, p), invalid_argument);
    CHECK(st.e == before);
  }
  const auto short_g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, 99, 1);
  CHECK_THROWS_AS(c.compress(short_g, st, {0.1, {}}, p), invalid_argument);
  CHECK(st.e == before);
}

TEST_CASE("compressor: NaN or Inf in a gradient is an error by default, state unchanged") {
  compressor<topk, identity, residual> c;
  auto st = c.make_state(50);
  auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, 50, 2);
  payload p;
  c.compress(g, st, {0.1, {}}, p);
  const auto before = st.e;
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    g[17] = bad;
    try {
      c.compress(g, st, {0.1, call_id{0, 0, 4}}, p);
      FAIL("no exception");
    } catch (const nonfinite_error& e) {
      const std::string what = e.what();
      CHECK(what.find("tensor 4") != std::string::npos);
      CHECK(what.find("index 17") != std::string::npos);
    }
    CHECK(st.e == before);
  }
}

TEST_CASE("compressor: nonfinite_policy::propagate sends NaN first") {
  compressor<topk, identity, no_feedback> c(topk{}, identity{}, no_feedback{}, nonfinite_policy::propagate);
  auto st = c.make_state(10);
  std::vector<float> g(10, 1.0f);
  g[3] = NAN;
  g[6] = 5.0f;
  payload p;
  c.compress(g, st, {0.2, {}}, p);
  REQUIRE(p.count == 2);
  CHECK(p.indices == std::vector<std::uint32_t>{3, 6});
}

TEST_CASE("compressor: decompress overwrites or accumulates, and rejects malformed payloads") {
  compressor<topk, identity, no_feedback> c;
  auto st = c.make_state(8);
  const std::vector<float> g{0, 5, 0, -7, 0, 0, 1, 0};
  payload p;
  c.compress(g, st, {0.25, {}}, p);
  std::vector<float> dense(8, 2.0f);
  c.decompress(p, dense, decompress_mode::accumulate);
  CHECK(dense == std::vector<float>{2, 7, 2, -5, 2, 2, 2, 2});
  c.decompress(p, dense);
  CHECK(dense == std::vector<float>{0, 5, 0, -7, 0, 0, 0, 0});

  const auto keep = dense;
  payload bad = p;
  bad.indices[1] = 8;  // out of range
  CHECK_THROWS_AS(c.decompress(bad, dense), payload_error);
  bad = p;
  bad.indices[1] = 1;  // duplicate
  CHECK_THROWS_AS(c.decompress(bad, dense), payload_error);
  bad = p;
  bad.values.pop_back();  // truncated values
  CHECK_THROWS_AS(c.decompress(bad, dense), payload_error);
  std::vector<float> wrong(7);
  CHECK_THROWS_AS(c.decompress(p, wrong), invalid_argument);
  CHECK(dense == keep);
}
