// gradcomp/select/threshold.hpp: a fixed threshold: every coordinate with |g| >= tau. The
// count depends on the data; k is ignored. One read of g.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/select/compaction.hpp>
#include <gradcomp/detail/select/keys.hpp>

namespace gradcomp {

// Selects {i : |g_i| >= tau}, compared in the element type T exactly as the double tau
// orders against it; NaN entries rank above +Inf and are selected. tau must be >= 0 and not
// NaN (+Inf selects only infinities and NaN). The default tau = 0 selects everything.
struct threshold {
  double tau = 0.0;

  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& /*ctx: k unused*/,
                         std::vector<std::uint32_t>& indices) {
    check();
    detail::check_index_range("threshold", g.size());
    selection_stats st;
    st.count = detail::collect_above(g, detail::key_threshold_at_least<T>(tau), indices);
    st.threshold = tau;
    return st;
  }

  // compressor<> calls this before the feedback state changes.
  void check() const {
    if (!(tau >= 0.0)) {
      detail::throw_invalid_argument("threshold", "tau", tau, "tau >= 0 (and not NaN)");
    }
  }
};

static_assert(gradcomp::selector<gradcomp::threshold>);
static_assert(gradcomp::selector<gradcomp::threshold, double>);

}  // namespace gradcomp
