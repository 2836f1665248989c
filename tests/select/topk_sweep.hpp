// The Top-k property sweep shared by topk_test.cpp and topk_large_test.cpp: runs the
// selector over sizes x distributions x k and compares with the reference selection.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/select/topk.hpp>

#include "select_test_inputs.hpp"

namespace gradcomp_test {

template <class T>
gradcomp::selection_stats run(gradcomp::topk& sel, const std::vector<T>& g, std::size_t k,
                              std::vector<std::uint32_t>& out) {
  gradcomp::select_context ctx;
  ctx.k = k;
  return sel.select(std::span<const T>(g), ctx, out);
}

// Checks one selection against the reference selection `want` (kth: index of the k-th in
// the reference order), and the reported stats.
template <class T>
void check_selection(const std::vector<T>& g, const std::vector<std::uint32_t>& want,
                     std::uint32_t kth, std::size_t k, const std::vector<std::uint32_t>& got,
                     const gradcomp::selection_stats& st) {
  CHECK(got.size() == k);
  CHECK(st.count == k);
  CHECK(got == want);
  CHECK(strictly_increasing_below(got, g.size()));
  if (k > 0) {
    const double kth_mag = std::fabs(static_cast<double>(g[kth]));
    if (std::isnan(kth_mag)) {
      CHECK(std::isnan(st.threshold));
    } else {
      CHECK(st.threshold == kth_mag);
    }
  }
}

template <class T>
void check_against(const std::vector<T>& g, const std::vector<std::uint32_t>& order, std::size_t k,
                   const std::vector<std::uint32_t>& got, const gradcomp::selection_stats& st) {
  check_selection(g, reference_topk(order, k), k > 0 ? order[k - 1] : 0, k, got, st);
}

// Sizes below 100000 compare with a full sort; larger ones with the same order's nth_element
// (identical selections for a strict total order; see the reference self-test), which keeps
// the sanitizer builds quick.
template <class T>
void sweep(const std::vector<std::size_t>& sizes) {
  gradcomp::topk sel;  // one instance: scratch reuse across sizes is part of the test
  std::vector<std::uint32_t> out;
  for (std::size_t n : sizes) {
    for (dist d : all_dists) {
      const auto g = make_input<T>(d, n, n);
      const auto before = g;
      const bool full_sort = n < 100000;
      const auto order = full_sort ? reference_order(g) : std::vector<std::uint32_t>{};
      for (std::size_t k : k_values(n)) {
        CAPTURE(n);
        CAPTURE(k);
        const std::string dist_name = name(d);
        CAPTURE(dist_name);
        const auto st = run(sel, g, k, out);
        if (full_sort) {
          check_against(g, order, k, out, st);
        } else {
          const auto ref = reference_select(g, k);
          check_selection(g, ref.indices, ref.kth, k, out, st);
        }
      }
      CHECK(g == before);
    }
  }
}

}  // namespace gradcomp_test
