// gradcomp/detail/rank_mean.hpp: the dense mean of P ranks' sparse contributions, added in rank
// order, region by region: the local work of sparse_allgather (every rank's payload into the
// whole tensor) and of topk_a2a (every rank's pairs of one shard into it).
//
// The textbook way (zero the output, add each rank's pairs at their indices, divide the whole
// output by P) touches a vector the caches cannot hold three times, and every pair is a cache
// miss. Each rank's indices are strictly increasing, so the pairs of one region of the output
// are a contiguous stretch of each rank's list: a region of 64 KiB is zeroed, given every
// rank's stretch in rank order and divided while it stays in the cache, then written out once
// (with streaming stores, docs/performance.md). Every element gets the same additions in the
// same order as the textbook way, and the same division, so the result is bit for bit the same.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <gradcomp/detail/stream_store.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp::detail {

// One rank's contribution: `count` values at strictly increasing indices, or (is_dense) a
// dense one, value j at index j of the output's range (index unused).
struct rank_values {
  const std::uint32_t* index = nullptr;
  const float* value = nullptr;
  std::size_t count = 0;
  bool is_dense = false;

  [[nodiscard]] bool dense() const noexcept { return is_dense; }
  [[nodiscard]] std::uint64_t index_at(std::size_t j) const noexcept { return index[j]; }
  [[nodiscard]] float value_at(std::size_t j) const noexcept { return value[j]; }
};

// One rank's (index, value) pairs at strictly increasing indices (topk_a2a's received pairs).
struct rank_pairs {
  const index_value* pairs = nullptr;
  std::size_t count = 0;

  [[nodiscard]] static constexpr bool dense() noexcept { return false; }
  [[nodiscard]] std::uint64_t index_at(std::size_t j) const noexcept { return pairs[j].index; }
  [[nodiscard]] float value_at(std::size_t j) const noexcept { return pairs[j].value; }
};

// Elements of one region: 64 KiB, which the private caches hold with room for the runs.
template <class T>
inline constexpr std::size_t rank_mean_region = (std::size_t{64} << 10) / sizeof(T);

// out[i] = (0 + v_0(i) + v_1(i) + ... + v_{P-1}(i)) / P for every i, v_r(i) rank r's value at
// index first + i (0 where it has none), P = runs.size() >= 1, added in rank order in T. Every
// run's indices must be strictly increasing and inside [first, first + out.size()), a dense
// run must hold out.size() values: the callers validate them. `cursor` is scratch.
template <class T, class Run>
void rank_order_mean(std::span<T> out, std::uint64_t first, std::span<const Run> runs,
                     std::vector<std::size_t>& cursor) {
  constexpr std::size_t region = rank_mean_region<T>;
  const std::size_t n = out.size();
  const std::size_t ranks = runs.size();
  cursor.assign(ranks, 0);
  // Beyond the caches the region is built in a cached buffer and streamed out; a smaller
  // output is built in place and stays cached for the caller.
  const bool stream = n * sizeof(T) >= stream_min_bytes;
  // The buffer's first element sits half a page from the output's in address bits 0-11, so
  // that no load of the copy out can look to the CPU as if it depended on the streaming store
  // just before it (4K aliasing): with it exchange_local/sparse_allgather at P = 16 took
  // 4.5-4.9 ms against 6.2-6.4 without it, in one binary (docs/performance.md).
  constexpr std::size_t page = 4096;
  thread_local std::vector<T> buffer;
  T* staged = nullptr;
  if (stream) {
    buffer.resize(region + page / sizeof(T));
    const auto from = reinterpret_cast<std::uintptr_t>(buffer.data());
    const auto to = reinterpret_cast<std::uintptr_t>(out.data()) + page / 2;
    staged = buffer.data() + ((to - from) % page) / sizeof(T);
  }
  // x / P. For P a power of two, x * (1 / P) is the same number (both are x 2^-m rounded once)
  // and a vector multiply, done on every element as the region is written out. Otherwise a
  // division, several times dearer than the memory traffic per element: only the elements a
  // sparse run touched are divided (0 / P is 0), unless so many were touched (one in eight)
  // that the vector loop over the region is cheaper.
  const T divisor = static_cast<T>(ranks);
  const bool by_reciprocal = std::has_single_bit(ranks);
  const T reciprocal = T(1) / divisor;
  std::uint64_t touched[region / 64];  // which elements of the region a sparse run added to
  for (std::size_t begin = 0; begin < n; begin += region) {
    const std::size_t len = std::min(region, n - begin);
    T* const r = stream ? staged : out.data() + begin;
    std::fill(r, r + len, T(0));
    if (!by_reciprocal) std::fill(touched, touched + (len + 63) / 64, std::uint64_t{0});
    const std::uint64_t end = first + begin + len;
    std::size_t added = 0;
    bool every = false;  // a dense run: every element was added to
    for (std::size_t k = 0; k < ranks; ++k) {
      const Run& run = runs[k];
      if (run.dense()) {
        for (std::size_t i = 0; i < len; ++i) r[i] += static_cast<T>(run.value_at(begin + i));
        every = true;
        continue;
      }
      std::size_t j = cursor[k];
      const std::size_t from = j;
      for (; j < run.count; ++j) {
        const std::uint64_t at = run.index_at(j);
        if (at >= end) break;
        const auto i = static_cast<std::size_t>(at - first - begin);
        r[i] += static_cast<T>(run.value_at(j));
        if (!by_reciprocal) touched[i / 64] |= std::uint64_t{1} << (i % 64);
      }
      added += j - from;
      cursor[k] = j;
    }
    if (by_reciprocal) {
      if (stream) {
        stream_scaled(out.data() + begin, r, len, reciprocal);
        continue;
      }
      for (std::size_t i = 0; i < len; ++i) r[i] *= reciprocal;
    } else if (every || added * 8 > len) {
      for (std::size_t i = 0; i < len; ++i) r[i] /= divisor;
    } else {
      for (std::size_t w = 0; w < (len + 63) / 64; ++w) {
        for (std::uint64_t b = touched[w]; b != 0; b &= b - 1) {
          r[w * 64 + static_cast<std::size_t>(std::countr_zero(b))] /= divisor;
        }
      }
    }
    if (stream) stream_copy(out.data() + begin, static_cast<const T*>(r), len);
  }
  if (stream) stream_fence();
}

}  // namespace gradcomp::detail
