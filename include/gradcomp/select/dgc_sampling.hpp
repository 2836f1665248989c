// gradcomp/select/dgc_sampling.hpp: the threshold estimate of Deep Gradient Compression:
// the k-th largest |g| of a random strided sample sets the threshold; too many survivors
// are cut to exactly k, too few lower the threshold and count again.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/random.hpp>
#include <gradcomp/detail/select/compaction.hpp>
#include <gradcomp/detail/select/exact_finish.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/scratch.hpp>
#include <gradcomp/select/topk.hpp>

namespace gradcomp {

// DGC sampling. The sample holds at least max(sample_fraction * n, samples_per_rho / rho)
// elements (at most n): stride = floor(n / that), start uniform in [0, stride) from
// stream_key(ctx.id, stream_tag::sample), so ranks sample the same positions of their own
// gradients. thr = the k_s-th largest sampled |g|, k_s = max(1, round(rho * samples)).
// Survivors are |g| >= thr (>=, as DGC: the sampled k_s-th element itself survives, and a
// constant gradient yields everything and is then cut to k rather than yielding nothing).
// Rounds: more than upper * k survivors -> exact top-k of them (= the global top-k, the
// result has exactly k; stats.fallback = true); fewer than lower * k -> thr *= decay and
// count again, at most max_rounds counting passes in all (stats.iterations); otherwise the
// survivors are the result, so the count lies in [lower * k, upper * k] unless the rounds run
// out. stats.threshold is thr (the k-th largest |g| after an exact cut). NaN or Inf at the
// sampled threshold fall back to exact Top-k.
struct dgc_sampling {
  double sample_fraction = 0.01;
  double samples_per_rho = 2.0;
  double upper = 1.3;
  double lower = 0.8;
  double decay = 0.8;
  unsigned max_rounds = 10;
  topk exact{};                      // the exact cut and the non-finite fallback
  detail::select_scratch scratch{};  // reused between calls; not copied

  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& ctx,
                         std::vector<std::uint32_t>& indices) {
    check();
    const std::size_t n = g.size();
    detail::check_index_range("dgc_sampling", n);
    check_k("dgc_sampling", ctx.k, n);
    const std::size_t k = ctx.k;
    selection_stats st;
    if (k == 0) {
      indices.clear();
      return st;
    }

    const double nd = static_cast<double>(n);
    const double rho = static_cast<double>(k) / nd;
    const double want = std::max(std::ceil(sample_fraction * nd), std::ceil(samples_per_rho / rho));
    const std::size_t target =
        want >= nd ? n : std::max<std::size_t>(1, static_cast<std::size_t>(want));
    const std::size_t stride = std::max<std::size_t>(1, n / target);
    const detail::counter_rng rng{detail::stream_key(ctx.id, detail::stream_tag::sample)};
    const auto start = static_cast<std::size_t>(rng.below(0, stride));

    auto& keys = scratch.keys<T>();
    const std::size_t m = (n - start + stride - 1) / stride;
    detail::ensure_size(keys, m);
    for (std::size_t j = 0; j < m; ++j) keys[j] = detail::abs_key(g[start + j * stride]);
    const double ks_real = std::round(rho * static_cast<double>(m));
    const std::size_t ks = std::clamp<std::size_t>(static_cast<std::size_t>(ks_real), 1, m);
    std::nth_element(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(ks - 1),
                     keys.begin() + static_cast<std::ptrdiff_t>(m),
                     std::greater<detail::abs_key_t<T>>{});
    const auto sampled = keys[ks - 1];
    double thr = static_cast<double>(detail::key_magnitude<T>(sampled));
    if (!std::isfinite(thr)) {
      st = exact.select(g, ctx, indices);
      st.fallback = true;
      return st;
    }

    const double high = upper * static_cast<double>(k);
    const double low = lower * static_cast<double>(k);
    // high is capped at n before the conversion: a large upper must not overflow size_t.
    const std::size_t cap = std::min(
        n, std::max(2 * k, static_cast<std::size_t>(std::ceil(std::min(high, nd)))) + 256);
    indices.resize(cap + detail::scan_block);
    auto t = static_cast<detail::signed_key_t<T>>(sampled) - 1;  // key >= sampled
    std::size_t c = 0;
    for (;;) {
      c = detail::count_collect_above(g, t, indices.data(), cap);
      ++st.iterations;
      if (static_cast<double>(c) > high) {
        st.fallback = true;
        if (c <= cap) {
          const auto kth = detail::keep_top_of_list(g, std::span(indices.data(), c), k, keys);
          indices.resize(k);
          st.threshold = static_cast<double>(detail::key_magnitude<T>(kth));
        } else {
          // More than k have |g| >= thr, so the top-k of the survivors is the global top-k.
          st.threshold = exact.select(g, ctx, indices).threshold;
        }
        st.count = k;
        return st;
      }
      if (static_cast<double>(c) < low && st.iterations < max_rounds && thr > 0.0) {
        thr *= decay;
        t = detail::key_threshold_at_least<T>(thr);
        continue;
      }
      break;
    }
    st.threshold = thr;
    st.count = c;
    if (c <= cap) {
      indices.resize(c);
    } else {
      detail::collect_above(g, t, indices);
    }
    return st;
  }

  // The tunables' ranges (and those of the exact cut); select() calls it before anything is
  // written, compressor<> before the feedback state changes. Outside them the sample size
  // would reach a double -> size_t conversion (negative or NaN: undefined behaviour), or the
  // rounds would move the threshold the wrong way (decay >= 1) or promise a count band that
  // does not contain k.
  void check() const {
    if (!(sample_fraction >= 0.0 && sample_fraction <= 1.0)) {
      detail::throw_invalid_argument("dgc_sampling", "sample_fraction", sample_fraction,
                                     "0 <= sample_fraction <= 1");
    }
    if (!(samples_per_rho >= 0.0 && std::isfinite(samples_per_rho))) {
      detail::throw_invalid_argument("dgc_sampling", "samples_per_rho", samples_per_rho,
                                     "0 <= samples_per_rho < inf");
    }
    if (!(upper >= 1.0 && std::isfinite(upper))) {
      detail::throw_invalid_argument("dgc_sampling", "upper", upper, "1 <= upper < inf");
    }
    if (!(lower >= 0.0 && lower <= 1.0)) {
      detail::throw_invalid_argument("dgc_sampling", "lower", lower, "0 <= lower <= 1");
    }
    if (!(decay > 0.0 && decay < 1.0)) {
      detail::throw_invalid_argument("dgc_sampling", "decay", decay, "0 < decay < 1");
    }
    if (max_rounds < 1) {
      detail::throw_invalid_argument("dgc_sampling", "max_rounds", max_rounds, "max_rounds >= 1");
    }
    exact.check();
  }
};

static_assert(gradcomp::selector<gradcomp::dgc_sampling>);
static_assert(gradcomp::selector<gradcomp::dgc_sampling, double>);

}  // namespace gradcomp
