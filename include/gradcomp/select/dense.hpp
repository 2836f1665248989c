// gradcomp/select/dense.hpp: the identity selector, every coordinate 0..n-1. Lets the dense
// baseline (S-SGD) and quantize-only compressors run through the same compressor<> as the
// sparsifiers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/select/keys.hpp>

namespace gradcomp {

// Selects all n coordinates whatever k is; stats.threshold = 0.
struct dense {
  static constexpr bool shared_indices = true;  // every rank selects 0..n-1
  static constexpr bool selects_all = true;     // payloads may use index_layout::dense

  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& /*ctx: k unused*/,
                         std::vector<std::uint32_t>& indices) {
    detail::check_index_range("dense", g.size());
    indices.resize(g.size());
    std::iota(indices.begin(), indices.end(), std::uint32_t{0});
    selection_stats st;
    st.count = g.size();
    return st;
  }
};

static_assert(gradcomp::selector<gradcomp::dense>);
static_assert(gradcomp::selector<gradcomp::dense, double>);

}  // namespace gradcomp
