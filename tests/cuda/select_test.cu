// Device selectors (gradcomp/cuda/select.cuh) against the host ones: topk gives the host's
// index set, threshold and fallback flag over the size/distribution matrix (bracket hit, forced
// miss, forced radix, k = 0, k = n, NaN); gaussiank's threshold agrees within float tolerance
// and its selection is exactly the set its threshold defines (the default form: that set in
// the band, or the exact top-k); threshold equals the host's; randomk draws the host's indices
// and adds e + g bit for bit. A captured graph, replayed, gives the same result each time.
// Bad input throws before anything is written. Skipped (exit 77) without a CUDA device.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/select.cuh>
#include <gradcomp/detail/radix_digits.hpp>
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/randomk.hpp>
#include <gradcomp/select/threshold.hpp>
#include <gradcomp/select/topk.hpp>

#include "../support/cuda_buffers.hpp"
#include "../support/data.hpp"

using gradcomp_test::dist;
namespace gd = gradcomp::detail;

namespace {

void check_cuda(cudaError_t rc) { REQUIRE_MESSAGE(rc == cudaSuccess, cudaGetErrorString(rc)); }

using gradcomp_test::download;
using gradcomp_test::upload;

struct device_result {
  std::vector<std::uint32_t> indices;
  gradcomp::selection_stats stats;
};

// Size query, allocation, the call, then indices[0, min(count, capacity)) and the stats.
template <class Call>
device_result run_device(std::size_t capacity, Call call) {
  gradcomp::device_buffer<std::uint32_t> idx(std::max<std::size_t>(capacity, 1));
  gradcomp::device_buffer<gradcomp::selection_stats> st(1);
  gradcomp::temp_storage tmp;
  call(tmp, gradcomp::device_span<std::uint32_t>{idx.data(), capacity}, st.data());
  gradcomp::device_buffer<char> scratch(tmp.bytes);
  tmp.ptr = scratch.data();
  call(tmp, gradcomp::device_span<std::uint32_t>{idx.data(), capacity}, st.data());
  check_cuda(cudaDeviceSynchronize());
  device_result r;
  r.stats = download(st.data(), 1)[0];
  r.indices = download(idx.data(), std::min<std::size_t>(r.stats.count, capacity));
  return r;
}

template <class T>
bool same_key(double a, double b) {
  return gd::abs_key(static_cast<T>(a)) == gd::abs_key(static_cast<T>(b));
}

template <class T>
void compare_topk(gradcomp::topk sel, const std::vector<T>& g, std::size_t k) {
  CAPTURE(g.size());
  CAPTURE(k);
  std::vector<std::uint32_t> host;
  const auto hs = sel.select(std::span<const T>(g), gradcomp::select_context{k, 0.0, {}}, host);
  auto dg = upload(g);
  const auto dev =
      run_device(k, [&](gradcomp::temp_storage& tmp, gradcomp::device_span<std::uint32_t> idx,
                        gradcomp::selection_stats* st) {
        gradcomp::on_device(sel).select(tmp, gradcomp::device_span<const T>{dg.data(), g.size()},
                                        gradcomp::select_context{k, 0.0, {}}, idx, st);
      });
  CHECK(dev.stats.count == hs.count);
  CHECK(dev.indices == host);
  CHECK(same_key<T>(dev.stats.threshold, hs.threshold));
  CHECK(dev.stats.fallback == hs.fallback);
  CHECK(dev.stats.iterations == hs.iterations);

  // select_accumulate: the selection of e + g and e = e + g, bit for bit.
  std::vector<T> e(g.size());
  for (std::size_t i = 0; i < e.size(); ++i) e[i] = static_cast<T>((i % 5 == 0) ? 0.5 : -0.125);
  std::vector<T> he = e;
  std::vector<std::uint32_t> hacc;
  const auto has = sel.select_accumulate(std::span<T>(he), std::span<const T>(g),
                                         gradcomp::select_context{k, 0.0, {}}, hacc);
  auto de = upload(e);
  const auto dacc =
      run_device(k, [&](gradcomp::temp_storage& tmp, gradcomp::device_span<std::uint32_t> idx,
                        gradcomp::selection_stats* st) {
        // The size query does not touch e; the real call adds g once.
        gradcomp::on_device(sel).select_accumulate(
            tmp, gradcomp::device_span<T>{de.data(), g.size()},
            gradcomp::device_span<const T>{dg.data(), g.size()},
            gradcomp::select_context{k, 0.0, {}}, idx, st);
      });
  CHECK(dacc.indices == hacc);
  CHECK(dacc.stats.fallback == has.fallback);
  // Bit for bit, except that a NaN sum only has to be NaN on both: the device's float add
  // returns the canonical NaN, the host's passes on g's payload and sign (seen on an H200).
  const auto de_host = download(de.data(), g.size());
  CHECK(std::equal(de_host.begin(), de_host.end(), he.begin(), [](T a, T b) {
    if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
    return gd::abs_key(a) == gd::abs_key(b) && std::signbit(a) == std::signbit(b);
  }));
}

const std::size_t sizes[] = {1, 2, 33, 1000, 2049, 4097, 100003, (std::size_t{1} << 20) + 3};

}  // namespace

TEST_CASE_TEMPLATE("device topk equals host topk over sizes, distributions and k", T, float,
                   double) {
  for (dist d : gradcomp_test::all_dists) {
    CAPTURE(gradcomp_test::name(d));
    for (std::size_t n : sizes) {
      if (std::is_same_v<T, double> && n > 200000 && d != dist::normal) continue;
      const auto g = gradcomp_test::make_input<T>(d, n, 21);
      for (std::size_t k : {std::size_t{0}, std::size_t{1}, std::size_t{64}, std::size_t{65},
                            n / 1000 + 1, n / 100 + 1, n / 2, n - 1, n}) {
        if (k > n) continue;
        compare_topk(gradcomp::topk{}, g, k);
      }
    }
  }
}

TEST_CASE("device topk: bracket hit, forced miss, forced radix, NaN") {
  const std::size_t n = std::size_t{1} << 21;
  auto g = gradcomp_test::make_input<float>(dist::normal, n, 5);
  const std::size_t k = n / 1000;
  {
    gradcomp::topk sel;
    std::vector<std::uint32_t> h;
    REQUIRE_FALSE(
        sel.select(std::span<const float>(g), gradcomp::select_context{k, 0.0, {}}, h).fallback);
    compare_topk(sel, g, k);  // the bracket holds on both
  }
  {
    gradcomp::topk sel;  // a bracket of width 0 and no candidate room: the host misses
    sel.bracket_sigmas = 0.0;
    sel.bracket_margin = 0;
    sel.candidate_budget_factor = 1e-9;
    sel.min_candidate_budget = 1;
    std::vector<std::uint32_t> h;
    REQUIRE(
        sel.select(std::span<const float>(g), gradcomp::select_context{k, 0.0, {}}, h).fallback);
    compare_topk(sel, g, k);
  }
  {
    gradcomp::topk sel;
    sel.method = gradcomp::topk_method::radix;
    compare_topk(sel, g, k);
    compare_topk(sel, g, std::size_t{1});
    compare_topk(sel, g, n);
  }
  g[17] = std::numeric_limits<float>::quiet_NaN();
  g[n - 1] = -std::numeric_limits<float>::infinity();
  g[n / 2] = std::numeric_limits<float>::infinity();
  compare_topk(gradcomp::topk{}, g, k);
  compare_topk(gradcomp::topk{}, g, std::size_t{2});
  const auto ties = gradcomp_test::make_input<float>(dist::ties, n, 6);
  compare_topk(gradcomp::topk{}, ties, k);
  compare_topk(gradcomp::topk{}, ties, n / 3);
}

// The finish's two less common branches, on inputs built so that the host's bracket holds:
// ties at the k-th key among the candidates (the second radix select, over the complemented
// indices, picks the lowest of them), and exactly k sure elements (no candidate needed: kth is
// the smallest sure key).
TEST_CASE("device topk: the finish with ties at the k-th and with exactly k sure") {
  const std::size_t n = std::size_t{1} << 20;
  auto q = gradcomp_test::make_input<float>(dist::normal, n, 9);
  for (auto& x : q) x = std::round(x * 64.0f) / 64.0f;  // few distinct values: ties everywhere
  for (std::size_t k : {n / 1000, n / 100}) {
    CAPTURE(k);
    gradcomp::topk sel;
    std::vector<std::uint32_t> h;
    const auto hs = sel.select(std::span<const float>(q), gradcomp::select_context{k, 0.0, {}}, h);
    REQUIRE_FALSE(hs.fallback);
    const auto kth = gd::abs_key(static_cast<float>(hs.threshold));
    std::size_t above = 0;
    std::size_t equal = 0;
    for (const float x : q) {
      above += gd::abs_key(x) > kth;
      equal += gd::abs_key(x) == kth;
    }
    REQUIRE(equal > k - above);  // only some of the ties are taken
    compare_topk(sel, q, k);
  }

  // Every sampled position holds 1, k other positions hold -10, the rest 0: lo = hi = 1, the
  // -10s are exactly the k sure elements and the 1s the candidates.
  const std::size_t k = n / 20;
  gradcomp::topk sel;
  const auto plan = sel.bracket_plan(n, k);
  REQUIRE(plan.hi != gd::bracket_hi::largest_key);
  std::vector<float> g(n, 0.0f);
  for (std::size_t j = 0; j < plan.s; ++j) g[gd::strided_position(j, n, plan.s)] = 1.0f;
  std::size_t placed = 0;
  for (std::size_t i = 0; i < n && placed < k; ++i) {
    if (g[i] == 0.0f && i % 19 == 3) {
      g[i] = -10.0f;
      ++placed;
    }
  }
  REQUIRE(placed == k);
  std::vector<std::uint32_t> h;
  const auto hs = sel.select(std::span<const float>(g), gradcomp::select_context{k, 0.0, {}}, h);
  REQUIRE_FALSE(hs.fallback);
  REQUIRE(hs.threshold == 10.0);
  compare_topk(sel, g, k);
}

// A training step under CUDA graphs captures the selection once and replays it: every piece of
// the pipeline's state (the selection state, the list selects' states and histograms) must be
// reset inside the captured work. Each replay, after the outputs were poisoned, gives the
// host's index set and stats again, on normal input and on input with ties at the k-th.
TEST_CASE("device topk: a captured graph replayed gives the host's result every time") {
  const std::size_t n = (std::size_t{1} << 20) + 3;
  auto normal = gradcomp_test::make_input<float>(dist::normal, n, 31);
  auto ties = normal;
  for (auto& x : ties) x = std::round(x * 64.0f) / 64.0f;
  for (const auto* g : {&normal, &ties}) {
    for (const std::size_t k : {n / 1000 + 1, n / 100 + 1}) {
      CAPTURE(k);
      gradcomp::topk sel;
      std::vector<std::uint32_t> host;
      const auto hs = sel.select(std::span<const float>(*g), gradcomp::select_context{k, 0.0, {}}, host);
      auto dg = upload(*g);
      gradcomp::device_buffer<std::uint32_t> idx(k);
      gradcomp::device_buffer<gradcomp::selection_stats> st(1);
      const gradcomp::device_span<const float> gs{dg.data(), n};
      const gradcomp::select_context ctx{k, 0.0, {}};
      gradcomp::temp_storage tmp;
      gradcomp::on_device(sel).select(tmp, gs, ctx, idx.span(), st.data());
      gradcomp::device_buffer<char> scratch(tmp.bytes);
      tmp.ptr = scratch.data();
      cudaStream_t stream = nullptr;
      check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      gradcomp::on_device(sel).select(tmp, gs, ctx, idx.span(), st.data(), stream);
      check_cuda(cudaStreamEndCapture(stream, &graph));
      check_cuda(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 3; ++replay) {
        CAPTURE(replay);
        check_cuda(cudaMemset(idx.data(), 0xff, k * sizeof(std::uint32_t)));
        check_cuda(cudaMemset(st.data(), 0xff, sizeof(gradcomp::selection_stats)));
        check_cuda(cudaDeviceSynchronize());
        check_cuda(cudaGraphLaunch(exec, stream));
        check_cuda(cudaStreamSynchronize(stream));
        const auto stats = download(st.data(), 1)[0];
        CHECK(stats.count == hs.count);
        CHECK(stats.fallback == hs.fallback);
        CHECK(same_key<float>(stats.threshold, hs.threshold));
        CHECK(download(idx.data(), k) == host);
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(stream);
    }
  }
}

TEST_CASE("device topk: bad input throws before anything is written") {
  std::vector<float> g(100, 1.0f);
  auto dg = upload(g);
  gradcomp::device_buffer<std::uint32_t> idx(10);
  const std::vector<std::uint32_t> pattern(10, 0xdeadbeefu);
  check_cuda(cudaMemcpy(idx.data(), pattern.data(), 40, cudaMemcpyHostToDevice));
  gradcomp::device_buffer<gradcomp::selection_stats> st(1);
  gradcomp::topk sel;
  gradcomp::temp_storage tmp;
  const gradcomp::device_span<const float> dgs{dg.data(), 100};
  CHECK_THROWS_AS(gradcomp::on_device(sel).select(
                      tmp, dgs, gradcomp::select_context{101, 0.0, {}},
                      gradcomp::device_span<std::uint32_t>{idx.data(), 10}, st.data()),
                  gradcomp::invalid_argument);
  CHECK_THROWS_AS(gradcomp::on_device(sel).select(
                      tmp, dgs, gradcomp::select_context{11, 0.0, {}},
                      gradcomp::device_span<std::uint32_t>{idx.data(), 10}, st.data()),
                  gradcomp::invalid_argument);
  CHECK_THROWS_AS(gradcomp::on_device(sel).select(
                      tmp, dgs, gradcomp::select_context{5, 0.0, {}},
                      gradcomp::device_span<std::uint32_t>{idx.data(), 10}, nullptr),
                  gradcomp::invalid_argument);
  gradcomp::device_buffer<float> e(99);
  CHECK_THROWS_AS(gradcomp::on_device(sel).select_accumulate(
                      tmp, gradcomp::device_span<float>{e.data(), 99}, dgs,
                      gradcomp::select_context{5, 0.0, {}},
                      gradcomp::device_span<std::uint32_t>{idx.data(), 10}, st.data()),
                  gradcomp::invalid_argument);
  gradcomp::topk bad;
  bad.sample_scale = -1.0;
  CHECK_THROWS_AS(gradcomp::on_device(bad).select(
                      tmp, dgs, gradcomp::select_context{5, 0.0, {}},
                      gradcomp::device_span<std::uint32_t>{idx.data(), 10}, st.data()),
                  gradcomp::invalid_argument);
  // Too little scratch.
  gradcomp::on_device(sel).select(tmp, dgs, gradcomp::select_context{5, 0.0, {}},
                                  gradcomp::device_span<std::uint32_t>{idx.data(), 10}, st.data());
  gradcomp::device_buffer<char> small(tmp.bytes);
  gradcomp::temp_storage short_tmp{small.data(), tmp.bytes / 2};
  CHECK_THROWS_AS(gradcomp::on_device(sel).select(
                      short_tmp, dgs, gradcomp::select_context{5, 0.0, {}},
                      gradcomp::device_span<std::uint32_t>{idx.data(), 10}, st.data()),
                  gradcomp::invalid_argument);
  check_cuda(cudaDeviceSynchronize());
  CHECK(download(idx.data(), 10) == pattern);
}

// ---------------------------------------------------------------------------------------
// Gaussian-k and threshold.

// How often the default form's host and device runs ended differently (one in the exact
// top-k, the other with a threshold set in the band): float-tolerance differences in the
// statistics may move a count across the band's edge now and then, a device that decides
// otherwise than the host moves it in most cases.
struct finish_tally {
  int cases = 0;
  int differ = 0;
};

template <class T>
void compare_gaussiank(gradcomp::gaussiank sel, const std::vector<T>& g, std::size_t k,
                       finish_tally* tally = nullptr) {
  CAPTURE(g.size());
  CAPTURE(k);
  const std::size_t n = g.size();
  std::vector<std::uint32_t> host;
  const auto hs = sel.select(std::span<const T>(g), gradcomp::select_context{k, 0.0, {}}, host);
  auto dg = upload(g);
  const auto dev =
      run_device(n, [&](gradcomp::temp_storage& tmp, gradcomp::device_span<std::uint32_t> idx,
                        gradcomp::selection_stats* st) {
        gradcomp::on_device(sel).select(tmp, gradcomp::device_span<const T>{dg.data(), n},
                                        gradcomp::select_context{k, 0.0, {}}, idx, st);
      });
  CHECK(dev.stats.fallback == hs.fallback);
  if (k == 0) {
    // Nothing is selected (stats.threshold stays 0, which is not a threshold of the set).
    CHECK(host.empty());
    CHECK(dev.stats.count == 0);
    CHECK(dev.indices.empty());
    return;
  }
  std::vector<std::uint32_t> ref;  // the exact top-k
  const double kth =
      gradcomp::topk{}.select(std::span<const T>(g), gradcomp::select_context{k, 0.0, {}}, ref)
          .threshold;
  if (tally && sel.until_in_band && !sel.cap_at_k && !hs.fallback) {
    // The exact finish reports the k-th largest |g| as its threshold; a threshold set in the
    // band reports a threshold from the statistics, which is not a value of g.
    const bool host_exact = hs.count == k && host == ref && hs.threshold == kth;
    const bool dev_exact = dev.stats.count == k && dev.indices == ref && dev.stats.threshold == kth;
    ++tally->cases;
    tally->differ += host_exact != dev_exact;
  }
  if (hs.fallback) {
    CHECK(dev.stats.count == k);
    CHECK(dev.indices == ref);
    return;
  }
  if (sel.cap_at_k || sel.until_in_band) {
    // Either the exact top-k (more than k survived, or the default form ended outside the
    // band) or the threshold's own set, which the default form has in the band.
    if (dev.stats.count == k && dev.indices == ref) return;
    if (sel.cap_at_k) {
      CHECK(dev.stats.count <= k);
    } else {
      CHECK(3 * dev.stats.count >= 2 * k);
      CHECK(3 * dev.stats.count <= 4 * k);
    }
    const auto tc = gd::key_threshold_above<T>(dev.stats.threshold);
    std::vector<std::uint32_t> expect;
    for (std::size_t i = 0; i < n; ++i) {
      if (gd::signed_abs_key(g[i]) > tc) expect.push_back(static_cast<std::uint32_t>(i));
    }
    CHECK(dev.indices == expect);
    return;
  }
  // Thresholds within float tolerance (relative 1e-5 covers the host's float chunk sums).
  const double tol = 1e-5 * std::max(std::fabs(hs.threshold), 1e-30);
  CHECK(std::fabs(dev.stats.threshold - hs.threshold) <= tol);
  // The device selection is exactly the set its own threshold defines, ascending.
  const auto t = gd::key_threshold_above<T>(dev.stats.threshold);
  std::vector<std::uint32_t> expect;
  for (std::size_t i = 0; i < n; ++i) {
    if (gd::signed_abs_key(g[i]) > t) expect.push_back(static_cast<std::uint32_t>(i));
  }
  CHECK(dev.indices == expect);
  CHECK(dev.stats.count == expect.size());
  // Counts differ from the host's only by the values between the two thresholds.
  if (dev.stats.iterations == hs.iterations) {
    const auto th = gd::key_threshold_above<T>(hs.threshold);
    const auto a = std::min(t, th);
    const auto b = std::max(t, th);
    std::size_t between = 0;
    for (const T x : g) between += gd::signed_abs_key(x) > a && gd::signed_abs_key(x) <= b;
    const auto diff =
        dev.stats.count > hs.count ? dev.stats.count - hs.count : hs.count - dev.stats.count;
    CHECK(diff <= between);
  }
}

TEST_CASE_TEMPLATE("device gaussiank agrees with host gaussiank", T, float, double) {
  finish_tally tally;
  for (dist d : gradcomp_test::all_dists) {
    CAPTURE(gradcomp_test::name(d));
    for (std::size_t n : sizes) {
      if (std::is_same_v<T, double> && n > 200000) continue;
      const auto g = gradcomp_test::make_input<T>(d, n, 31);
      for (std::size_t k : {std::size_t{0}, std::size_t{1}, n / 1000 + 1, n / 100 + 1, n / 3, n}) {
        if (k > n) continue;
        compare_gaussiank(gradcomp::gaussiank{}, g, k, &tally);
        compare_gaussiank(gradcomp::gaussiank::published(), g, k);
        gradcomp::gaussiank capped;
        capped.cap_at_k = true;
        compare_gaussiank(capped, g, k);
      }
    }
  }
  CAPTURE(tally.cases);
  CHECK(tally.cases > 0);
  CHECK(4 * tally.differ <= tally.cases);
}

TEST_CASE("device gaussiank: NaN falls back to the exact top-k") {
  auto g = gradcomp_test::make_input<float>(dist::normal, 300000, 8);
  g[1234] = std::numeric_limits<float>::quiet_NaN();
  compare_gaussiank(gradcomp::gaussiank{}, g, 300);
}

TEST_CASE_TEMPLATE("device threshold equals host threshold", T, float, double) {
  for (dist d : {dist::normal, dist::zeros90, dist::ties, dist::all_equal}) {
    for (std::size_t n :
         {std::size_t{0}, std::size_t{1}, std::size_t{4097}, (std::size_t{1} << 20) + 3}) {
      auto g = gradcomp_test::make_input<T>(d, n, 41);
      if (n > 10) g[7] = std::numeric_limits<T>::quiet_NaN();
      for (double tau : {0.0, 0.5, 1.0, 2.5, std::numeric_limits<double>::infinity()}) {
        CAPTURE(n);
        CAPTURE(tau);
        gradcomp::threshold sel{tau};
        std::vector<std::uint32_t> host;
        const auto hs = sel.select(std::span<const T>(g), gradcomp::select_context{}, host);
        auto dg = upload(g);
        const auto dev =
            run_device(n, [&](gradcomp::temp_storage& tmp, gradcomp::device_span<std::uint32_t> idx,
                              gradcomp::selection_stats* st) {
              gradcomp::on_device(sel).select(tmp, gradcomp::device_span<const T>{dg.data(), n},
                                              gradcomp::select_context{}, idx, st);
            });
        CHECK(dev.stats.count == hs.count);
        CHECK(dev.indices == host);
        CHECK(dev.stats.threshold == hs.threshold);
      }
    }
  }
  gradcomp::threshold bad{-1.0};
  gradcomp::temp_storage tmp;
  gradcomp::device_buffer<std::uint32_t> idx(4);
  gradcomp::device_buffer<gradcomp::selection_stats> st(1);
  gradcomp::device_buffer<T> dg(4);
  CHECK_THROWS_AS(gradcomp::on_device(bad).select(
                      tmp, gradcomp::device_span<const T>{dg.data(), 4}, gradcomp::select_context{},
                      gradcomp::device_span<std::uint32_t>{idx.data(), 4}, st.data()),
                  gradcomp::invalid_argument);
}

TEST_CASE_TEMPLATE("device randomk equals host randomk", T, float, double) {
  // The host's indices for the same call_id whatever the values (NaN among them), k from 0 to
  // n (the complement's draw above n/2; the hash set and the bitmap of Floyd's draw), and
  // select_accumulate's e = e + g bit for bit.
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{33}, std::size_t{4097},
                        (std::size_t{1} << 20) + 3}) {
    auto g = gradcomp_test::make_input<T>(dist::student_t2, n, 43);
    if (n > 10) g[7] = std::numeric_limits<T>::quiet_NaN();
    auto dg = upload(g);
    for (std::size_t k : {std::size_t{0}, std::size_t{1}, n / 1000 + 1, n / 100 + 1, n / 2 + 1, n}) {
      if (k > n) continue;
      CAPTURE(n);
      CAPTURE(k);
      const gradcomp::select_context ctx{k, 0.0, gradcomp::call_id{11, 5, 3, 1}};
      gradcomp::randomk sel;
      std::vector<std::uint32_t> host;
      const auto hs = sel.select(std::span<const T>(g), ctx, host);
      const auto dev =
          run_device(k, [&](gradcomp::temp_storage& tmp, gradcomp::device_span<std::uint32_t> idx,
                            gradcomp::selection_stats* st) {
            gradcomp::on_device(sel).select(tmp, gradcomp::device_span<const T>{dg.data(), n}, ctx,
                                            idx, st);
          });
      CHECK(dev.stats.count == hs.count);
      CHECK(dev.stats.count == k);
      CHECK(dev.indices == host);
      CHECK(dev.stats.threshold == 0.0);
      CHECK_FALSE(dev.stats.fallback);

      std::vector<T> e(n);
      for (std::size_t i = 0; i < n; ++i) e[i] = static_cast<T>((i % 3 == 0) ? 0.25 : -1.5);
      auto de = upload(e);
      const auto dacc =
          run_device(k, [&](gradcomp::temp_storage& tmp, gradcomp::device_span<std::uint32_t> idx,
                            gradcomp::selection_stats* st) {
            // The size query does not touch e; the real call adds g once.
            gradcomp::on_device(sel).select_accumulate(
                tmp, gradcomp::device_span<T>{de.data(), n}, gradcomp::device_span<const T>{dg.data(), n},
                ctx, idx, st);
          });
      CHECK(dacc.indices == host);
      const auto de_host = download(de.data(), n);
      for (std::size_t i = 0; i < n; ++i) {
        const T want = e[i] + g[i];
        if (std::isnan(want)) {
          CHECK(std::isnan(de_host[i]));
        } else if (std::memcmp(&de_host[i], &want, sizeof(T)) != 0) {
          FAIL("e + g differs at ", i, ": ", de_host[i], " != ", want);
        }
      }
    }
  }
  // Other call_ids draw other sets (the rank does not enter the draw).
  std::vector<std::uint32_t> a, b, c;
  const std::vector<float> g(1000, 1.0f);
  gradcomp::randomk sel;
  sel.select(std::span<const float>(g), gradcomp::select_context{10, 0.0, {1, 2, 3, 0}}, a);
  sel.select(std::span<const float>(g), gradcomp::select_context{10, 0.0, {1, 2, 3, 7}}, b);
  sel.select(std::span<const float>(g), gradcomp::select_context{10, 0.0, {1, 3, 3, 0}}, c);
  CHECK(a == b);
  CHECK(a != c);
  // Bad input throws before anything is launched.
  gradcomp::temp_storage tmp;
  gradcomp::device_buffer<std::uint32_t> idx(4);
  gradcomp::device_buffer<gradcomp::selection_stats> st(1);
  gradcomp::device_buffer<T> dg(4);
  CHECK_THROWS_AS(gradcomp::on_device(sel).select(
                      tmp, gradcomp::device_span<const T>{dg.data(), 4},
                      gradcomp::select_context{5, 0.0, {}},
                      gradcomp::device_span<std::uint32_t>{idx.data(), 4}, st.data()),
                  gradcomp::invalid_argument);
  CHECK_THROWS_AS(gradcomp::on_device(sel).select(
                      tmp, gradcomp::device_span<const T>{dg.data(), 4},
                      gradcomp::select_context{3, 0.0, {}},
                      gradcomp::device_span<std::uint32_t>{idx.data(), 2}, st.data()),
                  gradcomp::invalid_argument);
}
