// compressor<>: argument checks that leave the feedback state untouched, the non-finite
// policy, decompression, and the top-k contraction it reports.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
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

namespace {

// ||acc on the payload's indices||^2 / ||acc||^2 in long double, acc the accumulated vector.
template <class T>
double reference_contraction(const std::vector<T>& acc, const payload& p) {
  long double total = 0;
  for (const T x : acc) total += static_cast<long double>(x) * x;
  long double kept = 0;
  for (std::uint32_t j = 0; j < p.count; ++j) {
    const T x = acc[p.indices[j]];
    kept += static_cast<long double>(x) * x;
  }
  return static_cast<double>(kept / total);
}

// A few steps of compressor C from a zero residual: after each, the contraction it reports
// against the reference on acc = e_before + g (which residual feedback returns in st.e
// before the update; recomputed here).
template <class C>
std::vector<double> check_contraction(C c, const std::vector<float>& g0, double density,
                                      bool measured, bool nan_on_fallback = false) {
  const std::size_t n = g0.size();
  auto st = c.make_state(n);
  std::vector<float> e(n, 0.0f);
  std::vector<double> seen;
  payload p;
  for (std::uint64_t step = 0; step < 3; ++step) {
    std::vector<float> g = g0;
    for (std::size_t i = 0; i < n; ++i) g[i] *= static_cast<float>(1 + step);
    std::vector<float> acc(n);
    for (std::size_t i = 0; i < n; ++i) acc[i] = e[i] + g[i];
    const auto cs = c.compress(g, st, {density, {.seed = 3, .step = step}}, p);
    CAPTURE(step);
    long double total = 0;
    for (const float x : acc) total += static_cast<long double>(x) * x;
    if (p.layout == index_layout::dense) {
      CHECK(cs.contraction == 1.0);  // every coordinate sent
    } else if (!measured || total == 0) {
      CHECK(std::isnan(cs.contraction));
    } else if (nan_on_fallback && std::isnan(cs.contraction)) {
      // Only where Gaussian-k's statistics overflowed and it fell back (the outliers: its
      // moments are not finite).
      CHECK(cs.selection.fallback);
    } else {
      CHECK(cs.contraction == doctest::Approx(reference_contraction(acc, p)).epsilon(1e-5));
      CHECK(cs.contraction >= 0.0);
      CHECK(cs.contraction <= 1.0);
    }
    seen.push_back(cs.contraction);
    if constexpr (requires { st.e; }) e.assign(st.e.begin(), st.e.end());
  }
  return seen;
}

}  // namespace

TEST_CASE("compressor: the top-k contraction against a reference, every selector") {
  namespace gt = gradcomp_test;
  for (gt::dist d : gt::all_dists) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000},
                          std::size_t{4099}, (std::size_t{1} << 20) + 3}) {
      const auto g = gt::make_input<float>(d, n, 9);
      const std::string dist_name = gt::name(d);
      CAPTURE(dist_name);
      CAPTURE(n);
      const double density = 0.01;
      // Measured in a pass that reads the data anyway: top-k and Gaussian-k in their own pass,
      // the others in compressor<>'s e += g (residual feedback).
      const auto top = check_contraction(compressor<topk, identity, residual>{}, g, density, true);
      check_contraction(compressor<gaussiank, identity, residual>{}, g, density, true, true);
      check_contraction(compressor<gaussiank, identity, no_feedback>{}, g, density, true, true);
      const auto rnd =
          check_contraction(compressor<randomk, identity, residual>{}, g, density, true);
      check_contraction(compressor<dgc_sampling, identity, residual>{}, g, density, true);
      check_contraction(compressor<redsync, identity, residual>{}, g, density, true);
      check_contraction(compressor<dense, fp16, residual>{}, g, density, true);
      check_contraction(compressor<threshold, identity, residual>(threshold{0.5}), g, density,
                        true);
      // No pass over e + g that could add it up: top-k on g without feedback.
      check_contraction(compressor<topk, identity, no_feedback>{}, g, density, false);
      // Exact top-k keeps the most energy a selection of k coordinates can keep; at the first
      // step (same accumulated vector) at least as much as random-k's k, and at least k/n.
      if (n > 0 && !std::isnan(top[0])) {
        const double k = static_cast<double>(k_for_density(n, density));
        CHECK(top[0] >= rnd[0] - 1e-9);
        CHECK(top[0] >= k / static_cast<double>(n) - 1e-9);
      }
    }
  }
}

TEST_CASE("topk select_accumulate_into: ||e + g||^2 on every path") {
  // Small n (exact finish), the streaming heap (small k), the sampled bracket, a bracket that
  // misses (radix finish), the forced radix method, k = 0 and k = n: every value passes
  // through the source once, whatever path the selection takes.
  namespace gt = gradcomp_test;
  for (gt::dist d : gt::all_dists) {
    for (std::size_t n : {std::size_t{1}, std::size_t{100}, std::size_t{2048},
                          std::size_t{2049}, std::size_t{50000}, (std::size_t{1} << 20) + 3}) {
      const auto e0 = gt::make_input<float>(d, n, 21);
      const auto g = gt::make_input<float>(gt::dist::normal, n, 22);
      long double ref = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float x = e0[i] + g[i];
        ref += static_cast<long double>(x) * x;
      }
      for (std::size_t k : {std::size_t{0}, std::size_t{1}, std::size_t{10}, n / 100 + 1,
                            n / 3, n}) {
        if (k > n) continue;
        for (topk_method method : {topk_method::automatic, topk_method::radix}) {
          const std::string dist_name = gt::name(d);
          CAPTURE(dist_name);
          CAPTURE(n);
          CAPTURE(k);
          topk sel;
          sel.method = method;
          std::vector<float> e = e0;
          std::vector<float> out(n);
          std::vector<std::uint32_t> idx;
          const auto st = sel.select_accumulate_into(std::span<float>(out),
                                                     std::span<const float>(e),
                                                     std::span<const float>(g),
                                                     select_context{k, 0.0, {}}, idx);
          CHECK(st.energy == doctest::Approx(static_cast<double>(ref)).epsilon(1e-5));
        }
      }
    }
  }
}

TEST_CASE("sum_into_energy: the sums of sum_into, bit for bit, and their squares' sum") {
  using gradcomp::detail::sum_into;
  using gradcomp::detail::sum_into_energy;
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{1023},
                        std::size_t{1024}, std::size_t{1025}, std::size_t{100003}}) {
    CAPTURE(n);
    const auto e = gradcomp_test::make_input<double>(gradcomp_test::dist::laplace, n, 4);
    const auto g = gradcomp_test::make_input<double>(gradcomp_test::dist::student_t2, n, 5);
    std::vector<double> a(n), b(n);
    sum_into(a.data(), e.data(), g.data(), n);
    double energy = 0.25;  // adds to what is there
    sum_into_energy(b.data(), e.data(), g.data(), n, &energy);
    CHECK(a == b);
    long double ref = 0.25L;
    for (const double x : a) ref += static_cast<long double>(x) * x;
    CHECK(energy == doctest::Approx(static_cast<double>(ref)).epsilon(1e-12));
  }
}
