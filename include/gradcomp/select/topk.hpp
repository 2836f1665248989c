// gradcomp/select/topk.hpp: exact Top-k, the k coordinates of largest |g| with ties broken
// by lower index. A strided sample brackets the k-th value, one read of g splits it into
// "surely in" and a few candidates, and an exact finish on the candidates completes it;
// when the bracket misses, a radix select over the key bits finishes instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <numeric>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/select/bracket.hpp>
#include <gradcomp/detail/select/exact_finish.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/radix_select.hpp>
#include <gradcomp/detail/select/sampling.hpp>
#include <gradcomp/detail/select/scan.hpp>
#include <gradcomp/detail/select/scratch.hpp>
#include <gradcomp/detail/select/sources.hpp>
#include <gradcomp/detail/host_dispatch.hpp>

namespace gradcomp {

namespace detail {

// Below this size the exact finish on all of g is cheaper than sampling.
inline constexpr std::size_t topk_direct_max = 2048;

// The bracketed pass: indices with key > hi go to `sure`, lo <= key <= hi to `cand` with
// their keys in `cand_keys` (the finish then never goes back to g), all in index order.
// Blocks without any key >= lo cost one vectorised test; the buffers need cap + scan_block
// entries, as they are checked once per block. Gives up as soon as sure exceeds sure_cap or
// cand exceeds cand_cap (the bracket missed, or the input is dominated by ties) and returns
// false; the source's side effects (e += g) are completed either way.
template <class T>
struct bracket_lists {
  std::uint32_t* sure;
  std::size_t sure_cap;
  std::uint32_t* cand;
  abs_key_t<T>* cand_keys;
  std::size_t cand_cap;
  std::size_t n_sure = 0;
  std::size_t n_cand = 0;
};

template <class T, class Source>
bool bracket_pass(const Source& source, abs_key_t<T> lo, abs_key_t<T> hi, bracket_lists<T>& out) {
  using key = abs_key_t<T>;
  // A local copy: the stores to e cannot change it, so its pointers stay in registers.
  const Source src = source;
  const std::size_t n = src.size();
  const auto t = static_cast<signed_key_t<T>>(lo) - 1;
  std::uint32_t* const sure = out.sure;
  std::uint32_t* const cand = out.cand;
  key* const cand_keys = out.cand_keys;
  std::size_t ns = 0;
  std::size_t nc = 0;
  auto hot = [&](const T* p, std::size_t b, std::size_t len) {
    for_each_above(p, len, t, [&](std::size_t j, key kk) {
      // Written to both lists, kept in one: whether a value is sure or a candidate is a coin
      // flip to the branch predictor when the bracket holds many.
      const auto i = static_cast<std::uint32_t>(b + j);
      const bool is_sure = kk > hi;
      sure[ns] = i;
      cand[nc] = i;
      cand_keys[nc] = kk;
      ns += is_sure;
      nc += !is_sure;
    });
  };
  std::size_t i = 0;
  for (; i + scan_block <= n; i += scan_block) {
    const T* p = src.hot_block(i, t);
    if (p == nullptr) continue;
    if (ns > out.sure_cap || nc > out.cand_cap) {
      src.finish(i + scan_block);
      return false;
    }
    hot(p, i, scan_block);
  }
  if (ns > out.sure_cap || nc > out.cand_cap) {
    src.finish(i);
    return false;
  }
  if (i < n) {
    const std::size_t len = std::min(scan_block, n - i);  // bounded, for the compiler
    hot(src.block(i, len), i, len);
  }
  src.finish(n);  // nothing left to add; a source may still hold what it gathered (sum_source)
  out.n_sure = ns;
  out.n_cand = nc;
  return true;
}

// The bracket [lo, hi] of the sampled path: the plan's sample of src's keys (strided), and the
// keys at the plan's ranks in it, largest first, taken with nth_element. keys is scratch of at
// least plan.s entries. Shared by topk and the benchmark that times the pass alone.
template <class T, class Source>
std::pair<abs_key_t<T>, abs_key_t<T>> sample_bracket(const Source& src,
                                                     const topk_bracket_plan& plan,
                                                     abs_key_t<T>* keys) {
  using key = abs_key_t<T>;
  const std::size_t s = plan.s;
  strided_sample_keys<T>(src, s, keys);
  key lo = 0;
  const std::size_t lo_pos = plan.lo_pos;
  if (lo_pos < s) {
    std::nth_element(keys, keys + lo_pos, keys + s, std::greater<key>{});
    lo = keys[lo_pos];
  }
  key hi = abs_key_traits<T>::mask;  // nothing is above: no sure elements
  if (plan.hi == bracket_hi::sample_rank) {
    std::nth_element(keys, keys + plan.hi_pos, keys + lo_pos, std::greater<key>{});
    hi = keys[plan.hi_pos];
  } else if (plan.hi == bracket_hi::lo) {
    hi = lo;
  }
  return {lo, hi};
}

// Small k: one streaming pass keeping the k best in a heap whose top is the worst kept
// (smallest key, then highest index). Elements arrive in index order, so an element that
// only ties the worst never displaces it: lower indices win ties. Returns the k-th key.
template <class T>
abs_key_t<T> topk_stream_heap(std::span<const T> g, std::size_t k, std::uint32_t* out) {
  using key = abs_key_t<T>;
  using entry = std::pair<key, std::uint32_t>;
  const auto better = [](const entry& a, const entry& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<entry> heap(k);
  const T* p = g.data();
  const std::size_t n = g.size();
  for (std::size_t i = 0; i < k; ++i) heap[i] = {abs_key(p[i]), static_cast<std::uint32_t>(i)};
  std::make_heap(heap.begin(), heap.end(), better);
  auto t = static_cast<signed_key_t<T>>(heap.front().first);
  auto visit = [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      const key kk = abs_key(p[i]);
      if (kk > heap.front().first) {
        std::pop_heap(heap.begin(), heap.end(), better);
        heap.back() = {kk, static_cast<std::uint32_t>(i)};
        std::push_heap(heap.begin(), heap.end(), better);
        t = static_cast<signed_key_t<T>>(heap.front().first);
      }
    }
  };
  std::size_t i = k;
  for (; i + scan_block <= n; i += scan_block) {
    if (block_any_above(p + i, t)) visit(i, i + scan_block);
  }
  visit(i, n);
  for (std::size_t j = 0; j < k; ++j) out[j] = heap[j].second;
  std::sort(out, out + k);
  return heap.front().first;
}

}  // namespace detail

// How topk finds the k-th key: `automatic` is the sample-bracket-filter with its paths below;
// `radix` always runs the radix select over all of g (3 passes for float, 6 for double; stats:
// iterations = passes, fallback = false), the same on the host and the device. The index set
// is the same either way.
enum class topk_method { automatic, radix };

// Exact Top-k. Tunables of the sampled bracket (the defaults suit densities 1e-5 .. 0.5):
// the sample holds sample_scale * (n * sqrt(rho (1 - rho)))^(2/3) elements, clamped to
// [min_sample, max_sample] and to at most n/16; the bracket spans bracket_sigmas binomial
// standard deviations of the sample rank plus bracket_margin ranks on each side; the candidate
// list may grow to candidate_budget_factor times its expected size (at least
// min_candidate_budget) before the pass gives up on the bracket.
// Why that sample size: each sampled element is a cache miss plus its share of an
// nth_element (~20 ns), each candidate costs a few stores in the pass and its share of the
// final nth_element (~10 ns), and a sample of s leaves about 10 sqrt(s rho) n / s candidates
// beyond the k selected; the sum is smallest near s = (2 n sqrt(rho))^(2/3), about 14K at
// n = 25.6M, rho = 0.001 (~0.3 ms of sampling, ~65K candidates).
//
// Paths: n <= 2048 exact finish on everything; k <= heap_max_k a streaming heap (one pass;
// O(n log k) on adversarial orders); otherwise the bracket, with radix select as the fallback
// (stats.fallback = true, stats.iterations = radix passes; 0 on the other paths).
// stats.threshold is |g| of the k-th largest element.
//
// select_accumulate(e, g, ctx, indices) is select() of e + g that also leaves e = e + g: the
// bracket pass adds g into e block by block as it scans (the sample reads e + g without
// writing), so residual error feedback and the selection cost one read of g and e and one
// write of e. The selection is the one select(e + g) makes, bit for bit; the small-n, heap and
// fallback paths first finish e += g and then select from e. compressor<> uses it when the
// feedback offers in_place_accumulator() (residual).
struct topk {
  double sample_scale = 1.6;
  std::size_t min_sample = 4096;
  std::size_t max_sample = 65536;
  double bracket_sigmas = 5.0;
  std::size_t bracket_margin = 2;
  double candidate_budget_factor = 4.0;
  std::size_t min_candidate_budget = 4096;
  std::size_t heap_max_k = 64;
  topk_method method = topk_method::automatic;
  detail::select_scratch scratch{};  // reused between calls; not copied
  // select_accumulate_into reports a NaN or Inf in e + g (selection_stats::nonfinite).
  static constexpr bool flags_nonfinite = true;

  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& ctx,
                         std::vector<std::uint32_t>& indices) {
    check();
    detail::check_index_range("topk", g.size());
    check_k("topk", ctx.k, g.size());
    return select_from(detail::read_source<T>{g}, ctx.k, indices);
  }

  // select() of e + g that also leaves e = e + g: error feedback's accumulation folded into
  // the selection pass.
  template <gradient_value T>
  selection_stats select_accumulate(std::span<T> e, std::span<const T> g,
                                    const select_context& ctx,
                                    std::vector<std::uint32_t>& indices) {
    return select_accumulate_into(e, std::span<const T>(e), g, ctx, indices);
  }

  // select() of e + g that writes e + g to `out` and leaves e alone (out may be e itself): the
  // form a step that must be able to fail without changing the feedback state uses. Reports
  // NaN or Inf sums in stats.nonfinite (detail::sum_source).
  template <gradient_value T>
  selection_stats select_accumulate_into(std::span<T> out, std::span<const T> e,
                                         std::span<const T> g, const select_context& ctx,
                                         std::vector<std::uint32_t>& indices) {
    detail::check_accumulate_sizes("topk::select_accumulate", out.size(), e.size(), g.size());
    check();
    detail::check_index_range("topk", g.size());
    check_k("topk", ctx.k, g.size());
    double energy = 0.0;  // ||e + g||^2, added up as the pass writes the sums
    bool nonfinite = false;
    selection_stats st =
        select_from(detail::accumulating_source(out, e, g, &energy, &nonfinite), ctx.k, indices);
    st.energy = energy;
    st.nonfinite = nonfinite;
    detail::stream_fence();  // `out` may have been written with streaming stores
    return st;
  }

  // The bracket of the sampled path for n values and k > heap_max_k (see the class comment).
  // The number of sampled keys above the true k-th key is about Binomial(s, rho): its standard
  // deviation sets the bracket width in sample ranks.
  [[nodiscard]] detail::topk_bracket_plan bracket_plan(std::size_t n, std::size_t k) const {
    detail::topk_bracket_plan p;
    const double nd = static_cast<double>(n);
    const double kd = static_cast<double>(k);
    const double rho = kd / nd;
    const double spread_n = nd * std::sqrt(rho * (1.0 - rho));
    const double s_real = std::ceil(sample_scale * std::cbrt(spread_n * spread_n));
    std::size_t s = s_real >= nd ? n : static_cast<std::size_t>(std::max(s_real, 1.0));
    s = std::min(std::max(s, min_sample), max_sample);
    s = std::max<std::size_t>(std::min(s, n / 16), 1);
    p.s = s;
    const double sd = static_cast<double>(s);
    const double r = rho * sd;
    const double spread =
        bracket_sigmas * std::sqrt(sd * rho * (1.0 - rho)) + static_cast<double>(bracket_margin);
    const double hi_rank = std::floor(r - spread);  // 1-based ranks, largest first
    const double lo_rank = std::ceil(r + spread);
    p.lo_pos = s;
    if (lo_rank <= sd) p.lo_pos = static_cast<std::size_t>(std::max(lo_rank, 1.0)) - 1;
    if (hi_rank >= 1.0) {
      const auto hi_pos = static_cast<std::size_t>(hi_rank) - 1;
      if (hi_pos < p.lo_pos) {
        p.hi = detail::bracket_hi::sample_rank;
        p.hi_pos = hi_pos;
      } else {
        p.hi = detail::bracket_hi::lo;
      }
    }
    const double ranks_in = std::max(lo_rank, 1.0) - std::max(hi_rank, 0.0) + 1.0;
    const double expected = ranks_in * nd / sd;
    const double budget_real =
        std::max(candidate_budget_factor * expected, static_cast<double>(min_candidate_budget));
    p.budget = budget_real >= nd ? n : static_cast<std::size_t>(budget_real);
    return p;
  }

  // The tunables' ranges; select() and select_accumulate() call it before anything is written,
  // and compressor<> before the feedback state changes. A NaN or negative factor would reach
  // a double -> size_t conversion (undefined behaviour); bracket_margin, min_candidate_budget
  // and heap_max_k accept any value.
  void check() const {
    if (!(sample_scale > 0.0 && std::isfinite(sample_scale))) {
      detail::throw_invalid_argument("topk", "sample_scale", sample_scale, "0 < sample_scale < inf");
    }
    if (min_sample < 1 || min_sample > max_sample) {
      detail::throw_invalid_argument("topk", "min_sample, max_sample",
                                     detail::concat(min_sample, ", ", max_sample),
                                     "1 <= min_sample <= max_sample");
    }
    if (!(bracket_sigmas >= 0.0 && std::isfinite(bracket_sigmas))) {
      detail::throw_invalid_argument("topk", "bracket_sigmas", bracket_sigmas,
                                     "0 <= bracket_sigmas < inf");
    }
    if (!(candidate_budget_factor > 0.0 && std::isfinite(candidate_budget_factor))) {
      detail::throw_invalid_argument("topk", "candidate_budget_factor", candidate_budget_factor,
                                     "0 < candidate_budget_factor < inf");
    }
    if (method != topk_method::automatic && method != topk_method::radix) {
      detail::throw_invalid_argument("topk", "method", static_cast<int>(method),
                                     "topk_method::automatic (0) or topk_method::radix (1)");
    }
  }

 private:
  template <class Source>
  selection_stats select_from(const Source& src, std::size_t k,
                              std::vector<std::uint32_t>& indices) {
    using T = std::remove_cv_t<std::remove_reference_t<decltype(src.at(0))>>;
    using key = detail::abs_key_t<T>;
    const std::size_t n = src.size();
    selection_stats st;
    if (k == 0) {
      src.finish(0);
      indices.clear();
      return st;
    }
    indices.resize(k);
    st.count = k;

    if (method == topk_method::radix) {
      src.finish(0);
      auto& keys = scratch.keys<T>();
      const auto res = detail::radix_kth_largest(src.values(), k, keys);
      detail::take_top_by_kth(src.values(), res.kth, res.above, k, indices.data());
      st.threshold = static_cast<double>(detail::key_magnitude<T>(res.kth));
      st.iterations = res.passes;
      return st;
    }

    if (k == n || n <= detail::topk_direct_max || k <= heap_max_k) {
      src.finish(0);
      return select_small(src.values(), k, indices, st);
    }

    const detail::topk_bracket_plan plan = bracket_plan(n, k);
    auto& keys = scratch.keys<T>();
    detail::ensure_size(keys, plan.s);
    const std::pair<key, key> bracket = detail::sample_bracket<T>(src, plan, keys.data());
    const key lo = bracket.first;
    const key hi = bracket.second;
    const std::size_t budget = plan.budget;

    auto& sure = scratch.above;
    auto& cand = scratch.candidates;
    auto& cand_keys = scratch.list_keys<T>();
    detail::ensure_size(sure, k + detail::scan_block);
    detail::ensure_size(cand, budget + detail::scan_block);
    detail::ensure_size(cand_keys, budget + detail::scan_block);
    detail::bracket_lists<T> lists{sure.data(), k, cand.data(), cand_keys.data(), budget};
    // The pass runs in the widest clone the CPU offers (detail/host_dispatch.hpp), where its
    // 16-byte vectors take the VEX/EVEX forms: the same operations, so the same selection, sums
    // and energy on every path (square_unfused keeps an AVX-512 clone from fusing the squares).
    bool pass_ok = false;
    const auto pass = [&](auto) { pass_ok = detail::bracket_pass<T>(src, lo, hi, lists); };
    detail::run_active(pass);
    const std::size_t ns = lists.n_sure;
    const std::size_t nc = lists.n_cand;
    const std::span<const T> values = src.values();  // e + g once the pass is done
    if (pass_ok && ns <= k && ns + nc >= k) {
      const std::size_t need = k - ns;
      key kth;
      if (need > 0) {
        detail::ensure_size(keys, nc);
        kth = detail::keep_top_by_keys(std::span(cand.data(), nc), cand_keys.data(), need,
                                       keys.data());
      } else {
        kth = detail::abs_key_traits<T>::mask;
        for (std::size_t i = 0; i < ns; ++i) kth = std::min(kth, detail::abs_key(values[sure[i]]));
      }
      std::merge(sure.begin(), sure.begin() + static_cast<std::ptrdiff_t>(ns), cand.begin(),
                 cand.begin() + static_cast<std::ptrdiff_t>(need), indices.begin());
      st.threshold = static_cast<double>(detail::key_magnitude<T>(kth));
      return st;
    }

    const auto res = detail::radix_kth_largest(values, k, keys);
    detail::take_top_by_kth(values, res.kth, res.above, k, indices.data());
    st.threshold = static_cast<double>(detail::key_magnitude<T>(res.kth));
    st.iterations = res.passes;
    st.fallback = true;
    return st;
  }

  // k == n, tiny n and tiny k (indices already holds k entries).
  template <class T>
  selection_stats select_small(std::span<const T> g, std::size_t k,
                               std::vector<std::uint32_t>& indices, selection_stats st) {
    using key = detail::abs_key_t<T>;
    const std::size_t n = g.size();
    if (k == n) {
      std::iota(indices.begin(), indices.end(), std::uint32_t{0});
      key lowest = detail::abs_key_traits<T>::mask;
      for (const T x : g) lowest = std::min(lowest, detail::abs_key(x));
      st.threshold = static_cast<double>(detail::key_magnitude<T>(lowest));
      return st;
    }
    if (n <= detail::topk_direct_max) {
      auto& list = scratch.candidates;
      detail::ensure_size(list, n);
      std::iota(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(n), std::uint32_t{0});
      const key kth = detail::keep_top_of_list(g, std::span(list.data(), n), k, scratch.keys<T>());
      std::copy_n(list.begin(), k, indices.begin());
      st.threshold = static_cast<double>(detail::key_magnitude<T>(kth));
      return st;
    }
    const key kth = detail::topk_stream_heap(g, k, indices.data());
    st.threshold = static_cast<double>(detail::key_magnitude<T>(kth));
    return st;
  }
};

static_assert(gradcomp::selector<gradcomp::topk>);
static_assert(gradcomp::selector<gradcomp::topk, double>);

}  // namespace gradcomp
