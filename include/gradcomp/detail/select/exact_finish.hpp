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

// The need-th largest (1 <= need <= m) of keys[0, m), by radix select: a histogram of the top
// 11 bits, the keys of the bucket that holds it copied to `scratch` (which may be `keys`
// itself: the copy never overtakes the read), and so on down the digits until few are left,
// then nth_element on those. Two short passes over the keys where nth_element on all of them
// makes about four with a branch each; the same key as nth_element, so the same selection.
// Also returns how many of the keys are larger than it (the buckets above, on the way down).
template <class Key>
struct kth_key {
  Key kth;
  std::size_t greater;  // keys > kth
};

template <class Key>
kth_key<Key> kth_largest_key(const Key* keys, std::size_t m, std::size_t need, Key* scratch) {
  constexpr unsigned digit_bits = 11;
  constexpr std::size_t buckets = std::size_t{1} << digit_bits;
  constexpr std::size_t small = 1024;  // below this, nth_element does it at once
  constexpr int key_bits = static_cast<int>(sizeof(Key) * 8);
  const Key* cur = keys;
  std::size_t count = m;
  std::size_t rank = need;  // 1-based, largest first, among cur[0, count)
  std::size_t above = 0;    // keys left behind in higher buckets
  int shift = key_bits - static_cast<int>(digit_bits);
  std::size_t hist[buckets];
  while (count > small) {
    std::fill(hist, hist + buckets, std::size_t{0});
    const auto digit = [shift](Key k) {
      return static_cast<std::size_t>(k >> shift) & (buckets - 1);
    };
    for (std::size_t i = 0; i < count; ++i) ++hist[digit(cur[i])];
    std::size_t b = buckets - 1;
    while (hist[b] < rank) {
      rank -= hist[b];
      above += hist[b--];
    }
    const std::size_t in_bucket = hist[b];
    if (in_bucket != count) {
      std::size_t w = 0;
      for (std::size_t i = 0; i < count; ++i) {
        const Key k = cur[i];
        scratch[w] = k;
        w += digit(k) == b;
      }
      cur = scratch;
      count = in_bucket;
    }
    if (shift == 0) return {cur[0], above};  // every digit taken: the keys left are equal
    shift = shift > static_cast<int>(digit_bits) ? shift - static_cast<int>(digit_bits) : 0;
  }
  if (cur != scratch) std::copy_n(cur, count, scratch);
  std::nth_element(scratch, scratch + static_cast<std::ptrdiff_t>(rank - 1),
                   scratch + static_cast<std::ptrdiff_t>(count), std::greater<Key>{});
  const Key kth = scratch[rank - 1];
  // After nth_element only the first rank - 1 keys can exceed it.
  for (std::size_t i = 0; i + 1 < rank; ++i) above += scratch[i] > kth;
  return {kth, above};
}

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
  const auto [kth, greater] = kth_largest_key(keys.data(), m, need, keys.data());
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
  const auto [kth, greater] = kth_largest_key(keys, m, need, sorted);
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
