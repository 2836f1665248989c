// Reference selections shared by the selector tests (inputs come from support/data.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numbers>
#include <numeric>
#include <string>
#include <vector>

#include "../support/data.hpp"

namespace gradcomp_test {

// The reference order: (|g| desc, index asc), NaN first. A strict total order on plain
// records (not indices into g), which keeps the references quick on 2^20 elements.
struct record {
  bool nan;
  double mag;
  std::uint32_t index;
};

inline bool record_before(const record& a, const record& b) {
  if (a.nan != b.nan) return a.nan;
  if (a.mag != b.mag) return a.mag > b.mag;
  return a.index < b.index;
}

template <class T>
std::vector<record> make_records(const std::vector<T>& g) {
  std::vector<record> r(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    const bool nan = std::isnan(g[i]);
    r[i] = {nan, nan ? 0.0 : std::fabs(static_cast<double>(g[i])), static_cast<std::uint32_t>(i)};
  }
  return r;
}

// Indices sorted by the reference order.
template <class T>
std::vector<std::uint32_t> reference_order(const std::vector<T>& g) {
  auto r = make_records(g);
  std::sort(r.begin(), r.end(), record_before);
  std::vector<std::uint32_t> order(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) order[i] = r[i].index;
  return order;
}

// Marks the first k entries and lists them in index order (the final "sort the indices").
inline std::vector<std::uint32_t> in_index_order(std::size_t n,
                                                 const std::vector<std::uint32_t>& chosen) {
  std::vector<char> in(n, 0);
  for (std::uint32_t i : chosen) in[i] = 1;
  std::vector<std::uint32_t> top;
  top.reserve(chosen.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (in[i]) top.push_back(static_cast<std::uint32_t>(i));
  }
  return top;
}

// Sort, truncate to k, sort the indices.
inline std::vector<std::uint32_t> reference_topk(const std::vector<std::uint32_t>& order,
                                                 std::size_t k) {
  return in_index_order(
      order.size(),
      std::vector<std::uint32_t>(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k)));
}

// The same selection without the full sort: with a strict total order, nth_element puts
// exactly the first k of the sorted order in front. Also gives the k-th element's index.
struct reference_selection {
  std::vector<std::uint32_t> indices;
  std::uint32_t kth = 0;  // index of the k-th in the reference order (k >= 1)
};

template <class T>
reference_selection reference_select(const std::vector<T>& g, std::size_t k) {
  auto r = make_records(g);
  reference_selection out;
  if (k == 0) return out;
  std::nth_element(r.begin(), r.begin() + static_cast<std::ptrdiff_t>(k - 1), r.end(),
                   record_before);
  std::vector<std::uint32_t> chosen(k);
  for (std::size_t i = 0; i < k; ++i) chosen[i] = r[i].index;
  out.indices = in_index_order(g.size(), chosen);
  out.kth = r[k - 1].index;
  return out;
}

template <class T>
std::vector<std::uint32_t> reference_topk(const std::vector<T>& g, std::size_t k) {
  return reference_select(g, k).indices;
}

// {i : pred(g_i)} in index order.
template <class T, class Pred>
std::vector<std::uint32_t> indices_where(const std::vector<T>& g, Pred pred) {
  std::vector<std::uint32_t> out;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (pred(g[i])) out.push_back(static_cast<std::uint32_t>(i));
  }
  return out;
}

inline bool strictly_increasing_below(const std::vector<std::uint32_t>& idx, std::size_t n) {
  for (std::size_t i = 0; i < idx.size(); ++i) {
    if (idx[i] >= n) return false;
    if (i > 0 && idx[i - 1] >= idx[i]) return false;
  }
  return true;
}

// The keep-this-many of a size list: {1, n/1000, n/2, n}, deduplicated, without 0 unless n = 0.
inline std::vector<std::size_t> k_values(std::size_t n) {
  std::vector<std::size_t> ks;
  if (n == 0) return {0};
  for (std::size_t k : {std::size_t{1}, n / 1000, n / 2, n}) {
    if (k >= 1 && k <= n) ks.push_back(k);
  }
  std::sort(ks.begin(), ks.end());
  ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
  return ks;
}

}  // namespace gradcomp_test
