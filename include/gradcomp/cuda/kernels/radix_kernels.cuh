// gradcomp/cuda/kernels/radix_kernels.cuh: the radix select over all values (a histogram per
// digit, one block picking it) and the ordered take (every key above the k-th, ties by lowest
// index, in index order).
// (kernels/select_kernels.cuh says how the selection's kernels work together.)
#pragma once

#include <gradcomp/cuda/kernels/select_state.cuh>

namespace gradcomp::cuda::select_impl {

// ---------------------------------------------------------------------------------------
// Radix select over all values (gate mode_radix): per pass a histogram of the digit of the
// keys that match the prefix (filter and histogram fused), then one block picks the digit.

template <class T, class Values, int Threads, int Items, unsigned Buckets>
__global__ void __launch_bounds__(Threads)
    radix_hist_kernel(Values vals, std::size_t n, const select_state<T>* st, unsigned pass,
                      unsigned long long* hist) {
  using key = detail::abs_key_t<T>;
  __shared__ unsigned sh[Buckets];
  if (!gate_open(st, mode_radix)) return;
  const key prefix = st->prefix;
  const key mask = st->mask;
  constexpr unsigned bits = detail::abs_key_traits<T>::bits;
  for (unsigned b = threadIdx.x; b < Buckets; b += Threads) sh[b] = 0;
  __syncthreads();
  constexpr std::size_t tile = static_cast<std::size_t>(Threads) * Items;
  for (std::size_t tile0 = blockIdx.x * tile; tile0 < n; tile0 += gridDim.x * tile) {
    key keys[Items];
#pragma unroll
    for (int r = 0; r < Items; ++r) {  // all loads first, then the counting
      const std::size_t i = tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x;
      keys[r] = i < n ? detail::abs_key(vals.load(i)) : key{0};
    }
#pragma unroll
    for (int r = 0; r < Items; ++r) {
      const std::size_t i = tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x;
      const bool valid = i < n && detail::radix_matches(keys[r], prefix, mask);
      warp_hist_add(sh, valid ? detail::radix_pass_digit(keys[r], bits, pass) : 0u, valid);
    }
  }
  __syncthreads();
  for (unsigned b = threadIdx.x; b < Buckets; b += Threads) {
    if (sh[b]) atomicAdd(&hist[b], static_cast<unsigned long long>(sh[b]));
  }
}

// Picks the digit of pass `pass` from the global histogram (one block): the bucket holding
// the rank-th largest of the matching keys. After the last pass, the take's kth and ties.
template <class T, int Threads, unsigned Buckets>
__global__ void __launch_bounds__(Threads)
    radix_pick_kernel(const unsigned long long* hist, unsigned pass, select_state<T>* st) {
  using key = detail::abs_key_t<T>;
  using scan_t = cub::BlockScan<unsigned long long, Threads>;
  constexpr unsigned per = Buckets / Threads;
  constexpr unsigned bits = detail::abs_key_traits<T>::bits;
  __shared__ typename scan_t::TempStorage scan_sm;
  if (!gate_open(st, mode_radix)) return;
  // Every thread reads what it needs of *st now; one thread rewrites it below, after an
  // explicit barrier (not only the one inside the scan, which a smaller block may not have).
  const unsigned long long rank = st->rank;
  const unsigned long long above_in = st->above;
  const key prefix_in = st->prefix;
  const unsigned hi_bucket = Buckets - threadIdx.x * per;
  unsigned long long sum = 0;
  for (unsigned j = 0; j < per; ++j) sum += hist[hi_bucket - 1 - j];
  unsigned long long before = 0;
  scan_t(scan_sm).ExclusiveSum(sum, before);
  __syncthreads();
  if (before < rank && rank <= before + sum) {
    unsigned long long r = rank - before;
    unsigned long long a = above_in + before;
    unsigned digit = hi_bucket - 1;
    for (unsigned j = 0; j < per; ++j) {
      const unsigned d = hi_bucket - 1 - j;
      if (hist[d] >= r) {
        digit = d;
        break;
      }
      r -= hist[d];
      a += hist[d];
    }
    const key prefix =
        static_cast<key>(prefix_in | (static_cast<key>(digit) << detail::radix_shift(bits, pass)));
    st->prefix = prefix;
    st->mask = detail::radix_fixed_mask<key>(bits, pass);
    st->rank = r;
    st->above = a;
    if (pass + 1 == detail::radix_passes(bits)) {
      st->kth = static_cast<detail::signed_key_t<T>>(prefix);
      st->ties = r;
    }
  }
}

// ---------------------------------------------------------------------------------------
// The ordered take: every key > kth and the first `ties` keys == kth, written in index order
// (so sorted) from per-tile counts, their scan, and a compaction per tile.

// Per tile: counts of keys > kth and == kth (gate bits `gate`).
template <class T, class Values, int Threads, int Items>
__global__ void __launch_bounds__(Threads)
    take_count_kernel(Values vals, std::size_t n, const select_state<T>* st, unsigned gate,
                      unsigned* tile_counts) {
  using skey = detail::signed_key_t<T>;
  using reduce_t = cub::BlockReduce<unsigned, Threads>;
  __shared__ typename reduce_t::TempStorage reduce_sm;
  if (!gate_open(st, gate)) return;
  const skey kth = st->kth;
  constexpr std::size_t tile_size = static_cast<std::size_t>(Threads) * Items;
  const std::size_t tiles = (n + tile_size - 1) / tile_size;
  for (std::size_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {  // uniform per block
    const std::size_t tile0 = tile * tile_size;
    unsigned mine = 0;  // ties << 16 | greater
#pragma unroll
    for (int r = 0; r < Items; ++r) {
      const std::size_t i = tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x;
      if (i < n) {
        const skey kk = detail::signed_abs_key(vals.load(i));
        mine += (kk > kth) + (static_cast<unsigned>(kk == kth) << 16);
      }
    }
    const unsigned total = reduce_t(reduce_sm).Sum(mine);
    if (threadIdx.x == 0) {
      tile_counts[2 * tile] = total & 0xffffu;
      tile_counts[2 * tile + 1] = total >> 16;
    }
    __syncthreads();  // reduce_sm is reused by the next tile
  }
}

// One block: exclusive scans of the tile counts into each tile's output base and tie base;
// state->count = all keys > kth + min(ties, keys == kth).
template <class T, int Threads>
__global__ void __launch_bounds__(Threads)
    take_scan_kernel(const unsigned* tile_counts, std::size_t tiles, select_state<T>* st,
                     unsigned gate, unsigned long long* bases) {
  using scan_t = cub::BlockScan<unsigned long long, Threads>;
  __shared__ typename scan_t::TempStorage scan_sm;
  __shared__ unsigned long long carry[2];
  if (!gate_open(st, gate)) return;
  const unsigned long long m = st->ties;
  if (threadIdx.x == 0) carry[0] = carry[1] = 0;
  __syncthreads();
  for (std::size_t t0 = 0; t0 < tiles; t0 += Threads) {
    const std::size_t t = t0 + threadIdx.x;
    const unsigned long long g = t < tiles ? tile_counts[2 * t] : 0ull;
    const unsigned long long e = t < tiles ? tile_counts[2 * t + 1] : 0ull;
    unsigned long long ge = 0;
    unsigned long long ee = 0;
    unsigned long long gsum = 0;
    unsigned long long esum = 0;
    scan_t(scan_sm).ExclusiveSum(g, ge, gsum);
    __syncthreads();
    scan_t(scan_sm).ExclusiveSum(e, ee, esum);
    const unsigned long long gb = carry[0] + ge;
    const unsigned long long eb = carry[1] + ee;
    if (t < tiles) {
      bases[2 * t] = gb + (eb < m ? eb : m);
      bases[2 * t + 1] = eb;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry[0] += gsum;
      carry[1] += esum;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) st->count = carry[0] + (carry[1] < m ? carry[1] : m);
}

// One tile of take_write_kernel (every thread of the block calls it).
template <class T, class Values, int Threads, int Items>
__device__ __forceinline__ void write_tile(Values vals, std::size_t n, detail::signed_key_t<T> kth,
                                           unsigned long long m, unsigned long long out_base,
                                           unsigned long long tie_base, std::size_t tile0,
                                           typename tile_compaction<Threads, Items>::storage& sm,
                                           std::uint32_t* out, std::size_t cap) {
  using skey = detail::signed_key_t<T>;
  using compaction = tile_compaction<Threads, Items>;
  bool greater[Items];
  bool tie[Items];
#pragma unroll
  for (int r = 0; r < Items; ++r) {
    const std::size_t i = tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x;
    greater[r] = false;
    tie[r] = false;
    if (i < n) {
      const skey kk = detail::signed_abs_key(vals.load(i));
      greater[r] = kk > kth;
      tie[r] = kk == kth;
    }
  }
  unsigned pos[Items];
  if (tie_base < m) {  // ties of this tile may be taken: rank them
    compaction::rank(sm, tie, pos);
#pragma unroll
    for (int r = 0; r < Items; ++r) greater[r] = greater[r] || (tie[r] && tie_base + pos[r] < m);
  }
  compaction::rank(sm, greater, pos);
#pragma unroll
  for (int r = 0; r < Items; ++r) {
    if (greater[r]) {
      const unsigned long long p = out_base + pos[r];
      if (p < cap) {
        out[p] =
            static_cast<std::uint32_t>(tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x);
      }
    }
  }
}

// Per tile: the ranks of its ties, which of them are taken, and the positions of all taken
// elements, both in index order; out[position] = index where position < cap.
template <class T, class Values, int Threads, int Items>
__global__ void __launch_bounds__(Threads)
    take_write_kernel(Values vals, std::size_t n, const select_state<T>* st, unsigned gate,
                      const unsigned long long* bases, std::uint32_t* out, std::size_t cap) {
  using skey = detail::signed_key_t<T>;
  using compaction = tile_compaction<Threads, Items>;
  __shared__ typename compaction::storage sm;
  if (!gate_open(st, gate)) return;
  const skey kth = st->kth;
  const unsigned long long m = st->ties;
  constexpr std::size_t tile_size = static_cast<std::size_t>(Threads) * Items;
  const std::size_t tiles = (n + tile_size - 1) / tile_size;
  for (std::size_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {  // uniform per block
    write_tile<T, Values, Threads, Items>(vals, n, kth, m, bases[2 * tile], bases[2 * tile + 1],
                                          tile * tile_size, sm, out, cap);
  }
}

// Stats of a radix-path top-k (gate mode_radix): count k, the k-th key's magnitude.
template <class T>
__global__ void radix_stats_kernel(const select_state<T>* st, unsigned long long k,
                                   unsigned iterations, unsigned fallback_iterations,
                                   selection_stats* stats) {
  if (threadIdx.x != 0 || blockIdx.x != 0 || !gate_open(st, mode_radix)) return;
  stats->count = k;
  stats->threshold =
      static_cast<double>(detail::key_magnitude<T>(static_cast<detail::abs_key_t<T>>(st->kth)));
  stats->iterations = st->fallback ? fallback_iterations : iterations;
  stats->fallback = st->fallback != 0;
  stats->energy = not_measured();  // the device passes do not add it up
}

}  // namespace gradcomp::cuda::select_impl
