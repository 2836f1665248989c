// topk's `method` option: topk_method::radix forces the radix select on every path and must give
// exactly the index set and threshold of the default method (which the other topk tests check
// against sort-and-truncate), with stats.iterations = the radix passes and fallback = false.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include <gradcomp/detail/radix_digits.hpp>
#include <gradcomp/select/topk.hpp>

#include "../support/data.hpp"

using gradcomp_test::dist;

namespace {

// Sort-and-truncate reference: k indices of largest |g| key, ties to the lower index, ascending.
template <class T>
std::vector<std::uint32_t> reference_topk(const std::vector<T>& g, std::size_t k) {
  std::vector<std::uint32_t> idx(g.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::stable_sort(idx.begin(), idx.end(), [&](std::uint32_t a, std::uint32_t b) {
    return gradcomp::detail::abs_key(g[a]) > gradcomp::detail::abs_key(g[b]);
  });
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

template <class T>
void check_methods(const std::vector<T>& g, std::size_t k) {
  CAPTURE(g.size());
  CAPTURE(k);
  gradcomp::topk automatic;
  gradcomp::topk radix;
  radix.method = gradcomp::topk_method::radix;
  const gradcomp::select_context ctx{k, 0.0, {}};
  std::vector<std::uint32_t> a;
  std::vector<std::uint32_t> r;
  const auto sa = automatic.select(std::span<const T>(g), ctx, a);
  const auto sr = radix.select(std::span<const T>(g), ctx, r);
  CHECK(r == a);
  CHECK(r == reference_topk(g, k));
  CHECK(sr.count == k);
  CHECK(sr.fallback == false);
  if (k == 0) {
    CHECK(sr.iterations == 0);
    CHECK(sr.threshold == 0.0);
    return;
  }
  CHECK(sr.iterations == gradcomp::detail::radix_passes(gradcomp::detail::abs_key_traits<T>::bits));
  // Thresholds compared as keys: NaN thresholds must match too.
  CHECK(gradcomp::detail::abs_key(static_cast<T>(sr.threshold)) ==
        gradcomp::detail::abs_key(static_cast<T>(sa.threshold)));

  // select_accumulate with the radix method: the selection of e + g, and e = e + g after.
  std::vector<T> e(g.size());
  for (std::size_t i = 0; i < e.size(); ++i) e[i] = static_cast<T>(0.25) * static_cast<T>(i % 3);
  std::vector<T> sum(g.size());
  for (std::size_t i = 0; i < e.size(); ++i) sum[i] = e[i] + g[i];
  std::vector<std::uint32_t> ra;
  radix.select_accumulate(std::span<T>(e), std::span<const T>(g), ctx, ra);
  CHECK(ra == reference_topk(sum, k));
  CHECK(std::equal(e.begin(), e.end(), sum.begin(), [](T x, T y) {
    return gradcomp::detail::abs_key(x) == gradcomp::detail::abs_key(y);
  }));
}

}  // namespace

TEST_CASE_TEMPLATE("topk_method::radix equals the automatic method", T, float, double) {
  for (dist d : gradcomp_test::all_dists) {
    CAPTURE(gradcomp_test::name(d));
    for (std::size_t n : {std::size_t{1}, std::size_t{2}, std::size_t{33}, std::size_t{2049},
                          std::size_t{100003}}) {
      auto g = gradcomp_test::make_input<T>(d, n, 7);
      for (std::size_t k : {std::size_t{0}, std::size_t{1}, n / 1000 + 1, n / 10, n - 1, n}) {
        if (k > n) continue;
        check_methods(g, k);
      }
    }
  }
}

TEST_CASE("topk_method::radix with NaN and Inf") {
  auto g = gradcomp_test::make_input<float>(dist::normal, 50000, 3);
  g[10] = std::numeric_limits<float>::quiet_NaN();
  g[20] = -std::numeric_limits<float>::infinity();
  g[30] = std::numeric_limits<float>::infinity();
  for (std::size_t k : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{500}}) {
    check_methods(g, k);
  }
}

TEST_CASE("topk_method::radix on 2^20 values with many ties") {
  auto g = gradcomp_test::make_input<float>(dist::ties, std::size_t{1} << 20, 9);
  check_methods(g, 1000);
  check_methods(g, 300000);
}

TEST_CASE("topk_method::radix rejects bad k like the automatic method") {
  gradcomp::topk radix;
  radix.method = gradcomp::topk_method::radix;
  std::vector<float> g(10, 1.0f);
  std::vector<std::uint32_t> idx{1, 2, 3};
  CHECK_THROWS_AS(
      radix.select(std::span<const float>(g), gradcomp::select_context{11, 0.0, {}}, idx),
      gradcomp::invalid_argument);
  CHECK(idx == std::vector<std::uint32_t>{1, 2, 3});
}

TEST_CASE("topk::bracket_plan stays within its documented ranges") {
  gradcomp::topk sel;
  for (std::size_t n :
       {std::size_t{2049}, std::size_t{100003}, std::size_t{25557032}, std::size_t{1} << 32}) {
    for (double rho : {1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9}) {
      const auto k = static_cast<std::size_t>(rho * static_cast<double>(n)) + 65;
      if (k >= n) continue;
      CAPTURE(n);
      CAPTURE(k);
      const auto p = sel.bracket_plan(n, k);
      CHECK(p.s >= 1);
      CHECK(p.s <= std::max<std::size_t>(n / 16, 1));
      CHECK(p.lo_pos <= p.s);
      if (p.hi == gradcomp::detail::bracket_hi::sample_rank) CHECK(p.hi_pos < p.lo_pos);
      CHECK(p.budget >= std::min(sel.min_candidate_budget, n));
      CHECK(p.budget <= n);
    }
  }
}
