// Exact Top-k against sort-and-truncate, over sizes, densities, distributions and both
// element types, plus tests that force each internal path.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/select/topk.hpp>

#include "select_test_inputs.hpp"
#include "topk_sweep.hpp"

namespace gt = gradcomp_test;
using gt::check_against;
using gt::run;
using gt::sweep;

TEST_CASE("reference self-test: nth_element selection equals sort-and-truncate") {
  for (gt::dist d : gt::all_dists) {
    auto g = gt::make_input<double>(d, 5000, 77);
    g[10] = std::numeric_limits<double>::quiet_NaN();
    const auto order = gt::reference_order(g);
    for (std::size_t k : {std::size_t{1}, std::size_t{2}, std::size_t{5}, std::size_t{2500},
                          std::size_t{4999}, std::size_t{5000}}) {
      const auto sel = gt::reference_select(g, k);
      CHECK(sel.indices == gt::reference_topk(order, k));
      CHECK(sel.kth == order[k - 1]);
    }
  }
}

TEST_CASE("topk equals sort-and-truncate: small and random sizes, float") {
  sweep<float>({0, 1, 2, 3, 1000, 2049, 4099, 77777, 300001});
}

TEST_CASE("topk equals sort-and-truncate: small and random sizes, double") {
  sweep<double>({0, 1, 2, 3, 1000, 2049, 5003, 65537, 200003});
}

TEST_CASE("topk: every k of tiny inputs with ties") {
  gradcomp::topk sel;
  std::vector<std::uint32_t> out;
  for (std::size_t n = 0; n <= 40; ++n) {
    for (gt::dist d : {gt::dist::normal, gt::dist::ties, gt::dist::all_equal}) {
      const auto g = gt::make_input<float>(d, n, 7 + n);
      const auto order = gt::reference_order(g);
      for (std::size_t k = 0; k <= n; ++k) {
        CAPTURE(n);
        CAPTURE(k);
        const auto st = run(sel, g, k, out);
        check_against(g, order, k, out, st);
      }
    }
  }
}

TEST_CASE("topk: the sampled bracket hits on normal input") {
  const std::size_t n = std::size_t{1} << 20;
  gradcomp::topk sel;
  std::vector<std::uint32_t> out;
  const auto g = gt::make_input<float>(gt::dist::normal, n, 3);
  const auto order = gt::reference_order(g);
  for (std::size_t k : {n / 1000, n / 100, n / 10, n / 2}) {
    CAPTURE(k);
    const auto st = run(sel, g, k, out);
    CHECK_FALSE(st.fallback);
    CHECK(st.iterations == 0);
    CHECK(out == gt::reference_topk(order, k));
  }
}

TEST_CASE("topk: a bracket without margin misses and radix select finishes") {
  const std::size_t n = std::size_t{1} << 20;
  gradcomp::topk sel;
  sel.bracket_sigmas = 0.0;
  sel.bracket_margin = 0;
  std::vector<std::uint32_t> out;
  // k * s / n is an integer here, so the bracket collapses to one sampled key: the bracket
  // only hits if that key is exactly the k-th largest of g.
  const std::size_t k = 1024;
  {
    const auto g = gt::make_input<float>(gt::dist::normal, n, 11);
    const auto order = gt::reference_order(g);
    const auto st = run(sel, g, k, out);
    CHECK(st.fallback);
    CHECK(st.iterations == 3);  // 31 key bits in 11-bit digits
    CHECK(out == gt::reference_topk(order, k));
    CHECK(st.threshold == std::fabs(static_cast<double>(g[order[k - 1]])));
  }
  {
    const auto g = gt::make_input<double>(gt::dist::laplace, n, 12);
    const auto st = run(sel, g, k, out);
    CHECK(st.fallback);
    CHECK(st.iterations == 6);  // 63 key bits
    CHECK(out == gt::reference_topk(g, k));
  }
}

TEST_CASE("topk: massive ties overflow the candidate budget and fall back") {
  const std::size_t n = std::size_t{1} << 18;
  gradcomp::topk sel;
  std::vector<std::uint32_t> out;
  for (gt::dist d : {gt::dist::all_equal, gt::dist::zeros90, gt::dist::ties}) {
    const std::string dist_name = gt::name(d);
    CAPTURE(dist_name);
    const auto g = gt::make_input<float>(d, n, 5);
    const std::size_t k = (d == gt::dist::zeros90) ? n / 2 : n / 1000;
    const auto st = run(sel, g, k, out);
    CHECK(st.fallback);
    CHECK(out == gt::reference_topk(g, k));
  }
}

TEST_CASE("topk: small k (heap) and just above it, also on adversarial (ascending) input") {
  const std::size_t n = std::size_t{1} << 16;
  gradcomp::topk sel;
  std::vector<std::uint32_t> out;
  std::vector<double> ascending(n);
  std::vector<double> descending(n);
  for (std::size_t i = 0; i < n; ++i) {
    ascending[i] = static_cast<double>(i % 1000) * 0.5;  // repeating ramp: ties and rises
    descending[i] = -static_cast<double>(n - i);
  }
  for (std::size_t k : {1, 2, 7, 16, 64, 65, 100, 255}) {
    CAPTURE(k);
    auto st = run(sel, ascending, k, out);
    CHECK_FALSE(st.fallback);
    CHECK(out == gt::reference_topk(ascending, k));
    st = run(sel, descending, k, out);
    CHECK(out == gt::reference_topk(descending, k));
  }
}

TEST_CASE("topk: NaN ranks above +Inf, Inf above finite values") {
  gradcomp::topk sel;
  std::vector<std::uint32_t> out;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (std::size_t n : {std::size_t{50}, std::size_t{5000}, std::size_t{1} << 18}) {
    auto g = gt::make_input<float>(gt::dist::normal, n, 9);
    g[n / 3] = -inf;
    g[n / 2] = nan;
    g[n - 1] = -nan;
    g[n / 5] = inf;
    const auto order = gt::reference_order(g);
    for (std::size_t k : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{4},
                          std::size_t{5}, n / 100, n / 2, n}) {
      if (k == 0) continue;
      CAPTURE(n);
      CAPTURE(k);
      const auto st = run(sel, g, k, out);
      check_against(g, order, k, out, st);
    }
    run(sel, g, 2, out);
    CHECK(out == std::vector<std::uint32_t>{static_cast<std::uint32_t>(n / 2),
                                            static_cast<std::uint32_t>(n - 1)});
  }
  // Only NaN.
  const std::vector<double> all_nan(3000, std::numeric_limits<double>::quiet_NaN());
  const auto st = run(sel, all_nan, 10, out);
  CHECK(out == gt::reference_topk(all_nan, 10));
  CHECK(std::isnan(st.threshold));
}

TEST_CASE("topk: -0 and +0 tie, lower index wins") {
  gradcomp::topk sel;
  std::vector<std::uint32_t> out;
  const std::vector<float> g = {-0.0f, 0.0f, -0.0f, 0.0f, 1.0f};
  run(sel, g, 3, out);
  CHECK(out == std::vector<std::uint32_t>{0, 1, 4});
}

TEST_CASE("topk: empty inputs and k = 0") {
  gradcomp::topk sel;
  std::vector<std::uint32_t> out = {1, 2, 3};
  const std::vector<float> empty;
  auto st = run(sel, empty, 0, out);
  CHECK(out.empty());
  CHECK(st.count == 0);
  const auto g = gt::make_input<float>(gt::dist::normal, 5000, 1);
  out = {4, 5};
  st = run(sel, g, 0, out);
  CHECK(out.empty());
  CHECK(st.count == 0);
}

TEST_CASE("topk: argument errors") {
  gradcomp::topk sel;
  std::vector<std::uint32_t> out;
  const auto g = gt::make_input<float>(gt::dist::normal, 10, 1);
  CHECK_THROWS_AS(run(sel, g, 11, out), gradcomp::invalid_argument);
  try {
    run(sel, g, 12, out);
  } catch (const gradcomp::invalid_argument& e) {
    const std::string msg = e.what();
    CHECK(msg.find("'k'") != std::string::npos);
    CHECK(msg.find("topk") != std::string::npos);
    CHECK(msg.find("n = 10") != std::string::npos);
  }
  const std::vector<float> empty;
  CHECK_THROWS_AS(run(sel, empty, 1, out), gradcomp::invalid_argument);
  CHECK_THROWS_AS(gradcomp::detail::check_index_range("topk", (std::size_t{1} << 32) + 1),
                  gradcomp::invalid_argument);
  CHECK_NOTHROW(gradcomp::detail::check_index_range("topk", std::size_t{1} << 32));
}

TEST_CASE("k_for_density validates the density") {
  CHECK_THROWS_AS(gradcomp::k_for_density(100, 0.0), gradcomp::invalid_argument);
  CHECK_THROWS_AS(gradcomp::k_for_density(100, -1.0), gradcomp::invalid_argument);
  CHECK_THROWS_AS(gradcomp::k_for_density(100, 1.5), gradcomp::invalid_argument);
  CHECK_THROWS_AS(gradcomp::k_for_density(100, std::numeric_limits<double>::quiet_NaN()),
                  gradcomp::invalid_argument);
  CHECK(gradcomp::k_for_density(100, 1.0) == 100);
  CHECK(gradcomp::k_for_density(12345, 1.0) == 12345);
  CHECK(gradcomp::k_for_density(100, 1e-9) == 1);
  CHECK(gradcomp::k_for_density(0, 0.5) == 0);
}

TEST_CASE("topk: copies keep settings and work independently") {
  gradcomp::topk a;
  a.sample_scale = 3.0;
  std::vector<std::uint32_t> out;
  const auto g = gt::make_input<float>(gt::dist::normal, 100000, 4);
  run(a, g, 100, out);
  gradcomp::topk b = a;  // copies settings; scratch starts empty
  CHECK(b.sample_scale == 3.0);
  std::vector<std::uint32_t> out_b;
  run(b, g, 100, out_b);
  CHECK(out == out_b);
  b = gradcomp::topk{.sample_scale = 0.5};
  run(b, g, 100, out_b);
  CHECK(out == out_b);
}

TEST_CASE("abs key: order of |g| for finite values, Inf and NaN on top, signs ignored") {
  using gradcomp::detail::abs_key;
  CHECK(abs_key(-0.0f) == abs_key(0.0f));
  CHECK(abs_key(-1.5f) == abs_key(1.5f));
  CHECK(abs_key(1.0f) < abs_key(1.0000001f));
  CHECK(abs_key(std::numeric_limits<float>::denorm_min()) > abs_key(0.0f));
  CHECK(abs_key(std::numeric_limits<float>::max()) <
        abs_key(std::numeric_limits<float>::infinity()));
  CHECK(abs_key(std::numeric_limits<float>::infinity()) <
        abs_key(std::numeric_limits<float>::quiet_NaN()));
  CHECK(abs_key(-std::numeric_limits<double>::infinity()) <
        abs_key(-std::numeric_limits<double>::quiet_NaN()));
  CHECK(gradcomp::detail::radix_digit(std::uint32_t{0x7ff00000u}, 20, 11) == 0x7ffu);
  CHECK(gradcomp::detail::radix_digit(std::uint64_t{0x3ull} << 61, 52, 11) == 0x600u);
}

TEST_CASE("key thresholds match double comparisons in the element type") {
  using gradcomp::detail::abs_key;
  using gradcomp::detail::key_threshold_above;
  using gradcomp::detail::key_threshold_at_least;
  gt::splitmix rng{99};
  const double taus[] = {0.0,       1e-50, 0.1,
                         1.0 / 3.0, 1.0,   3.4e38,
                         3.5e38,    1e300, std::numeric_limits<double>::infinity()};
  for (double tau : taus) {
    const auto ta = key_threshold_above<float>(tau);
    const auto tl = key_threshold_at_least<float>(tau);
    for (int i = 0; i < 2000; ++i) {
      const double v = (i % 2 ? tau : rng.normal()) * (1.0 + (rng.uniform() - 0.5) * 1e-7);
      const float x = static_cast<float>(std::min(std::fabs(v), 3.4e38));
      const auto key = static_cast<std::int64_t>(abs_key(x));
      CAPTURE(tau);
      CAPTURE(x);
      CHECK((key > ta) == (static_cast<double>(x) > tau));
      CHECK((key > tl) == (static_cast<double>(x) >= tau));
    }
    const float inf = std::numeric_limits<float>::infinity();
    CHECK((static_cast<std::int64_t>(abs_key(inf)) > ta) == (inf > tau));
    CHECK((static_cast<std::int64_t>(abs_key(inf)) > tl) == (inf >= tau));
    CHECK(static_cast<std::int64_t>(abs_key(std::numeric_limits<float>::quiet_NaN())) > tl);
  }
}
