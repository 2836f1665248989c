// gradcomp/select/gaussiank.hpp: Gaussian-k, approximate Top-k that models g as normal: one
// pass for mean and standard deviation, a threshold from the inverse normal CDF, and a few
// corrections until the count lies in [2k/3, 4k/3]. Usually one read of g: a sample predicts
// the threshold, and the statistics pass collects the values around it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/host_dispatch.hpp>
#include <gradcomp/detail/moments.hpp>
#include <gradcomp/detail/normal.hpp>
#include <gradcomp/detail/select/compaction.hpp>
#include <gradcomp/detail/select/exact_finish.hpp>
#include <gradcomp/detail/select/gaussian_search.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/sampling.hpp>
#include <gradcomp/detail/select/scratch.hpp>
#include <gradcomp/detail/select/sources.hpp>
#include <gradcomp/select/topk.hpp>

namespace gradcomp {

// Gaussian-k. thr = |mean| + sd * Phi^-1(1 - rho/2), then at most max_refinements
// corrections while the count of |g| > thr lies outside [2k/3, 4k/3]. Two forms:
//
// - until_in_band = true (the default): the count ends in the band. A correction halves thr
//   (too few) or multiplies it by 1.5 (too many) until counts on both sides of the band have
//   been seen, and from then on takes the geometric mean of the closest thresholds seen on
//   either side (bisection). If the count is still outside the band after max_refinements
//   corrections (a gradient far from normal, such as an error-feedback residual whose largest
//   values were sent), the selection is the exact top-k: k indices, ties broken by
//   lower index, stats.threshold = the k-th largest |g| (taken from the values the statistics
//   pass collected when they hold k or more, else exact Top-k's own pass).
// - until_in_band = false (gaussiank::published()): the GaussianK-SGD paper's algorithm, which
//   its measurements used: while outside the band thr is halved (too few) or multiplied by 1.5
//   (too many), at most max_refinements times; the last correction is applied and its count
//   kept, so the count may lie outside the band when the corrections run out.
//
// cap_at_k (either form) keeps exactly the top-k of the survivors when more than k survive.
//
// Result: exactly {i : |g_i| > stats.threshold}, except where the exact top-k is taken (above,
// or cap_at_k with more than k survivors: then stats.threshold is the k-th largest |g|).
// stats.iterations = corrections applied.
// Degenerate inputs: sd == 0 (a constant gradient) has no tail to model, so thr = 0 without
// corrections: the published form selects every nonzero coordinate (none for an all-zero
// gradient), the default those too when their count is in the band (k between 3/4 and 3/2 of
// their count), else
// the exact top-k. When |g| takes few distinct values (|g| constant
// with mixed signs, heavy ties) no threshold may hit the band; the published form stops after
// max_refinements (or when thr reaches 0) with all or nothing, the default takes the exact
// top-k. The loop always terminates.
// Statistics: chunk partial sums in T, totals in double (detail/moments.hpp).
// NaN or Inf in g (mean or sd not finite) fall back to exact Top-k (stats.fallback = true).
//
// Cost. The threshold depends on statistics of all of g, so the textbook form reads g twice
// (statistics, then count and write) and once more per correction. Here a strided sample of
// predict_sample values (at most n/64; no sample below n = 65536, where it would not pay)
// predicts the threshold and the corrections first, and the statistics pass also collects
// every value above (1 - collect_margin) x the lower of the predicted final threshold and the
// sample's estimate of the threshold that about 2.4k values exceed (at k/n = 0.001 with the
// default sample), with its key; every
// threshold above that is counted on this short list, and a threshold below it has more than
// the list holds (a lower bound that settles "too many" when the list holds more than 4k/3).
// When the sample says the first thresholds are clearly too low (tails heavier than the
// normal model: Laplace, Student-t), the pass also counts the values above (1 +
// collect_margin) x the last of them, another lower bound of that kind. So a normal,
// heavier-tailed or residual gradient is read once. A threshold the pass did not cover (the
// prediction was off by more than the margin) costs a counting pass over g; either way the
// result is the same set. predict_sample = 0 turns the prediction off.
//
// select_accumulate(e, g, ctx, indices) is select() of e + g that also leaves e = e + g, with
// the addition done inside the statistics pass (see topk).
struct gaussiank {
  unsigned max_refinements = 3;
  bool until_in_band = true;  // false: the published algorithm (see above)
  bool cap_at_k = false;
  std::size_t predict_sample = 16384;
  double collect_margin = 0.05;
  topk exact{};  // exact Top-k: cap_at_k, non-finite input, the default form's last resort
  detail::select_scratch scratch{};  // reused between calls; not copied
  // select_accumulate_into reports a NaN or Inf in e + g (selection_stats::nonfinite).
  static constexpr bool flags_nonfinite = true;

  // The GaussianK-SGD paper's algorithm (until_in_band = false), as its measurements used it.
  static gaussiank published() {
    gaussiank g;
    g.until_in_band = false;
    return g;
  }

  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& ctx,
                         std::vector<std::uint32_t>& indices) {
    check();
    detail::check_index_range("gaussiank", g.size());
    check_k("gaussiank", ctx.k, g.size());
    return select_from(detail::read_source<T>{g}, ctx, indices);
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
    detail::check_accumulate_sizes("gaussiank::select_accumulate", out.size(), e.size(), g.size());
    check();
    detail::check_index_range("gaussiank", g.size());
    check_k("gaussiank", ctx.k, g.size());
    bool nonfinite = false;
    selection_stats st =
        select_from(detail::accumulating_source(out, e, g, nullptr, &nonfinite), ctx, indices);
    st.nonfinite = nonfinite;
    detail::stream_fence();  // `out` may have been written with streaming stores
    return st;
  }

  // The tunables' ranges (and those of the exact fallback); select() and select_accumulate()
  // call it before anything is written, compressor<> before the feedback state changes.
  // max_refinements and predict_sample accept any value; a negative collect_margin only makes
  // the collected list useless (the counting passes then decide), but NaN or Inf would make
  // the predicted thresholds meaningless.
  void check() const {
    if (!std::isfinite(collect_margin)) {
      detail::throw_invalid_argument("gaussiank", "collect_margin", collect_margin,
                                     "-inf < collect_margin < inf");
    }
    exact.check();
  }

 private:
  // What the sample predicts: collect the values above `collect` (room for `cap` of them), and
  // count those above `bound` when > 0, a lower bound for the counts of the thresholds the
  // sample says are clearly too low (each then moves up without an exact count).
  struct plan {
    double collect = 0.0;
    std::size_t cap = 0;
    double bound = 0.0;
  };

  // The plan from a strided sample, or false when the sample gives no usable prediction. The
  // sample's statistics give the first threshold; its counts replay the upward corrections
  // while they are clear (more than 4k/3 by three Poisson standard deviations, at a threshold
  // collect_margin higher than predicted so that the exact statistics may differ that much):
  // those need only a lower bound, and the list starts below the last threshold.
  template <class T, class Source>
  bool predict(const Source& src, std::size_t k, double tail, plan& out) {
    using key = detail::abs_key_t<T>;
    using skey = detail::signed_key_t<T>;
    const std::size_t n = src.size();
    const std::size_t s = std::min(predict_sample, n / 64);
    if (s < 1024) return false;
    auto& keys = scratch.keys<T>();
    detail::ensure_size(keys, s);
    // Keys for the counts, and moments in double shifted by the first value like the full pass.
    const double shift = static_cast<double>(src.at(0));
    double s1 = 0.0;
    double s2 = 0.0;
    detail::for_each_strided(src, s, [&](std::size_t j, T x) {
      keys[j] = detail::abs_key(x);
      const double d = static_cast<double>(x) - shift;
      s1 += d;
      s2 += d * d;
    });
    const double ss = static_cast<double>(s);
    const double mean = shift + s1 / ss;
    const double sd = std::sqrt(std::max((s2 - s1 * s1 / ss) / ss, 0.0));
    double v = std::fabs(mean) + sd * detail::inverse_normal_upper(tail);
    if (!(sd > 0.0) || !std::isfinite(v)) return false;
    auto in_sample = [&](double x) {
      const skey t = detail::key_threshold_above<T>(x);
      std::size_t c = 0;
      for (std::size_t j = 0; j < s; ++j) c += static_cast<skey>(keys[j]) > t;
      return static_cast<double>(c);
    };
    const double band_top = 4.0 / 3.0 * static_cast<double>(k) * ss / static_cast<double>(n);
    out.bound = 0.0;
    for (unsigned step = 0; step < max_refinements; ++step) {
      const double c = in_sample((1.0 + collect_margin) * v);
      if (c - 3.0 * std::sqrt(c) <= band_top) break;
      out.bound = (1.0 + collect_margin) * v;
      v *= 1.5;
    }
    out.collect = (1.0 - collect_margin) * v;
    // Also low enough for the band's whole range as the sample sees it: the m-th largest
    // sampled |g|, m the sample's count at 4k/3 plus three Poisson standard deviations (and a
    // few), which about 2.4k values exceed at k/n = 0.001 with the default sample.
    const double at_top = band_top + 3.0 * std::sqrt(band_top) + 4.0;
    const std::size_t m = static_cast<std::size_t>(std::ceil(at_top));
    if (m < s) {
      auto by_key = [](key a, key b) { return static_cast<skey>(a) > static_cast<skey>(b); };
      std::nth_element(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(m - 1),
                       keys.begin() + static_cast<std::ptrdiff_t>(s), by_key);
      const double q = static_cast<double>(detail::key_magnitude<T>(keys[m - 1]));
      if (q < out.collect) out.collect = q;
    }
    // Room for twice the predicted list (plus a few sample counts of noise), and never less
    // than the band's upper end.
    const double predicted = (in_sample(out.collect) + 8.0) * static_cast<double>(n) / ss;
    const double want = std::max(2.0 * predicted, 2.0 * static_cast<double>(k) + 256.0);
    if (want > static_cast<double>(n) / 4) return false;  // most blocks would be hot
    out.cap = static_cast<std::size_t>(want);
    return true;
  }

  // The default form's last resort: the exact top-k (k indices ascending, ties broken by lower
  // index), from the collected values when they hold k or more (they are every value above
  // the list's threshold, so their top-k is g's), else by exact Top-k's own pass.
  template <class T>
  selection_stats finish_exact(std::span<const T> g, const select_context& ctx,
                               detail::above_list<T>* list, selection_stats st,
                               std::vector<std::uint32_t>& indices) {
    const std::size_t k = ctx.k;
    st.count = k;
    if (list != nullptr && list->count >= k) {
      auto& sorted = scratch.keys<T>();
      detail::ensure_size(sorted, list->count);
      const auto kth = detail::keep_top_by_keys(std::span(list->indices, list->count),
                                                list->keys, k, sorted.data());
      indices.assign(list->indices, list->indices + k);
      st.threshold = static_cast<double>(detail::key_magnitude<T>(kth));
      return st;
    }
    st.threshold = exact.select(g, ctx, indices).threshold;
    return st;
  }

  template <class Source>
  selection_stats select_from(const Source& src, const select_context& ctx,
                              std::vector<std::uint32_t>& indices) {
    using T = std::remove_cv_t<std::remove_reference_t<decltype(src.at(0))>>;
    using key = detail::abs_key_t<T>;
    using skey = detail::signed_key_t<T>;
    const std::size_t n = src.size();
    const std::size_t k = ctx.k;
    selection_stats st;
    if (k == 0) {
      src.finish(0);
      indices.clear();
      return st;
    }

    const double rho = static_cast<double>(k) / static_cast<double>(n);
    plan pl;
    const bool collect = predict<T>(src, k, rho / 2.0, pl);
    detail::above_list<T> list;
    skey t_list = detail::abs_key_traits<T>::mask;  // nothing collected
    skey t_bound = -1;
    std::size_t bound_count = 0;
    detail::mean_sd ms;
    if (collect) {
      t_list = detail::key_threshold_above<T>(pl.collect);
      auto& above = scratch.above;
      auto& above_keys = scratch.list_keys<T>();
      detail::ensure_size(above, pl.cap + detail::moments_chunk);
      detail::ensure_size(above_keys, pl.cap + detail::moments_chunk);
      list = {above.data(), above_keys.data(), pl.cap, 0, false};
      if (pl.bound > 0.0) t_bound = detail::key_threshold_above<T>(pl.bound);
    }
    // The statistics pass runs in the widest clone the CPU offers, like top-k's bracket pass
    // (the same operations on every path, squares unfused: the same moments and list).
    const auto pass = [&](auto) {
      if (!collect) {
        ms = detail::moments_pass<T, false, false>(src, t_list, nullptr, 0, nullptr);
      } else if (pl.bound > 0.0) {
        ms = detail::moments_pass<T, true, true>(src, t_list, &list, t_bound, &bound_count);
      } else {
        ms = detail::moments_pass<T, true, false>(src, t_list, &list, 0, nullptr);
      }
    };
    detail::run_active(pass);
    const std::span<const T> g = src.values();  // e + g once the pass is done
    const bool list_ok = collect && !list.overflow;
    const double nd = static_cast<double>(n);
    st.energy = nd * (ms.sd * ms.sd + ms.mean * ms.mean);  // sum of g^2, from the moments

    double thr =
        ms.sd > 0.0 ? std::fabs(ms.mean) + ms.sd * detail::inverse_normal_upper(rho / 2.0) : 0.0;
    if (!std::isfinite(ms.mean) || !std::isfinite(ms.sd) || !std::isfinite(thr)) {
      const double energy = st.energy;
      st = exact.select(g, ctx, indices);
      st.fallback = true;
      st.energy = energy;
      return st;
    }

    // The count at v: from the list when v lies in its range; else, when the bound settles
    // the only question the loop asks of it (more than 4k/3?), that bound; else by a fused
    // count-and-write pass over g whose buffer holds a count up to 2k (+ slack), so that the
    // pass landing in the band has already written the selection.
    const std::size_t cap = std::min(n, 2 * k + 256);
    bool from_list = false;
    bool exact_count = true;
    auto count = [&](double v, bool need_exact) {
      const skey tv = detail::key_threshold_above<T>(v);
      from_list = list_ok && tv >= t_list;
      exact_count = true;
      if (from_list) {
        std::size_t c = 0;
        for (std::size_t i = 0; i < list.count; ++i) c += static_cast<skey>(list.keys[i]) > tv;
        return c;
      }
      if (!need_exact && tv <= t_bound && 3 * bound_count > 4 * k) {
        exact_count = false;
        return bound_count;  // count(v) >= bound_count > 4k/3
      }
      if (!need_exact && list_ok && 3 * list.count > 4 * k) {
        exact_count = false;  // tv < t_list: count(v) >= list.count > 4k/3
        return list.count;
      }
      indices.resize(cap + detail::scan_block);
      return detail::count_collect_above(g, tv, indices.data(), cap);
    };
    // The published form needs the last count exactly; the default only needs to know whether
    // it lies in the band (a count outside it ends in the exact top-k).
    std::size_t c = count(thr, !until_in_band && max_refinements == 0);
    if (ms.sd > 0.0) {
      detail::gaussian_bracket br;
      while (st.iterations < max_refinements) {
        const bool too_few = 3 * c < 2 * k;
        if (!too_few && 3 * c <= 4 * k) break;
        thr = detail::gaussian_correction(thr, too_few, until_in_band, br);
        ++st.iterations;
        c = count(thr, !until_in_band && st.iterations == max_refinements);
        if (thr == 0.0 || !std::isfinite(thr)) break;  // no multiplicative move is left
      }
    }
    if (until_in_band && !(exact_count && 3 * c >= 2 * k && 3 * c <= 4 * k)) {
      return finish_exact(g, ctx, list_ok ? &list : nullptr, st, indices);
    }
    if (!exact_count) c = count(thr, true);
    st.threshold = thr;
    if (from_list) {
      // The selection is the list entries above thr, already in index order; keys kept for
      // cap_at_k.
      const skey tv = detail::key_threshold_above<T>(thr);
      std::size_t w = 0;
      for (std::size_t i = 0; i < list.count; ++i) {
        const key kk = list.keys[i];
        list.indices[w] = list.indices[i];
        list.keys[w] = kk;
        w += static_cast<skey>(kk) > tv;
      }
      std::uint32_t* const sel = list.indices;
      if (cap_at_k && c > k) {
        auto& sorted = scratch.keys<T>();
        detail::ensure_size(sorted, c);
        const key kth = detail::keep_top_by_keys(std::span(sel, c), list.keys, k, sorted.data());
        indices.assign(sel, sel + k);
        st.threshold = static_cast<double>(detail::key_magnitude<T>(kth));
        st.count = k;
        return st;
      }
      indices.assign(sel, sel + c);
      st.count = c;
      return st;
    }

    if (cap_at_k && c > k) {
      if (c <= cap) {
        const auto kth =
            detail::keep_top_of_list(g, std::span(indices.data(), c), k, scratch.keys<T>());
        indices.resize(k);
        st.threshold = static_cast<double>(detail::key_magnitude<T>(kth));
      } else {
        // The survivors are {|g| > thr} with more than k of them, so their top-k is the
        // global top-k.
        st.threshold = exact.select(g, ctx, indices).threshold;
      }
      st.count = k;
      return st;
    }
    if (c <= cap) {
      indices.resize(c);
    } else {
      detail::collect_above(g, detail::key_threshold_above<T>(thr), indices);
    }
    st.count = c;
    return st;
  }
};

static_assert(gradcomp::selector<gradcomp::gaussiank>);
static_assert(gradcomp::selector<gradcomp::gaussiank, double>);

}  // namespace gradcomp
