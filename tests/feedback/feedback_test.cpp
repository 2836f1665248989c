// Error feedback laws: with a residual nothing is lost (acc == decoded + residual), DGC's
// momentum correction follows its recurrences, and no feedback leaves nothing behind.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/step.hpp>

#include "../support/data.hpp"

namespace {

using namespace gradcomp;

// Decoded value per dense coordinate (0 where nothing was sent) and the sent mask.
template <class C>
void decoded_dense(const C& c, const payload& p, std::vector<float>& d, std::vector<bool>& sent) {
  std::vector<float> v(p.count);
  c.decode_values(p, v);
  d.assign(p.dense_size, 0.0f);
  sent.assign(p.dense_size, false);
  for (std::size_t j = 0; j < p.count; ++j) {
    d[p.index(j)] = v[j];
    sent[p.index(j)] = true;
  }
}

// Runs 100 steps of compressor<topk, Q, residual> and checks the residual law on every
// coordinate of every step. `exact` quantizers keep acc == decoded + residual bit for bit;
// for the others, whose decoded value can be many binades away from acc, the float
// subtraction acc - decoded may round, and the check is that the residual is exactly that
// rounded difference and the loss is at most half an ulp of it.
template <class Q>
void check_residual_law(Q q, bool exact) {
  const std::size_t n = 4099;
  compressor<topk, Q, residual> c(topk{}, q);
  auto st = c.make_state(n);
  payload p;
  std::vector<float> d;
  std::vector<bool> sent;
  std::size_t inexact = 0;
  for (std::uint64_t step = 0; step < 100; ++step) {
    const auto g = gradcomp_test::make_input<float>(step % 3 == 0 ? gradcomp_test::dist::student_t2 : gradcomp_test::dist::normal, n, 1000 + step);
    std::vector<float> acc(n);
    for (std::size_t i = 0; i < n; ++i) acc[i] = st.e[i] + g[i];
    c.compress(g, st, compress_context{0.05, call_id{7, step, 3}}, p);
    decoded_dense(c, p, d, sent);
    for (std::size_t i = 0; i < n; ++i) {
      const float e = st.e[i];
      if (!sent[i]) {
        REQUIRE(std::bit_cast<std::uint32_t>(e) == std::bit_cast<std::uint32_t>(acc[i]));
        continue;
      }
      REQUIRE(std::bit_cast<std::uint32_t>(e) == std::bit_cast<std::uint32_t>(acc[i] - d[i]));
      if (exact) {
        REQUIRE(std::bit_cast<std::uint32_t>(d[i] + e) == std::bit_cast<std::uint32_t>(acc[i]));
      } else {
        const double lost = static_cast<double>(acc[i]) - (static_cast<double>(d[i]) + static_cast<double>(e));
        const double half_ulp = 0.5 * (std::nextafter(std::fabs(e), INFINITY) - std::fabs(e));
        REQUIRE(std::fabs(lost) <= half_ulp);
        inexact += lost != 0.0;
      }
    }
  }
  MESSAGE("coordinates where acc - decoded rounded: " << inexact);
}

}  // namespace

TEST_CASE("residual: acc == decoded + residual for every quantizer over 100 steps") {
  SUBCASE("identity") { check_residual_law(identity{}, true); }
  SUBCASE("fp16") { check_residual_law(fp16{}, true); }
  SUBCASE("bf16") { check_residual_law(bf16{}, true); }
  SUBCASE("qsgd 4-bit") { check_residual_law(qsgd::with_bits(4, 128), false); }
  SUBCASE("qsgd 2-bit") { check_residual_law(qsgd::with_bits(2, 512), false); }
  SUBCASE("terngrad") { check_residual_law(terngrad{}, false); }
  SUBCASE("scaled_sign") { check_residual_law(scaled_sign{}, false); }
}

TEST_CASE("residual: with the dense selector and identity nothing stays behind") {
  const std::size_t n = 1000;
  compressor<dense, identity, residual> c;
  auto st = c.make_state(n);
  payload p;
  const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::laplace, n, 5);
  c.compress(g, st, compress_context{1.0, {}}, p);
  CHECK(p.layout == index_layout::dense);
  for (float e : st.e) REQUIRE(e == 0.0f);
}

TEST_CASE("residual: double gradients") {
  const std::size_t n = 2000;
  compressor<topk, identity, residual, double> c;
  auto st = c.make_state(n);
  payload p;
  for (std::uint64_t step = 0; step < 20; ++step) {
    const auto g = gradcomp_test::make_input<double>(gradcomp_test::dist::normal, n, step);
    std::vector<double> acc(n);
    for (std::size_t i = 0; i < n; ++i) acc[i] = st.e[i] + g[i];
    c.compress(g, st, compress_context{0.01, call_id{0, step, 0}}, p);
    std::vector<float> v(p.count);
    c.decode_values(p, v);
    std::vector<double> d(n, 0.0);
    for (std::size_t j = 0; j < p.count; ++j) d[p.index(j)] = v[j];
    // fp32 values of a double: acc - float(acc) is exact, so the law holds bit for bit.
    for (std::size_t i = 0; i < n; ++i) REQUIRE(d[i] + st.e[i] == acc[i]);
  }
}

TEST_CASE("residual: restore puts sent values back") {
  residual f;
  auto st = f.make_state<float>(5);
  const std::vector<float> g{1, 2, 3, 4, 5};
  f.accumulate(st, std::span<const float>(g));
  const std::vector<std::uint32_t> idx{1, 3};
  const std::vector<float> dec{2, 4};
  f.update(st, std::span<const std::uint32_t>(idx), std::span<const float>(dec));
  CHECK(st.e == std::vector<float>{1, 0, 3, 0, 5});
  f.restore(st, std::span<const std::uint32_t>(idx), std::span<const float>(dec));
  CHECK(st.e == g);
  const std::vector<std::uint32_t> bad{7};
  const std::vector<float> one{1};
  CHECK_THROWS_AS(f.update(st, std::span<const std::uint32_t>(bad), std::span<const float>(one)),
                  invalid_argument);
  CHECK(st.e == g);
}

TEST_CASE("dgc_momentum: momentum correction and factor masking") {
  dgc_momentum f{0.9, 0.0};
  auto st = f.make_state<double>(4);
  std::vector<double> u(4, 0.0), v(4, 0.0);
  for (int step = 0; step < 10; ++step) {
    const std::vector<double> g{1.0 + step, -2.0, 0.5, 3.0 - step};
    for (std::size_t i = 0; i < 4; ++i) {
      u[i] = 0.9 * u[i] + g[i];
      v[i] += u[i];
    }
    const auto acc = f.accumulate(st, std::span<const double>(g));
    for (std::size_t i = 0; i < 4; ++i) REQUIRE(acc[i] == doctest::Approx(v[i]));
    // send coordinate step % 4 exactly
    const std::uint32_t i = static_cast<std::uint32_t>(step % 4);
    const std::vector<std::uint32_t> idx{i};
    const std::vector<float> dec{static_cast<float>(v[i])};
    f.update(st, std::span<const std::uint32_t>(idx), std::span<const float>(dec));
    v[i] -= static_cast<double>(dec[0]);
    u[i] = 0.0;
    REQUIRE(st.u[i] == 0.0);
    for (std::size_t j = 0; j < 4; ++j) {
      REQUIRE(st.v[j] == doctest::Approx(v[j]));
      REQUIRE(st.u[j] == doctest::Approx(u[j]));
    }
  }
}

TEST_CASE("dgc_momentum: local gradient clipping by norm") {
  dgc_momentum f{0.0, 1.0};
  auto st = f.make_state<float>(2);
  const std::vector<float> g{3.0f, 4.0f};  // norm 5 -> scaled to norm 1
  const auto acc = f.accumulate(st, std::span<const float>(g));
  CHECK(acc[0] == doctest::Approx(0.6));
  CHECK(acc[1] == doctest::Approx(0.8));
  const std::vector<float> small{0.3f, 0.4f};  // norm 0.5: untouched
  dgc_momentum f2{0.0, 1.0};
  auto st2 = f2.make_state<float>(2);
  const auto acc2 = f2.accumulate(st2, std::span<const float>(small));
  CHECK(acc2[0] == 0.3f);
  CHECK(acc2[1] == 0.4f);
}

TEST_CASE("dgc_momentum: bad parameters are rejected") {
  CHECK_THROWS_AS(dgc_momentum({1.0, 0.0}).make_state<float>(3), invalid_argument);
  CHECK_THROWS_AS(dgc_momentum({-0.1, 0.0}).make_state<float>(3), invalid_argument);
  CHECK_THROWS_AS(dgc_momentum({0.9, -1.0}).make_state<float>(3), invalid_argument);
  CHECK_THROWS_AS(dgc_momentum({0.9, NAN}).make_state<float>(3), invalid_argument);
}

TEST_CASE("no_feedback: compresses the gradient itself and keeps nothing") {
  no_feedback f;
  auto st = f.make_state<float>(3);
  const std::vector<float> g{1, 2, 3};
  const auto acc = f.accumulate(st, std::span<const float>(g));
  CHECK(acc.data() == g.data());
  CHECK(st.buffers().empty());
  const std::vector<float> wrong{1, 2};
  CHECK_THROWS_AS(f.accumulate(st, std::span<const float>(wrong)), invalid_argument);
}
