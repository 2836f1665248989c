// gradcomp/cuda/block/select_block.cuh: the block-level primitives of the selection kernels:
//  - tile_compaction: the output positions of flagged elements of a tile in index order, from
//    one warp ballot per row and a scan over the (row, warp) counts (two barriers a tile);
//  - block_radix_select: the k-th largest key of a list held in global memory, by one block,
//    11-bit digits from the top, the digit picked by a block scan over the histogram.
// The per-element math (digits, prefixes, picks) is in detail/radix_digits.hpp.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>

#include <gradcomp/detail/radix_digits.hpp>

namespace gradcomp::cuda::select_impl {

inline constexpr unsigned full_warp = 0xffffffffu;

__device__ __forceinline__ unsigned lanemask_lt() { return (1u << (threadIdx.x & 31u)) - 1u; }

// hist[digit] += 1 for the lanes with `valid`, one atomic per distinct digit of the warp:
// keys near the k-th share their top digits (and ties, zeros share all), so per-lane atomics
// would serialise on one counter. Call it from all 32 lanes of the warp. Count is unsigned or
// unsigned long long (a list that may hold 2^32 items).
template <class Count>
__device__ __forceinline__ void warp_hist_add(Count* hist, unsigned digit, bool valid) {
  const unsigned active = __ballot_sync(full_warp, valid);
  if (!valid) return;
  const unsigned peers = __match_any_sync(active, digit);
  if ((threadIdx.x & 31u) == static_cast<unsigned>(__ffs(peers) - 1)) {
    atomicAdd(&hist[digit], static_cast<Count>(__popc(peers)));
  }
}

// A position in an output list for each lane with `take`, one atomic per warp; returns
// the lane's position (valid where take). Call it from all 32 lanes of the warp. Count as for
// warp_hist_add: 64 bits for a list whose length may reach 2^32.
template <class Count>
__device__ __forceinline__ Count warp_append(Count* counter, bool take) {
  const unsigned ballot = __ballot_sync(full_warp, take);
  Count base = 0;
  if ((threadIdx.x & 31u) == 0 && ballot != 0) base = atomicAdd(counter, static_cast<Count>(__popc(ballot)));
  base = __shfl_sync(full_warp, base, 0);
  return base + static_cast<Count>(__popc(ballot & lanemask_lt()));
}

// Positions of the flagged elements of a tile of Items rows of Threads elements (row r, thread
// t is element r * Threads + t of the tile), counted in index order. Every thread calls
// rank() with its flags; the result for its row r is pos[r] (valid where flags[r]) and the
// tile's total.
template <int Threads, int Items>
struct tile_compaction {
  static constexpr int warps = Threads / 32;
  static constexpr int slots = Items * warps;  // (row, warp) counts in index order
  static constexpr int per_lane = (slots + 31) / 32;

  struct storage {
    unsigned counts[slots];
    unsigned total;
  };

  // Contains two __syncthreads(); call it from every thread of the block.
  __device__ static unsigned rank(storage& sm, const bool (&flags)[Items], unsigned (&pos)[Items]) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    unsigned ballots[Items];
#pragma unroll
    for (int r = 0; r < Items; ++r) {
      ballots[r] = __ballot_sync(full_warp, flags[r]);
      if (lane == 0) sm.counts[r * warps + warp] = static_cast<unsigned>(__popc(ballots[r]));
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l scans slots [l * per_lane, (l + 1) * per_lane) after the lanes before it.
      unsigned local[per_lane];
      unsigned sum = 0;
#pragma unroll
      for (int j = 0; j < per_lane; ++j) {
        const int s = static_cast<int>(lane) * per_lane + j;
        local[j] = s < slots ? sm.counts[s] : 0u;
        sum += local[j];
      }
      unsigned incl = sum;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const unsigned y = __shfl_up_sync(full_warp, incl, d);
        if (static_cast<int>(lane) >= d) incl += y;
      }
      unsigned run = incl - sum;
#pragma unroll
      for (int j = 0; j < per_lane; ++j) {
        const int s = static_cast<int>(lane) * per_lane + j;
        if (s < slots) sm.counts[s] = run;
        run += local[j];
      }
      if (lane == 31) sm.total = incl;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < Items; ++r) {
      pos[r] =
          sm.counts[r * warps + warp] + static_cast<unsigned>(__popc(ballots[r] & lanemask_lt()));
    }
    const unsigned total = sm.total;
    __syncthreads();  // sm may be reused by the caller's next call
    return total;
  }
};

// The rank-th largest (1-based) key among the items of a list, by one block of Threads
// threads. item(i) for i < count returns true and sets the key when item i takes part. Result:
// kth, the number of items above it, the rank of the k-th within the items equal to kth
// (= how many of those equal items the top `rank` take) and how many items equal kth. Counts
// are 64-bit: a candidate list may hold every one of 2^32 elements (a constant gradient puts
// all of them in the bracket). The items are read in batches of Batch per thread, loads
// first, so that one thread's loads overlap.
template <int Threads, unsigned Buckets, int Batch = 8>
struct block_radix_select {
  static_assert(Buckets % Threads == 0);
  static constexpr unsigned per_thread = Buckets / Threads;
  using count_t = unsigned long long;
  using scan_t = cub::BlockScan<count_t, Threads>;

  struct storage {
    count_t hist[Buckets];
    typename scan_t::TempStorage scan;
    unsigned digit;
    count_t equal;
    unsigned long long rank;
    unsigned long long above;
  };

  template <class Key>
  struct result {
    Key kth;
    unsigned long long above;
    unsigned long long tie_rank;
    unsigned long long equal;
  };

  template <class Key, class Item>
  __device__ static result<Key> run(storage& sm, unsigned bits, std::size_t count, Item item,
                                    unsigned long long rank) {
    Key prefix = 0;
    Key mask = 0;
    unsigned long long above = 0;
    unsigned long long equal = 0;
    const unsigned passes = detail::radix_passes(bits);
    for (unsigned p = 0; p < passes; ++p) {
      for (unsigned b = threadIdx.x; b < Buckets; b += Threads) sm.hist[b] = 0;
      if (threadIdx.x == 0) {
        sm.digit = 0;  // stays 0 only if the invariant rank <= count breaks
        sm.equal = 0;
        sm.rank = rank;
        sm.above = above;
      }
      __syncthreads();
      for (std::size_t base = 0; base < count; base += std::size_t{Threads} * Batch) {
        Key keys[Batch];
        bool ok[Batch];
#pragma unroll
        for (int u = 0; u < Batch; ++u) {
          const std::size_t i = base + static_cast<std::size_t>(u) * Threads + threadIdx.x;
          ok[u] = i < count && item(i, keys[u]);
        }
#pragma unroll
        for (int u = 0; u < Batch; ++u) {
          const bool valid = ok[u] && detail::radix_matches(keys[u], prefix, mask);
          warp_hist_add(sm.hist, valid ? detail::radix_pass_digit(keys[u], bits, p) : 0u, valid);
        }
      }
      __syncthreads();
      // Thread t owns the buckets [Buckets - (t + 1) per, Buckets - t per): thread 0 the top.
      const unsigned hi_bucket = Buckets - threadIdx.x * per_thread;  // one past its top
      count_t sum = 0;
      for (unsigned j = 0; j < per_thread; ++j) sum += sm.hist[hi_bucket - 1 - j];
      count_t before = 0;
      scan_t(sm.scan).ExclusiveSum(sum, before);
      if (before < rank && rank <= before + sum) {
        unsigned long long r = rank - before;
        unsigned long long a = above + before;
        for (unsigned j = 0; j < per_thread; ++j) {
          const unsigned d = hi_bucket - 1 - j;
          if (sm.hist[d] >= r) {
            sm.digit = d;
            sm.equal = sm.hist[d];
            break;
          }
          r -= sm.hist[d];
          a += sm.hist[d];
        }
        sm.rank = r;
        sm.above = a;
      }
      __syncthreads();
      const unsigned digit = sm.digit;
      equal = sm.equal;
      rank = sm.rank;
      above = sm.above;
      prefix = static_cast<Key>(prefix | (static_cast<Key>(digit) << detail::radix_shift(bits, p)));
      mask = detail::radix_fixed_mask<Key>(bits, p);
      __syncthreads();  // everyone has read sm before the next pass clears it
    }
    return {prefix, above, rank, equal};
  }
};

}  // namespace gradcomp::cuda::select_impl
