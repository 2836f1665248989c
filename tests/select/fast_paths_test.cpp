// The one-read paths of the selectors, each forced and compared with a reference: topk's and
// gaussiank's select_accumulate (e += g folded into the selection pass) against select() on
// e + g, Gaussian-k's sampled prediction against its plain two-pass form, the vectorised
// non-finite scan, and compressor<>'s fused residual step against the unfused one.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/detail/host_dispatch.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/quantize/identity.hpp>
#include <gradcomp/quantize/qsgd.hpp>
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/topk.hpp>
#include <gradcomp/step.hpp>

#include "fast_paths.hpp"
#include "select_test_inputs.hpp"

namespace gt = gradcomp_test;

TEST_CASE("topk select_accumulate: every path equals select on e + g, and e becomes e + g") {
  gt::accumulate_paths<gradcomp::topk, float>(gradcomp::topk{});
  gt::accumulate_paths<gradcomp::topk, double>(gradcomp::topk{});
}

TEST_CASE("topk select_accumulate: bracket hit, forced miss and tie overflow") {
  const std::size_t n = std::size_t{1} << 18;
  for (gt::dist d : {gt::dist::normal, gt::dist::laplace, gt::dist::student_t2}) {
    const std::string dist_name = gt::name(d);
    CAPTURE(dist_name);
    gradcomp::topk hit;
    const auto st = gt::check_accumulate(hit, gt::make_input<float>(d, n, 3),
                                         gt::make_input<float>(d, n, 4), n / 1000);
    CHECK_FALSE(st.fallback);  // the bracket is built on ranks: tails do not matter
    gradcomp::topk miss;
    miss.bracket_sigmas = 0.0;
    miss.bracket_margin = 0;
    CHECK(gt::check_accumulate(miss, gt::make_input<float>(d, n, 3),
                               gt::make_input<float>(d, n, 4), 1024)
              .fallback);
  }
  // Equal magnitudes everywhere: the candidate list overflows in the middle of the pass, which
  // must still finish e += g before radix select runs on e.
  std::vector<double> e(n, 0.25);
  std::vector<double> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = (i % 2) ? 0.125 : -0.625;  // |e + g| = 0.375
  gradcomp::topk sel;
  CHECK(gt::check_accumulate(sel, e, g, n / 100).fallback);
}

// Top-k's bracket pass and Gaussian-k's statistics pass run in the widest instruction-set
// clone the CPU offers (detail/host_dispatch.hpp). Every clone must give what the build's own
// target gives, bit for bit: the indices and stats of select(), and of select_accumulate_into()
// also the sums it writes (streamed from 8 MiB on), the energy (whose squares an AVX-512 clone
// could fuse into FMAs) and the non-finite flag. Paths the CPU lacks run the widest it has.
template <class Selector, class T>
void check_isa_paths() {
  namespace d = gradcomp::detail;
  struct restore {
    d::host_isa isa;
    ~restore() { d::limit_host_isa(isa); }
  } guard{d::limit_host_isa(d::host_isa::portable)};
  if (d::detected_host_isa() != d::host_isa::avx512) {
    // Without AVX-512 (the only clone with FMA) the comparison shows less: say so.
    MESSAGE("this CPU's widest path is " << d::host_isa_name(d::detected_host_isa())
                                         << ": the AVX-512 clone is not compared here");
  }
  struct result {
    std::vector<std::uint32_t> plain, fused;
    gradcomp::selection_stats plain_st, fused_st;
    std::vector<T> sums;
  };
  const auto run = [](const std::vector<T>& e, const std::vector<T>& g, std::size_t k) {
    result r;
    Selector sel;
    const gradcomp::select_context ctx{k, 0.0, {}};
    r.plain_st = sel.select(std::span<const T>(g), ctx, r.plain);
    r.sums.assign(g.size(), T(-1));
    r.fused_st = sel.select_accumulate_into(std::span<T>(r.sums), std::span<const T>(e),
                                            std::span<const T>(g), ctx, r.fused);
    return r;
  };
  const auto same_double = [](double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  for (const std::size_t n : {std::size_t{70001}, (std::size_t{1} << 21) + 3}) {
    for (const gt::dist dist : gt::all_dists) {
      if (!gt::sweep_runs(dist, n)) continue;  // fewer at 2^21 in the sanitizer builds
      auto e = gt::make_input<T>(dist, n, 300 + n);
      const auto g = gt::make_input<T>(dist, n, 400 + n);
      if (dist == gt::dist::outliers) e[n / 2] = std::numeric_limits<T>::quiet_NaN();
      for (const std::size_t k : {n / 1000, n / 100}) {
        const std::string dist_name = gt::name(dist);
        CAPTURE(dist_name);
        CAPTURE(n);
        CAPTURE(k);
        d::limit_host_isa(d::host_isa::portable);
        const result ref = run(e, g, k);
        for (const d::host_isa isa : {d::host_isa::baseline, d::host_isa::avx2, d::host_isa::avx512}) {
          d::limit_host_isa(isa);
          const std::string path = d::host_isa_name(d::active_host_isa());
          CAPTURE(path);
          const result got = run(e, g, k);
          CHECK(got.plain == ref.plain);
          gt::check_same_stats(got.plain_st, ref.plain_st);
          CHECK(same_double(got.plain_st.energy, ref.plain_st.energy));
          CHECK(got.fused == ref.fused);
          gt::check_same_stats(got.fused_st, ref.fused_st);
          CHECK(gt::same_bits(got.sums, ref.sums));
          CHECK(same_double(got.fused_st.energy, ref.fused_st.energy));
          CHECK(got.fused_st.nonfinite == ref.fused_st.nonfinite);
        }
      }
    }
  }
}

TEST_CASE("topk: every instruction-set path of the bracket pass gives the same bits") {
  check_isa_paths<gradcomp::topk, float>();
  check_isa_paths<gradcomp::topk, double>();
}

TEST_CASE("gaussiank: every instruction-set path of the statistics pass gives the same bits") {
  check_isa_paths<gradcomp::gaussiank, float>();
  check_isa_paths<gradcomp::gaussiank, double>();
}

TEST_CASE("topk select_accumulate: argument errors leave e unchanged") {
  gradcomp::topk sel;
  std::vector<float> e(100, 1.0f);
  const std::vector<float> g(99, 1.0f);
  std::vector<std::uint32_t> out;
  CHECK_THROWS_AS(sel.select_accumulate(std::span<float>(e), std::span<const float>(g),
                                        gradcomp::select_context{1, 0.0, {}}, out),
                  gradcomp::invalid_argument);
  const std::vector<float> g100(100, 1.0f);
  CHECK_THROWS_AS(sel.select_accumulate(std::span<float>(e), std::span<const float>(g100),
                                        gradcomp::select_context{101, 0.0, {}}, out),
                  gradcomp::invalid_argument);
  CHECK(e == std::vector<float>(100, 1.0f));
}

TEST_CASE("gaussiank select_accumulate: every path equals select on e + g") {
  gt::accumulate_paths<gradcomp::gaussiank, float>(gradcomp::gaussiank{});
  gt::accumulate_paths<gradcomp::gaussiank, double>(gradcomp::gaussiank{});
  gt::accumulate_paths<gradcomp::gaussiank, float>(gradcomp::gaussiank{.cap_at_k = true});
}

TEST_CASE("gaussiank: the sampled one-read path selects what the two-pass form selects") {
  // predict_sample = 0 is the plain form: statistics, then counting passes. The sampled form
  // must agree on every input, whichever way it goes: list hit (normal), upward corrections
  // counted on the list (heavy tails), a downward correction or a missed prediction (a pass).
  const std::size_t n = std::size_t{1} << 18;
  for (gt::dist d : gt::all_dists) {
    for (double density : {0.0001, 0.001, 0.01, 0.1}) {
      for (int form = 0; form < 4; ++form) {
        const bool cap = (form & 1) != 0;
        const bool band = (form & 2) == 0;  // the default form, and the published one
        const auto g = gt::make_input<float>(d, n, 17);
        const std::size_t k = gradcomp::k_for_density(n, density);
        const std::string dist_name = gt::name(d);
        CAPTURE(dist_name);
        CAPTURE(density);
        CAPTURE(cap);
        CAPTURE(band);
        gradcomp::gaussiank plain{.until_in_band = band, .cap_at_k = cap, .predict_sample = 0};
        gradcomp::gaussiank sampled{.until_in_band = band, .cap_at_k = cap};
        gradcomp::gaussiank too_high{
            .until_in_band = band, .cap_at_k = cap, .collect_margin = -1.0};  // list unusable
        gt::check_same_selection(plain, sampled, g, k);
        gt::check_same_selection(plain, too_high, g, k);
      }
    }
  }
}

TEST_CASE("gaussiank: a sample that misleads overflows the list and falls back to a pass") {
  // Small values on the sample's grid, large ones elsewhere: the sample predicts a low
  // threshold, far more values than the list's room lie above it, and the true statistics
  // put the threshold well above. The result must not depend on any of that.
  const std::size_t n = std::size_t{1} << 18;
  gradcomp::gaussiank sampled;
  const std::size_t s = std::min(sampled.predict_sample, n / 64);  // as gaussiank::predict
  auto g = gt::make_input<float>(gt::dist::normal, n, 23);
  std::vector<char> on_grid(n, 0);
  for (std::size_t j = 0; j < s; ++j) on_grid[j * n / s] = 1;
  for (std::size_t i = 0; i < n; ++i) {
    if (!on_grid[i]) g[i] *= 10.0f;
  }
  gradcomp::gaussiank plain{.predict_sample = 0};
  gradcomp::gaussiank published_plain{.until_in_band = false, .predict_sample = 0};
  auto published = gradcomp::gaussiank::published();
  for (std::size_t k : {n / 1000, n / 100}) {
    CAPTURE(k);
    gt::check_same_selection(plain, sampled, g, k);
    gt::check_same_selection(published_plain, published, g, k);
  }
}

TEST_CASE("first_nonfinite: the first NaN or Inf wherever it is, float and double") {
  using gradcomp::detail::first_nonfinite;
  for (std::size_t n : {0, 1, 31, 32, 33, 64, 1000, 4099}) {
    std::vector<float> f(n, 1.5f);
    std::vector<double> d(n, -2.5);
    CHECK(first_nonfinite(std::span<const float>(f)) == n);
    CHECK(first_nonfinite(std::span<const double>(d)) == n);
    for (std::size_t pos : {std::size_t{0}, std::size_t{31}, std::size_t{32}, n / 2, n - 1}) {
      if (pos >= n) continue;
      for (int kind = 0; kind < 3; ++kind) {
        CAPTURE(n);
        CAPTURE(pos);
        CAPTURE(kind);
        auto f2 = f;
        auto d2 = d;
        const double bad = kind == 0   ? std::numeric_limits<double>::quiet_NaN()
                           : kind == 1 ? std::numeric_limits<double>::infinity()
                                       : -std::numeric_limits<double>::infinity();
        f2[pos] = static_cast<float>(bad);
        d2[pos] = bad;
        if (pos + 1 < n) {  // a later one must not win
          f2[n - 1] = std::numeric_limits<float>::quiet_NaN();
          d2[n - 1] = std::numeric_limits<double>::infinity();
        }
        CHECK(first_nonfinite(std::span<const float>(f2)) == pos);
        CHECK(first_nonfinite(std::span<const double>(d2)) == pos);
      }
    }
  }
  // The largest finite values are finite.
  std::vector<float> big(100, std::numeric_limits<float>::max());
  big[7] = -std::numeric_limits<float>::max();
  CHECK(first_nonfinite(std::span<const float>(big)) == big.size());
}

TEST_CASE("compressor: the fused residual step equals accumulate-then-select, bit for bit") {
  gt::check_fused_step<gradcomp::topk, gradcomp::identity, float>(gradcomp::identity{});
  gt::check_fused_step<gradcomp::topk, gradcomp::identity, double>(gradcomp::identity{});
  gt::check_fused_step<gradcomp::topk, gradcomp::qsgd, float>(gradcomp::qsgd::with_bits(4));
  gt::check_fused_step<gradcomp::gaussiank, gradcomp::identity, float>(gradcomp::identity{});
}
