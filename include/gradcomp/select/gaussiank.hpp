// gradcomp/select/gaussiank.hpp: Gaussian-k, approximate Top-k that models g as normal: one
// pass for mean and standard deviation, a threshold from the inverse normal CDF, and a few
// multiplicative corrections until the count lies in [2k/3, 4k/3]. Usually two reads of g.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/moments.hpp>
#include <gradcomp/detail/normal.hpp>
#include <gradcomp/detail/select_common.hpp>
#include <gradcomp/select/topk.hpp>

namespace gradcomp {

// Gaussian-k. thr = |mean| + sd * Phi^-1(1 - rho/2); while the count of |g| > thr is below
// 2k/3 thr is halved, above 4k/3 multiplied by 1.5, at most max_refinements times; the
// last correction is applied and its count kept (the count is approximate and may lie
// outside the band when the corrections run out). cap_at_k keeps exactly the top-k of the
// survivors when more than k survive.
//
// Result: exactly {i : |g_i| > stats.threshold}, or with cap_at_k the top-k of that set (then
// stats.threshold is the k-th largest |g|). stats.iterations = corrections applied.
// Degenerate inputs: sd == 0 (a constant gradient) has no tail to model, so thr = 0 and every
// nonzero coordinate is selected (none for an all-zero gradient), without corrections. When
// |g| takes few distinct values (|g| constant with mixed signs, heavy ties) no threshold may
// hit the band; the corrections still stop after max_refinements (or when thr reaches 0) and
// the last one stands, possibly selecting all or nothing. The loop always terminates.
// Statistics: chunk partial sums in T, totals in double (detail/moments.hpp).
// NaN or Inf in g (mean or sd not finite) fall back to exact Top-k (stats.fallback = true).
struct gaussiank {
  unsigned max_refinements = 3;
  bool cap_at_k = false;
  topk exact{};                      // exact Top-k for cap_at_k and non-finite input
  detail::select_scratch scratch{};  // reused between calls; not copied

  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& ctx,
                         std::vector<std::uint32_t>& indices) {
    const std::size_t n = g.size();
    detail::check_index_range("gaussiank", n);
    check_k("gaussiank", ctx.k, n);
    const std::size_t k = ctx.k;
    selection_stats st;
    if (k == 0) {
      indices.clear();
      return st;
    }

    const detail::mean_sd ms = detail::mean_and_sd(g);
    const double rho = static_cast<double>(k) / static_cast<double>(n);
    double thr =
        ms.sd > 0.0 ? std::fabs(ms.mean) + ms.sd * detail::inverse_normal_upper(rho / 2.0) : 0.0;
    if (!std::isfinite(ms.mean) || !std::isfinite(ms.sd) || !std::isfinite(thr)) {
      st = exact.select(g, ctx, indices);
      st.fallback = true;
      return st;
    }

    // Fused count-and-write: the buffer holds a count up to 2k (+ slack), so the pass that
    // lands in the band has already written the selection.
    const std::size_t cap = std::min(n, 2 * k + 256);
    indices.resize(cap + detail::scan_block);
    auto count = [&](double v) {
      return detail::count_collect_above(g, detail::key_threshold_above<T>(v), indices.data(), cap);
    };
    std::size_t c = count(thr);
    if (ms.sd > 0.0) {
      while (st.iterations < max_refinements) {
        if (3 * c < 2 * k) {
          thr *= 0.5;
        } else if (3 * c > 4 * k) {
          thr *= 1.5;
        } else {
          break;
        }
        ++st.iterations;
        c = count(thr);
        if (thr == 0.0 || !std::isfinite(thr)) break;  // no multiplicative move is left
      }
    }
    st.threshold = thr;

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
