// gradcomp/detail/select/exact_finish.hpp: the exact top-k of a short candidate list (ties to
// the lower index), the last step of the sampled selectors.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/scratch.hpp>

namespace gradcomp::detail {

// Exact top-k finish on a candidate list.

// Of the indices in `list` (ascending), keeps the `need` (1 <= need <= list.size()) with the
// largest keys, ties broken by lower index, compacted in place at the front of `list` in
// ascending order. Returns the need-th largest key. `keys` is scratch.
template <class T>
abs_key_t<T> keep_top_of_list(std::span<const T> g, std::span<std::uint32_t> list, std::size_t need,
                              uninit_vector<abs_key_t<T>>& keys) {
  using key = abs_key_t<T>;
  const std::size_t m = list.size();
  ensure_size(keys, m);
  for (std::size_t i = 0; i < m; ++i) keys[i] = abs_key(g[list[i]]);
  auto first = keys.begin();
  std::nth_element(first, first + static_cast<std::ptrdiff_t>(need - 1),
                   first + static_cast<std::ptrdiff_t>(m), std::greater<key>{});
  const key kth = keys[need - 1];
  // After nth_element only the first need-1 keys can exceed the pivot.
  std::size_t greater = 0;
  for (std::size_t i = 0; i + 1 < need; ++i) greater += keys[i] > kth;
  std::size_t ties_left = need - greater;
  std::size_t w = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const key k = abs_key(g[list[i]]);
    if (k > kth || (k == kth && ties_left > 0)) {
      ties_left -= (k == kth);
      list[w++] = list[i];
    }
  }
  return kth;
}

// The same finish when the pass kept each candidate's key next to its index (keys[i] is the
// key of list[i]): no access to g at all, which for a candidate list spread over a large
// tensor saves a cache miss per candidate. `sorted` is scratch of at least list.size() keys.
template <class Key>
Key keep_top_by_keys(std::span<std::uint32_t> list, const Key* keys, std::size_t need,
                     Key* sorted) {
  const std::size_t m = list.size();
  std::copy_n(keys, m, sorted);
  std::nth_element(sorted, sorted + static_cast<std::ptrdiff_t>(need - 1),
                   sorted + static_cast<std::ptrdiff_t>(m), std::greater<Key>{});
  const Key kth = sorted[need - 1];
  std::size_t greater = 0;
  for (std::size_t i = 0; i + 1 < need; ++i) greater += sorted[i] > kth;
  std::size_t ties_left = need - greater;
  std::size_t w = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const Key k = keys[i];
    const bool tie = k == kth && ties_left > 0;
    list[w] = list[i];  // w <= i: a stale copy is overwritten or cut off by the final count
    w += (k > kth) | tie;
    ties_left -= tie;
  }
  return kth;
}

}  // namespace gradcomp::detail
