// compressor<>: argument checks that leave the feedback state untouched, the non-finite
// policy, decompression, and the top-k contraction it reports.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
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

// A few steps of compressor C from a zero state: after each, the contraction it reports
// against the reference on the vector it selected from, acc (e + g for residual feedback, DGC
// momentum's v, g itself without feedback), made here by the feedback's own accumulate() on a
// copy of the state.
template <class C>
std::vector<double> check_contraction(C c, const std::vector<float>& g0, double density,
                                      bool measured, bool nan_on_fallback = false) {
  const std::size_t n = g0.size();
  auto st = c.make_state(n);
  std::vector<double> seen;
  payload p;
  for (std::uint64_t step = 0; step < 3; ++step) {
    std::vector<float> g = g0;
    for (std::size_t i = 0; i < n; ++i) g[i] *= static_cast<float>(1 + step);
    auto copy = st;
    const auto acc_span = c.feedback().accumulate(copy, std::span<const float>(g));
    const std::vector<float> acc(acc_span.begin(), acc_span.end());
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
  }
  return seen;
}

}  // namespace

TEST_CASE("compressor: the top-k contraction against a reference, every selector") {
  namespace gt = gradcomp_test;
  for (gt::dist d : gt::all_dists) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000},
                          std::size_t{4099}, (std::size_t{1} << 20) + 3}) {
      if (!gt::sweep_runs(d, n)) continue;
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
      // Without feedback from the check of g for NaN and Inf; with DGC momentum from its
      // accumulation of v.
      check_contraction(compressor<topk, identity, no_feedback>{}, g, density, true);
      check_contraction(compressor<randomk, identity, no_feedback>{}, g, density, true);
      check_contraction(compressor<dgc_sampling, identity, no_feedback>{}, g, density, true);
      check_contraction(compressor<topk, identity, dgc_momentum>{}, g, density, true);
      check_contraction(compressor<redsync, identity, dgc_momentum>{}, g, density, true);
      // No pass that reads g without feedback when nothing checks it: not measured.
      check_contraction(compressor<topk, identity, no_feedback>(topk{}, identity{}, no_feedback{},
                                                                nonfinite_policy::propagate),
                        g, density, false);
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
    // The last size is beyond detail::stream_min_bytes: `out`, a second buffer, is streamed.
    for (std::size_t n : {std::size_t{1}, std::size_t{100}, std::size_t{2048},
                          std::size_t{2049}, std::size_t{50000}, (std::size_t{1} << 20) + 3,
                          (std::size_t{1} << 21) + 5}) {
      if (!gt::sweep_runs(d, n)) continue;
      const auto e0 = gt::make_input<float>(d, n, 21);
      const auto g = gt::make_input<float>(gt::dist::normal, n, 22);
      long double ref = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float x = e0[i] + g[i];
        ref += static_cast<long double>(x) * x;
      }
      // Working copies for the NaN/Inf cases below, each restored after its case.
      std::vector<float> e2 = e0;
      std::vector<float> g2 = g;
      std::size_t k_turn = 0;
      for (std::size_t k : {std::size_t{0}, std::size_t{1}, std::size_t{10}, n / 100 + 1,
                            n / 3, n}) {
        ++k_turn;
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
          CHECK_FALSE(st.nonfinite);
          bool sums = true;
          for (std::size_t i = 0; i < n; ++i) sums = sums && out[i] == e0[i] + g[i];
          CHECK(sums);
          // A NaN or Inf in g, or e + g overflowing, is reported on every path, wherever it is:
          // each path gets the three positions, each with one of the three kinds, turned by k
          // and the method so that each path sees every kind and every (position, kind) pair
          // comes up at each size (all nine on each path cost most of this test's time under
          // the sanitizers, at 2^21 elements).
          for (std::size_t a = 0; a < 3; ++a) {
            const std::size_t at = a == 0 ? 0 : a == 1 ? n / 2 : n - 1;
            const std::size_t kind = (a + k_turn + (method == topk_method::radix ? 1 : 0)) % 3;
            CAPTURE(at);
            CAPTURE(kind);
            const float e_at = e2[at];
            const float g_at = g2[at];
            if (kind == 0) g2[at] = NAN;
            if (kind == 1) g2[at] = -INFINITY;
            if (kind == 2) {
              e2[at] = 3e38f;
              g2[at] = 3e38f;
            }
            const auto bad = sel.select_accumulate_into(
                std::span<float>(out), std::span<const float>(e2), std::span<const float>(g2),
                select_context{k, 0.0, {}}, idx);
            CHECK(bad.nonfinite);
            e2[at] = e_at;
            g2[at] = g_at;
          }
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("sum_range: e + g bit for bit with plain and streaming stores, the squares' "
                   "sum, and the NaN/Inf flag", T, float, double) {
  using gradcomp::detail::sum_range;
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{1023},
                        std::size_t{1024}, std::size_t{1025}, std::size_t{100003}}) {
    CAPTURE(n);
    auto e = gradcomp_test::make_input<T>(gradcomp_test::dist::laplace, n, 4);
    auto g = gradcomp_test::make_input<T>(gradcomp_test::dist::student_t2, n, 5);
    std::vector<T> ref(n), a(n), b(n + 2), c(n);
    for (std::size_t i = 0; i < n; ++i) ref[i] = e[i] + g[i];
    // b's data is 16-byte aligned (operator new), as streaming needs.
    CHECK_FALSE(sum_range<T, false>(a.data(), e.data(), g.data(), n, nullptr));
    double energy = 0.25;  // adds to what is there
    CHECK_FALSE(sum_range<T, true, true>(b.data(), e.data(), g.data(), n, &energy));
    CHECK(a == ref);
    CHECK(std::equal(ref.begin(), ref.end(), b.begin()));
    long double want = 0.25L;
    for (const T x : ref) want += static_cast<long double>(x) * x;
    CHECK(energy == doctest::Approx(static_cast<double>(want)).epsilon(1e-6));
    if (n == 0) continue;
    // A NaN, an Inf, or a sum that overflows is flagged, wherever it is.
    for (const std::size_t at : {std::size_t{0}, n / 2, n - 1}) {
      for (int kind = 0; kind < 3; ++kind) {
        CAPTURE(at);
        CAPTURE(kind);
        auto e2 = e;
        auto g2 = g;
        if (kind == 0) g2[at] = std::numeric_limits<T>::quiet_NaN();
        if (kind == 1) g2[at] = -std::numeric_limits<T>::infinity();
        if (kind == 2) e2[at] = g2[at] = std::numeric_limits<T>::max();
        CHECK(sum_range<T, false>(c.data(), e2.data(), g2.data(), n, nullptr));
        double en = 0.0;
        CHECK(sum_range<T, true, true>(b.data(), e2.data(), g2.data(), n, &en));
      }
    }
  }
}

namespace {

// Runs `steps` staged compress() calls, `from` -> `to` with the two swapped after each, next to
// the same calls in place, and checks that both give the same payload bytes and states, and
// that a staged call never writes `from`.
template <class C>
void check_staged_matches_in_place(C proto, std::size_t n, gradcomp_test::dist d, double density) {
  using T = typename C::value_type;
  C a = proto, b = proto;
  auto in_place = a.make_state(n);
  auto from = b.make_state(n);
  auto to = b.make_state(n);
  payload pa, pb;
  for (std::uint64_t step = 0; step < 3; ++step) {
    CAPTURE(step);
    const auto g = gradcomp_test::make_input<T>(d, n, 40 + step);
    const compress_context ctx{density, call_id{3, step, 1}};
    a.compress(g, in_place, ctx, pa);
    const auto from_before = from.e;
    b.compress(g, std::as_const(from), to, ctx, pb);
    CHECK(from.e == from_before);
    CHECK(to.e == in_place.e);
    CHECK(pb.indices == pa.indices);
    CHECK(pb.values == pa.values);
    CHECK(pb.side == pa.side);
    CHECK(pb.count == pa.count);
    std::swap(from, to);
  }
}

}  // namespace

TEST_CASE("compressor: a staged step gives the in-place step's payload and state, bit for bit") {
  // Staged, residual feedback's accumulation writes the second state with streaming stores
  // beyond detail::stream_min_bytes (the last sizes) and refuses NaN in its own pass instead of
  // a read of g before the step: the numbers must not change.
  namespace gt = gradcomp_test;
  for (const gt::dist d : {gt::dist::normal, gt::dist::laplace, gt::dist::student_t2}) {
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{97}, std::size_t{4099},
                                (std::size_t{1} << 21) + 37}) {
      if (!gt::sweep_runs(d, n)) continue;
      const std::string dist_name = gt::name(d);
      CAPTURE(dist_name);
      CAPTURE(n);
      check_staged_matches_in_place(compressor<topk, identity, residual>{}, n, d, 0.001);
      check_staged_matches_in_place(compressor<topk, qsgd, residual>{}, n, d, 0.01);
      check_staged_matches_in_place(compressor<gaussiank, identity, residual>{}, n, d, 0.001);
      check_staged_matches_in_place(compressor<randomk, fp16, residual>{}, n, d, 0.01);
      check_staged_matches_in_place(compressor<dense, identity, residual>{}, n, d, 1.0);
      check_staged_matches_in_place(compressor<topk, identity, residual, double>{}, n, d, 0.01);
    }
  }
}

TEST_CASE_TEMPLATE("compressor: a staged step refuses NaN, Inf and an overflowing e + g in its own "
                   "pass, leaving from and out as they were",
                   C, compressor<topk, identity, residual>, compressor<gaussiank, qsgd, residual>,
                   compressor<randomk, identity, residual>, compressor<dgc_sampling, fp16, residual>,
                   compressor<topk, identity, dgc_momentum>, compressor<redsync, identity, no_feedback>) {
  for (const std::size_t n : {std::size_t{1}, std::size_t{97}, std::size_t{4099},
                              (std::size_t{1} << 21) + 37}) {
    C c;
    auto from = c.make_state(n);
    auto to = c.make_state(n);
    payload p;
    const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::laplace, n, 5);
    c.compress(g, std::as_const(from), to, {0.01, call_id{1, 0, 6}}, p);
    std::swap(from, to);
    const auto from_before = from.buffers().empty() ? std::vector<float>{}
                                                    : std::vector<float>(from.buffers()[0].begin(),
                                                                         from.buffers()[0].end());
    const payload p_before = p;
    auto unchanged = [&] {
      if (!from.buffers().empty()) {
        CHECK(std::equal(from_before.begin(), from_before.end(), from.buffers()[0].begin()));
      }
      CHECK(p.indices == p_before.indices);
      CHECK(p.values == p_before.values);
      CHECK(p.count == p_before.count);
    };
    for (const std::size_t at : {std::size_t{0}, n / 2, n - 1}) {
      for (const float bad : {NAN, INFINITY, -INFINITY}) {
        CAPTURE(n);
        CAPTURE(at);
        CAPTURE(bad);
        auto g2 = g;
        g2[at] = bad;
        try {
          c.compress(g2, std::as_const(from), to, {0.01, call_id{1, 1, 6}}, p);
          FAIL("no exception");
        } catch (const nonfinite_error& e) {
          const std::string what = e.what();
          CHECK(what.find("tensor 6") != std::string::npos);
          CHECK(what.find(detail::concat("index ", at)) != std::string::npos);
        }
        unchanged();
      }
    }
    // e + g of two finite values that overflows: residual feedback's pass finds it too; so does
    // DGC's sum of squares ||v||^2, for v + (m u + g). (The accumulated vector is the state's
    // last buffer: e, or v after u.)
    if constexpr (!std::is_same_v<typename C::feedback_type, no_feedback>) {
      from.buffers().back()[n / 2] = 3e38f;
      auto g2 = g;
      g2[n / 2] = 3e38f;
      auto state_before = from;
      try {
        c.compress(g2, std::as_const(from), to, {0.01, call_id{1, 1, 6}}, p);
        FAIL("no exception");
      } catch (const nonfinite_error& e) {
        CHECK(std::string(e.what()).find(detail::concat("overflowed to inf at index ", n / 2)) !=
              std::string::npos);
      }
      for (std::size_t b = 0; b < from.buffers().size(); ++b) {
        const auto now = from.buffers()[b], was = state_before.buffers()[b];
        CHECK(std::equal(now.begin(), now.end(), was.begin(), was.end()));
      }
      CHECK(p.indices == p_before.indices);
      // In place it is refused as well, once the pass has found it (the state then holds it).
      auto st = from;
      CHECK_THROWS_AS(c.compress(g2, st, {0.01, call_id{1, 1, 6}}, p), nonfinite_error);
    }
  }
}

TEST_CASE("compressor: a staged step with nonfinite_policy::propagate sends NaN, as in place") {
  compressor<topk, identity, residual> c(topk{}, identity{}, residual{}, nonfinite_policy::propagate);
  const std::size_t n = (std::size_t{1} << 21) + 37;
  auto from = c.make_state(n);
  auto to = c.make_state(n);
  auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, n, 8);
  g[12345] = NAN;
  payload p;
  c.compress(g, std::as_const(from), to, {1e-5, call_id{}}, p);
  REQUIRE(p.count >= 1);
  CHECK(p.indices.front() <= 12345);
  CHECK(std::find(p.indices.begin(), p.indices.end(), 12345u) != p.indices.end());
}

namespace {

// Fuses e += g into its pass like topk, but does not declare flags_nonfinite and never reports
// a NaN: compressor<> must read g first in a staged step, as before selectors could flag them.
struct quiet_topk {
  topk inner;
  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& ctx,
                         std::vector<std::uint32_t>& idx) {
    return inner.select(g, ctx, idx);
  }
  template <gradient_value T>
  selection_stats select_accumulate_into(std::span<T> out, std::span<const T> e,
                                         std::span<const T> g, const select_context& ctx,
                                         std::vector<std::uint32_t>& idx) {
    selection_stats st = inner.select_accumulate_into(out, e, g, ctx, idx);
    st.nonfinite = false;
    return st;
  }
};

}  // namespace

TEST_CASE("compressor: a fused selector that does not flag NaN gets the check before the step") {
  using C = compressor<quiet_topk, identity, residual>;
  static_assert(!C::checks_in_pass);
  static_assert(compressor<topk, identity, residual>::checks_in_pass);
  C c;
  const std::size_t n = 4099;
  auto from = c.make_state(n);
  auto to = c.make_state(n);
  auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, n, 3);
  payload p;
  c.compress(g, std::as_const(from), to, {0.01, call_id{}}, p);
  std::swap(from, to);
  const auto before = from.e;
  g[77] = NAN;
  CHECK_THROWS_AS(c.compress(g, std::as_const(from), to, {0.01, call_id{}}, p), nonfinite_error);
  CHECK(from.e == before);
}
