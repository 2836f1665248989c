// Random-k, fixed threshold, DGC sampling, RedSync and dense, and the properties every
// selector shares (empty inputs, strictly increasing indices below n, g left unchanged).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/select.hpp>

#include "select_test_inputs.hpp"

namespace gt = gradcomp_test;

namespace {

template <class S, class T>
gradcomp::selection_stats run(S& sel, const std::vector<T>& g, std::size_t k,
                              std::vector<std::uint32_t>& out, gradcomp::call_id id = {}) {
  gradcomp::select_context ctx;
  ctx.k = k;
  ctx.density = g.empty() ? 0.0 : static_cast<double>(k) / static_cast<double>(g.size());
  ctx.id = id;
  return sel.select(std::span<const T>(g), ctx, out);
}

template <class T>
std::vector<std::uint32_t> at_least(const std::vector<T>& g, double thr) {
  return gt::indices_where(g, [&](T x) { return std::fabs(static_cast<double>(x)) >= thr; });
}

template <class T>
std::vector<std::uint32_t> above(const std::vector<T>& g, double thr) {
  return gt::indices_where(g, [&](T x) { return std::fabs(static_cast<double>(x)) > thr; });
}

struct not_a_selector {
  int select(std::span<const float>) { return 0; }
};

}  // namespace

static_assert(!gradcomp::selector<not_a_selector>);
static_assert(gradcomp::randomk::shared_indices);
static_assert(gradcomp::dense::shared_indices && gradcomp::dense::selects_all);

// ---------------------------------------------------------------------------------------
// randomk

TEST_CASE("randomk: the same call_id gives the same indices on every rank") {
  const std::size_t n = 100000;
  for (std::size_t k :
       {std::size_t{1}, std::size_t{100}, std::size_t{5000}, n / 2, n / 2 + 1, n - 3, n}) {
    CAPTURE(k);
    const gradcomp::call_id id{42, 7, 3};
    std::vector<std::vector<std::uint32_t>> per_rank(4);
    for (std::size_t r = 0; r < per_rank.size(); ++r) {
      gradcomp::randomk sel;  // one instance per rank, each with its own gradient
      const auto g = gt::make_input<float>(gt::dist::normal, n, 100 + r);
      const auto st = run(sel, g, k, per_rank[r], id);
      CHECK(st.count == k);
      CHECK(st.threshold == 0.0);
    }
    for (std::size_t r = 1; r < per_rank.size(); ++r) CHECK(per_rank[r] == per_rank[0]);
    CHECK(per_rank[0].size() == k);
    CHECK(gt::strictly_increasing_below(per_rank[0], n));
  }
}

TEST_CASE("randomk: seed, step and tensor id each change the draw") {
  const std::size_t n = 50000;
  const std::vector<double> g(n, 1.0);
  gradcomp::randomk sel;
  for (std::size_t k : {std::size_t{10}, std::size_t{1000}, std::size_t{40000}}) {
    CAPTURE(k);
    std::vector<std::uint32_t> base, other;
    run(sel, g, k, base, {1, 2, 3});
    run(sel, g, k, other, {1, 2, 3});
    CHECK(base == other);
    run(sel, g, k, other, {9, 2, 3});
    CHECK(base != other);
    run(sel, g, k, other, {1, 3, 3});
    CHECK(base != other);
    run(sel, g, k, other, {1, 2, 4});
    CHECK(base != other);
  }
}

TEST_CASE("randomk: every index is drawn with frequency about k/n") {
  struct setting {
    std::size_t n, k, steps, buckets;
  };
  // Hash set, bitmap, and complement paths.
  for (const setting s : {setting{100000, 100, 2000, 100}, setting{1000, 100, 1000, 1000},
                          setting{64, 8, 4000, 64}, setting{64, 50, 4000, 64}}) {
    CAPTURE(s.n);
    CAPTURE(s.k);
    gradcomp::randomk sel;
    const std::vector<float> g(s.n, 0.5f);
    std::vector<double> hits(s.buckets, 0.0);
    std::vector<std::uint32_t> out;
    for (std::uint64_t step = 0; step < s.steps; ++step) {
      run(sel, g, s.k, out, {5, step, 1});
      REQUIRE(out.size() == s.k);
      REQUIRE(gt::strictly_increasing_below(out, s.n));
      for (std::uint32_t i : out) hits[i * s.buckets / s.n] += 1.0;
    }
    const double expected = static_cast<double>(s.steps * s.k) / static_cast<double>(s.buckets);
    double chi2 = 0.0;
    for (double h : hits) chi2 += (h - expected) * (h - expected) / expected;
    const double dof = static_cast<double>(s.buckets - 1);
    CHECK(chi2 < dof + 6.0 * std::sqrt(2.0 * dof));
    CHECK(chi2 > dof - 6.0 * std::sqrt(2.0 * dof));
  }
}

// ---------------------------------------------------------------------------------------
// threshold

TEST_CASE("threshold: exactly {i : |g_i| >= tau}, k ignored") {
  std::vector<std::uint32_t> out;
  for (gt::dist d : gt::all_dists) {
    const auto gf = gt::make_input<float>(d, 20000, 3);
    const auto gd = gt::make_input<double>(d, 20000, 3);
    for (double tau : {0.0, 1e-40, 0.25, 0.375, 0.5, 1.0 / 3.0, 2.5, static_cast<double>(gf[17]),
                       1e30, std::numeric_limits<double>::infinity()}) {
      tau = std::fabs(tau);
      const std::string dist_name = gt::name(d);
      CAPTURE(dist_name);
      CAPTURE(tau);
      gradcomp::threshold sel{.tau = tau};
      auto st = run(sel, gf, 5, out);
      CHECK(out == at_least(gf, tau));
      CHECK(st.count == out.size());
      CHECK(st.threshold == tau);
      st = run(sel, gd, 0, out);
      CHECK(out == at_least(gd, tau));
    }
  }
  // An element equal to tau is selected.
  gradcomp::threshold sel{.tau = 0.5};
  run(sel, std::vector<float>{0.25f, -0.5f, 0.5f, 0.75f}, 1, out);
  CHECK(out == std::vector<std::uint32_t>{1, 2, 3});
  // NaN ranks above +Inf: selected for every tau.
  sel.tau = 1e300;
  run(sel, std::vector<float>{1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f}, 1, out);
  CHECK(out == std::vector<std::uint32_t>{1});
  // tau between two floats: the comparison is made in double.
  sel.tau = 0.1;  // not a float: 0.1f > 0.1
  run(sel, std::vector<float>{0.1f, std::nextafter(0.1f, 0.0f)}, 1, out);
  CHECK(out == std::vector<std::uint32_t>{0});
}

TEST_CASE("threshold: tau must be >= 0 and not NaN") {
  std::vector<std::uint32_t> out;
  const std::vector<float> g(10, 1.0f);
  for (double tau : {-1.0, -1e-300, std::numeric_limits<double>::quiet_NaN()}) {
    gradcomp::threshold sel{.tau = tau};
    CHECK_THROWS_AS(run(sel, g, 1, out), gradcomp::invalid_argument);
    try {
      run(sel, g, 1, out);
    } catch (const gradcomp::invalid_argument& e) {
      CHECK(std::string(e.what()).find("'tau'") != std::string::npos);
    }
  }
}

// ---------------------------------------------------------------------------------------
// dgc_sampling

template <class T>
void check_dgc(const std::vector<T>& g, std::size_t k, const gradcomp::dgc_sampling& sel_in,
               gradcomp::call_id id = {}) {
  gradcomp::dgc_sampling sel = sel_in;
  std::vector<std::uint32_t> out;
  const auto st = run(sel, g, k, out, id);
  CHECK(st.iterations >= 1);
  CHECK(st.iterations <= sel.max_rounds);
  CHECK(out.size() == st.count);
  CHECK(gt::strictly_increasing_below(out, g.size()));
  if (st.fallback) {
    CHECK(st.count == k);
    CHECK(out == gt::reference_topk(g, k));
  } else {
    CHECK(out == at_least(g, st.threshold));
    CHECK(static_cast<double>(st.count) <= sel.upper * static_cast<double>(k));
    if (st.iterations < sel.max_rounds && st.threshold > 0.0) {
      CHECK(static_cast<double>(st.count) >= sel.lower * static_cast<double>(k));
    }
  }
}

TEST_CASE("dgc_sampling: count within [0.8k, 1.3k] or exactly the top-k") {
  const std::size_t n = std::size_t{1} << 20;
  const auto gf = gt::make_input<float>(gt::dist::normal, n, 17);
  const auto gd = gt::make_input<double>(gt::dist::normal, n, 18);
  for (double density : {0.0001, 0.001, 0.01, 0.1}) {
    for (std::uint64_t step = 0; step < 3; ++step) {
      CAPTURE(density);
      const std::size_t k = gradcomp::k_for_density(n, density);
      check_dgc(gf, k, {}, {1, step, 0});
      check_dgc(gd, k, {}, {1, step, 0});
    }
  }
}

TEST_CASE("dgc_sampling: heavy tails, ties, constant and zero inputs terminate") {
  const std::size_t n = 100000;
  for (gt::dist d : gt::all_dists) {
    for (double density : {0.001, 0.05, 0.5}) {
      const std::string dist_name = gt::name(d);
      CAPTURE(dist_name);
      CAPTURE(density);
      const auto g = gt::make_input<float>(d, n, 23);
      check_dgc(g, gradcomp::k_for_density(n, density), {});
    }
  }
  const std::vector<double> zeros(5000, 0.0);
  check_dgc(zeros, 50, {});
  gradcomp::dgc_sampling few{.decay = 0.99, .max_rounds = 2};
  check_dgc(gt::make_input<float>(gt::dist::laplace, n, 2), 500, few);
}

TEST_CASE("dgc_sampling: the sample is a function of call_id; NaN falls back") {
  const std::size_t n = 200000;
  const auto g = gt::make_input<float>(gt::dist::laplace, n, 29);
  gradcomp::dgc_sampling a, b;
  std::vector<std::uint32_t> oa, ob;
  const auto sa = run(a, g, 200, oa, {3, 4, 5});
  const auto sb = run(b, g, 200, ob, {3, 4, 5});
  CHECK(oa == ob);
  CHECK(sa.threshold == sb.threshold);
  auto with_nan = g;
  with_nan[10] = std::numeric_limits<float>::quiet_NaN();
  for (std::size_t i = 0; i < n; i += 97) with_nan[i] = std::numeric_limits<float>::infinity();
  const auto st = run(a, with_nan, 200, oa);
  CHECK(st.fallback);
  CHECK(oa == gt::reference_topk(with_nan, 200));
}

// ---------------------------------------------------------------------------------------
// redsync

template <class T>
void check_redsync(const std::vector<T>& g, std::size_t k, gradcomp::redsync sel = {}) {
  std::vector<std::uint32_t> out;
  const auto st = run(sel, g, k, out);
  CHECK(out.size() == st.count);
  CHECK(out == above(g, st.threshold));
  CHECK(st.iterations >= 1);
  if (k > 0) {
    const double mean = [&] {
      double s = 0;
      for (T x : g) s += std::fabs(static_cast<double>(x));
      return s / static_cast<double>(g.size());
    }();
    // Selects at least k unless even thr = mean|g| leaves fewer.
    if (above(g, mean).size() >= k) CHECK(st.count >= k);
    CHECK(st.threshold >= mean * (1 - 1e-6));  // the mean is summed in T chunks
  }
}

TEST_CASE("redsync: on normal input at least k, exactly {i : |g_i| > thr}") {
  const std::size_t n = std::size_t{1} << 20;
  const auto gf = gt::make_input<float>(gt::dist::normal, n, 41);
  const auto gd = gt::make_input<double>(gt::dist::normal, n, 42);
  for (double density : {0.0001, 0.001, 0.01, 0.1, 0.3}) {
    CAPTURE(density);
    const std::size_t k = gradcomp::k_for_density(n, density);
    check_redsync(gf, k);
    check_redsync(gd, k);
    gradcomp::redsync sel;
    std::vector<std::uint32_t> out;
    const auto st = run(sel, gf, k, out);
    // At most log2(1 / 0.2) + 1 bisection steps.
    CHECK(st.iterations <= 3);
    if (st.count < 2 * k) CHECK(st.count >= k);
  }
  gradcomp::redsync fine{.min_interval = 1e-3};
  std::vector<std::uint32_t> out;
  const auto st = run(fine, gf, n / 1000, out);
  CHECK(st.count >= n / 1000);
  CHECK(st.count < n / 500);
}

TEST_CASE("redsync: other inputs terminate; constant and zero inputs select nothing") {
  const std::size_t n = 100000;
  for (gt::dist d : gt::all_dists) {
    for (double density : {0.001, 0.05, 0.5}) {
      const std::string dist_name = gt::name(d);
      CAPTURE(dist_name);
      CAPTURE(density);
      check_redsync(gt::make_input<float>(d, n, 7), gradcomp::k_for_density(n, density));
    }
  }
  gradcomp::redsync sel;
  std::vector<std::uint32_t> out;
  CHECK(run(sel, std::vector<float>(1000, 0.0f), 10, out).count == 0);
  CHECK(run(sel, std::vector<double>(1000, -2.0), 10, out).count == 0);
  CHECK(out.empty());
  sel.min_interval = 0.0;
  CHECK_THROWS_AS(run(sel, std::vector<float>(10, 1.0f), 1, out), gradcomp::invalid_argument);
  sel.min_interval = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(run(sel, std::vector<float>(10, 1.0f), 1, out), gradcomp::invalid_argument);
  // NaN falls back to exact top-k.
  gradcomp::redsync ok;
  auto g = gt::make_input<float>(gt::dist::normal, 3000, 3);
  g[5] = std::numeric_limits<float>::quiet_NaN();
  const auto st = run(ok, g, 30, out);
  CHECK(st.fallback);
  CHECK(out == gt::reference_topk(g, 30));
}

// ---------------------------------------------------------------------------------------
// dense

TEST_CASE("dense: every index in order") {
  gradcomp::dense sel;
  std::vector<std::uint32_t> out = {9, 9};
  const auto g = gt::make_input<double>(gt::dist::normal, 1000, 1);
  const auto st = run(sel, g, 3, out);
  CHECK(st.count == 1000);
  CHECK(st.threshold == 0.0);
  REQUIRE(out.size() == 1000);
  for (std::size_t i = 0; i < out.size(); ++i) CHECK(out[i] == i);
  run(sel, std::vector<float>{}, 0, out);
  CHECK(out.empty());
}

// ---------------------------------------------------------------------------------------
// Shared properties.

template <class S, class T>
void common_properties(S sel, bool uses_k) {
  std::vector<std::uint32_t> out = {1, 2, 3};
  // n = 0.
  auto st = run(sel, std::vector<T>{}, 0, out);
  CHECK(out.empty());
  CHECK(st.count == 0);
  for (gt::dist d : gt::all_dists) {
    for (std::size_t n :
         {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{1000}, std::size_t{65537}}) {
      const auto g = gt::make_input<T>(d, n, n + 3);
      const auto before = g;
      const std::string dist_name = gt::name(d);
      CAPTURE(dist_name);
      CAPTURE(n);
      out = {7};
      st = run(sel, g, 0, out);
      if (uses_k) {
        CHECK(out.empty());
        CHECK(st.count == 0);
      }
      for (std::size_t k : gt::k_values(n)) {
        CAPTURE(k);
        st = run(sel, g, k, out, {11, k, 2});
        CHECK(out.size() == st.count);
        CHECK(gt::strictly_increasing_below(out, n));
      }
      CHECK(g == before);
      if (uses_k) CHECK_THROWS_AS(run(sel, g, n + 1, out), gradcomp::invalid_argument);
    }
  }
}

TEST_CASE("every selector: empty inputs, k = 0, increasing indices below n, g unchanged") {
  common_properties<gradcomp::topk, float>({}, true);
  common_properties<gradcomp::topk, double>({}, true);
  common_properties<gradcomp::gaussiank, float>({}, true);
  common_properties<gradcomp::gaussiank, double>({.cap_at_k = true}, true);
  common_properties<gradcomp::randomk, float>({}, true);
  common_properties<gradcomp::randomk, double>({}, true);
  common_properties<gradcomp::dgc_sampling, float>({}, true);
  common_properties<gradcomp::dgc_sampling, double>({}, true);
  common_properties<gradcomp::redsync, float>({}, true);
  common_properties<gradcomp::redsync, double>({}, true);
  common_properties<gradcomp::threshold, float>({.tau = 0.5}, false);
  common_properties<gradcomp::threshold, double>({.tau = 0.0}, false);
  common_properties<gradcomp::dense, float>({}, false);
  common_properties<gradcomp::dense, double>({}, false);
}
