// gradcomp/detail/select/radix_select.hpp: the exact k-th largest key by radix select, and the
// k indices it implies; what exact top-k falls back to when its sampled bracket misses.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/scan.hpp>
#include <gradcomp/detail/select/scratch.hpp>

namespace gradcomp::detail {

// Radix select: the exact k-th largest key of g (1 <= k <= n), 11-bit digits from the most
// significant (3 passes for float keys, 6 for double). Robust against any distribution, ties
// included; the finish then takes every key above the k-th and the lowest-index ties.

template <class T>
struct radix_result {
  abs_key_t<T> kth = 0;   // the k-th largest key
  std::size_t above = 0;  // elements with a larger key (< k)
  unsigned passes = 0;    // histogram passes made
};

namespace radix {

inline constexpr unsigned buckets = 1u << radix_digit_bits;

// Picks the bucket holding the rank-th largest (1-based) of the counted keys, and turns
// rank into the rank within that bucket; adds the elements of higher buckets to `above`.
inline unsigned pick_bucket(const std::uint64_t* hist, unsigned width, std::size_t& rank,
                            std::size_t& above) {
  for (unsigned d = (1u << width); d-- > 0;) {
    if (hist[d] >= rank) return d;
    rank -= hist[d];
    above += hist[d];
  }
  check_invariant(false, "radix select: rank exceeds the element count");
  return 0;
}

// Counts per digit in four interleaved sub-histograms: with many equal keys (ties, zeros) a
// single counter would serialise the increments on store-to-load forwarding.
struct histogram {
  std::vector<std::uint32_t> sub = std::vector<std::uint32_t>(4 * buckets);
  std::vector<std::uint64_t> total = std::vector<std::uint64_t>(buckets);

  void clear() { std::fill(sub.begin(), sub.end(), 0u); }
  void add(std::size_t lane, unsigned digit) { ++sub[(lane & 3) * buckets + digit]; }
  // Folds the sub-histograms. Lanes rotate with the element position, so each sub-histogram
  // takes at most n/4 <= 2^30 counts per pass: uint32 cannot overflow.
  void fold() {
    for (unsigned d = 0; d < buckets; ++d) {
      total[d] =
          std::uint64_t{sub[d]} + sub[buckets + d] + sub[2 * buckets + d] + sub[3 * buckets + d];
    }
  }
};

}  // namespace radix

// Scans keys (from g or from the key list) in passes of one digit. A pass that narrows the
// candidates (the chosen bucket is not all of them) also copies the survivors' keys into the
// list, fused with the next digit's histogram; a pass that does not narrow (ties) only
// histograms. The first pass reads g; the second reads g again unless the first narrowed
// nothing; later passes read the shrinking list.
template <class T>
radix_result<T> radix_kth_largest(std::span<const T> g, std::size_t k,
                                  uninit_vector<abs_key_t<T>>& list) {
  using key = abs_key_t<T>;
  radix_result<T> res;
  const std::size_t n = g.size();
  const T* p = g.data();
  radix::histogram hist;
  std::size_t rank = k;
  std::size_t total = n;  // candidates: keys sharing the prefix fixed so far
  bool from_g = true;
  key prefix = 0;
  key fixed_mask = 0;  // bits of the prefix fixed so far
  unsigned remaining = abs_key_traits<T>::bits;
  unsigned width = std::min(radix_digit_bits, remaining);
  unsigned shift = remaining - width;

  // First digit: all of g counts.
  hist.clear();
  for (std::size_t i = 0; i < n; ++i) hist.add(i, radix_digit(abs_key(p[i]), shift, width));
  for (;;) {
    hist.fold();
    ++res.passes;
    const unsigned digit = radix::pick_bucket(hist.total.data(), width, rank, res.above);
    const std::uint64_t bucket = hist.total[digit];
    prefix = static_cast<key>(prefix | (key{digit} << shift));
    fixed_mask = static_cast<key>(fixed_mask | (((key{1} << width) - 1) << shift));
    remaining = shift;
    if (remaining == 0) break;
    width = std::min(radix_digit_bits, remaining);
    shift = remaining - width;
    hist.clear();
    if (bucket == total) {
      // Nothing narrowed: every candidate has the prefix; just count the next digit.
      if (from_g) {
        for (std::size_t i = 0; i < n; ++i) hist.add(i, radix_digit(abs_key(p[i]), shift, width));
      } else {
        for (std::size_t i = 0; i < total; ++i) hist.add(i, radix_digit(list[i], shift, width));
      }
      continue;
    }
    // Branchless compaction: every key is written at the end of the list and kept only if it
    // matches; the histogram gets +0 for the others. Buckets with a large share of g (ties at
    // the k-th value) would otherwise mispredict on every other element.
    std::size_t m = 0;
    auto keep = [&](key kk) {
      const bool match = (kk & fixed_mask) == prefix;
      hist.sub[(m & 3) * radix::buckets + radix_digit(kk, shift, width)] += match;
      list[m] = kk;
      m += match;
    };
    if (from_g) {
      ensure_size(list, static_cast<std::size_t>(bucket) + 1);
      for (std::size_t i = 0; i < n; ++i) keep(abs_key(p[i]));
      from_g = false;
    } else {
      for (std::size_t i = 0; i < total; ++i) keep(list[i]);
    }
    total = m;
  }
  res.kth = prefix;
  return res;
}

// Writes the k indices of largest key given the k-th largest key `kth` and the number of
// keys above it: every key > kth and the lowest-index (k - above) keys equal to kth; stops
// reading g once all k are found. `out` must hold k entries.
template <class T>
void take_top_by_kth(std::span<const T> g, abs_key_t<T> kth, std::size_t above, std::size_t k,
                     std::uint32_t* out) {
  using key = abs_key_t<T>;
  std::size_t ties_left = k - above;
  std::size_t w = 0;
  const T* p = g.data();
  const std::size_t n = g.size();
  const auto t = static_cast<signed_key_t<T>>(kth) - 1;  // blocks with a key >= kth
  for (std::size_t b = 0; b < n && w < k; b += scan_block) {
    const std::size_t e = std::min(n, b + scan_block);
    if (e - b == scan_block && !block_any_above(p + b, t)) continue;
    if (w + (e - b) <= k) {
      // Room for the whole block: branchless, as the take/skip pattern is data-dependent.
      for (std::size_t i = b; i < e; ++i) {
        const key kk = abs_key(p[i]);
        const bool tie = kk == kth && ties_left > 0;
        out[w] = static_cast<std::uint32_t>(i);
        w += (kk > kth) | tie;
        ties_left -= tie;
      }
    } else {
      for (std::size_t i = b; i < e && w < k; ++i) {
        const key kk = abs_key(p[i]);
        if (kk > kth || (kk == kth && ties_left > 0)) {
          ties_left -= (kk == kth);
          out[w++] = static_cast<std::uint32_t>(i);
        }
      }
    }
  }
  check_invariant(w == k, "radix select: final pass count differs from k");
}

}  // namespace gradcomp::detail
