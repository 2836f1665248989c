// gradcomp/select/redsync.hpp: RedSync's threshold search: thr = mean|g| + r (max|g| -
// mean|g|) with r found by bisection in [0, 1] until the count lands in [k, 2k). One pass for
// the statistics, one counting pass per bisection step (the last one also writes).
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
#include <gradcomp/detail/select/compaction.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/select/topk.hpp>

namespace gradcomp {

// RedSync. Selection: {i : |g_i| > thr}. Bisection on r stops when k <= count < 2k (a hit) or
// when the r interval is narrower than min_interval (> 0); without a hit the lower end of the
// interval is used, whose count is >= 2k, except when it is still r = 0 and even thr =
// mean|g| leaves fewer than k (dense targets, constant gradients: a constant or all-zero
// gradient selects nothing). stats.iterations = counting passes of the bisection.
// NaN or Inf in g fall back to exact Top-k (stats.fallback = true).
struct redsync {
  double min_interval = 0.2;
  topk exact{};  // the non-finite fallback

  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& ctx,
                         std::vector<std::uint32_t>& indices) {
    check();
    const std::size_t n = g.size();
    detail::check_index_range("redsync", n);
    check_k("redsync", ctx.k, n);
    const std::size_t k = ctx.k;
    selection_stats st;
    if (k == 0) {
      indices.clear();
      return st;
    }

    const detail::mean_max_abs mm = detail::mean_and_max_abs(g);
    const double top = mm.max;
    if (!std::isfinite(mm.mean) || !std::isfinite(top)) {
      st = exact.select(g, ctx, indices);
      st.fallback = true;
      return st;
    }
    auto thr_at = [&](double r) { return mm.mean + r * (top - mm.mean); };

    const std::size_t cap = std::min(n, 2 * k + 256);
    indices.resize(cap + detail::scan_block);
    double lo = 0.0;
    double hi = 1.0;
    // 64 halvings exhaust a double interval; the cap only guards a tiny min_interval.
    while (st.iterations < 64) {
      const double r = 0.5 * (lo + hi);
      const double thr = thr_at(r);
      const std::size_t c =
          detail::count_collect_above(g, detail::key_threshold_above<T>(thr), indices.data(), cap);
      ++st.iterations;
      if (c >= k && c < 2 * k) {
        indices.resize(c);
        st.count = c;
        st.threshold = thr;
        return st;
      }
      (c >= 2 * k ? lo : hi) = r;
      if (hi - lo < min_interval) break;
    }
    st.threshold = thr_at(lo);
    st.count = detail::collect_above(g, detail::key_threshold_above<T>(st.threshold), indices);
    return st;
  }

  // compressor<> calls this before the feedback state changes.
  void check() const {
    if (!(min_interval > 0.0)) {
      detail::throw_invalid_argument("redsync", "min_interval", min_interval, "min_interval > 0");
    }
    exact.check();
  }
};

static_assert(gradcomp::selector<gradcomp::redsync>);
static_assert(gradcomp::selector<gradcomp::redsync, double>);

}  // namespace gradcomp
