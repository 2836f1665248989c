// gradcomp/detail/select/compaction.hpp: one pass that writes the indices of every |g| above a
// threshold, in ascending order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/scan.hpp>

namespace gradcomp::detail {

// Indices i with key(g[i]) > t, ascending, into `out` (resized to the count).
template <class T>
std::size_t collect_above(std::span<const T> g, signed_key_t<T> t,
                          std::vector<std::uint32_t>& out) {
  const T* p = g.data();
  std::size_t c = 0;
  if (out.size() < scan_block) out.resize(scan_block);
  for_blocks_above(g, t, [&](std::size_t b, std::size_t e) {
    if (c + scan_block > out.size()) out.resize(std::max(out.size() * 2, c + scan_block));
    std::uint32_t* o = out.data();
    for_each_above(p + b, e - b, t,
                   [&](std::size_t j, abs_key_t<T>) { o[c++] = static_cast<std::uint32_t>(b + j); });
  });
  out.resize(c);
  return c;
}

// Counts keys > t and, while the count stays within `cap`, writes their indices to `out`,
// which must hold cap + scan_block entries. Returns the count; `out` holds the selection
// exactly when the count is <= cap. This fuses "count" and "write" into one read for the
// adaptive-threshold selectors, whose final count is usually close to the target.
template <class T>
std::size_t count_collect_above(std::span<const T> g, signed_key_t<T> t, std::uint32_t* out,
                                std::size_t cap) {
  const T* p = g.data();
  std::size_t c = 0;
  for_blocks_above(g, t, [&](std::size_t b, std::size_t e) {
    if (c <= cap) {
      for_each_above(p + b, e - b, t, [&](std::size_t j, abs_key_t<T>) {
        out[c++] = static_cast<std::uint32_t>(b + j);
      });
    } else {
      for_each_above(p + b, e - b, t, [&](std::size_t, abs_key_t<T>) { ++c; });
    }
  });
  return c;
}

}  // namespace gradcomp::detail
