// gradcomp/cuda/kernels/list_select_kernels.cuh: the k-th largest key of a list in device
// memory (the topk's sample and its candidates) by many blocks: one launch per radix pass
// (11-bit digits from the top, as block_radix_select and the host), each block adding the
// digits of its share of the list to a shared histogram, then to the pass's global histogram,
// and the last block to finish (a ticket counter after a fence) picking the digit for the next
// pass. Up to two selects run in the same passes (the bracket's lo and hi), each with its
// prefix, rank and histogram. A single block (what the bracket and the finish used before)
// streams the list through one SM; this spreads it over the device at the price of a launch
// per pass instead of one for all.
//
// The list comes from a Source: which() (bit a: select a runs), active(st) (false: every block
// returns at once, the pipeline took another path), count(st), load(i, pass) (the key of item
// i; the sample's first pass reads g and writes the sample), initial_rank(st, a) (1-based) and
// end(st, ls), which every thread of the last block calls after the last pass.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>

#include <gradcomp/cuda/block/select_block.cuh>
#include <gradcomp/cuda/kernels/select_state.cuh>
#include <gradcomp/detail/radix_digits.hpp>
#include <gradcomp/detail/select/keys.hpp>

namespace gradcomp::cuda::select_impl {

// Two selects' progress, in device memory, zeroed before the first pass.
template <class Key>
struct list_select {
  Key prefix[2];
  Key mask[2];
  unsigned long long rank[2];   // within the keys that match prefix under mask
  unsigned long long above[2];  // keys above the prefix's range
  unsigned long long equal[2];  // keys equal to the k-th (after the last pass)
  unsigned blocks_done;         // the ticket counter of the pass in flight
};

// The global histograms of one call: passes * 2 selects * Buckets counters (zeroed), 64-bit:
// a candidate list may hold every one of 2^32 elements (a constant gradient puts all of them
// in the bracket), all in one bucket. A block's shared counters stay 32-bit (a block's share
// is far smaller).
using list_count = unsigned long long;

template <unsigned Buckets>
__device__ __forceinline__ list_count* list_hist(list_count* base, unsigned pass, int a) {
  return base + (static_cast<std::size_t>(pass) * 2u + static_cast<unsigned>(a)) * Buckets;
}

template <class T, int Threads, unsigned Buckets, class Source>
__global__ void __launch_bounds__(Threads)
    list_pass_kernel(Source src, select_state<T>* st, list_select<detail::abs_key_t<T>>* ls,
                     unsigned pass, list_count* hist_base) {
  using key = detail::abs_key_t<T>;
  using scan_t = cub::BlockScan<unsigned long long, Threads>;
  static_assert(Buckets % Threads == 0);
  constexpr unsigned per_thread = Buckets / Threads;
  constexpr unsigned bits = detail::abs_key_traits<T>::bits;
  constexpr unsigned passes = detail::radix_passes(bits);
  __shared__ unsigned sh[2][Buckets];
  __shared__ typename scan_t::TempStorage scan_sm;
  __shared__ bool last;
  __shared__ unsigned pick_digit[2];
  __shared__ unsigned long long pick_rank[2];
  __shared__ unsigned long long pick_above[2];
  __shared__ unsigned long long pick_equal[2];
  if (!src.active(st)) return;
  const unsigned which = src.which();
  const std::size_t count = src.count(st);
  key prefix[2];
  key mask[2];
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    prefix[a] = ls->prefix[a];
    mask[a] = ls->mask[a];
    for (unsigned b = threadIdx.x; b < Buckets; b += Threads) sh[a][b] = 0;
  }
  __syncthreads();
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * Threads;
  // Uniform trip count within a warp (warp_hist_add needs all 32 lanes).
  for (std::size_t base = static_cast<std::size_t>(blockIdx.x) * Threads; base < count;
       base += stride) {
    const std::size_t i = base + threadIdx.x;
    const bool in = i < count;
    const key kk = in ? src.load(i, pass) : key{0};
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      if ((which >> a) & 1u) {  // uniform
        const bool valid = in && detail::radix_matches(kk, prefix[a], mask[a]);
        warp_hist_add(sh[a], valid ? detail::radix_pass_digit(kk, bits, pass) : 0u, valid);
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    if ((which >> a) & 1u) {
      list_count* g = list_hist<Buckets>(hist_base, pass, a);
      for (unsigned b = threadIdx.x; b < Buckets; b += Threads) {
        if (sh[a][b] != 0u) atomicAdd(&g[b], static_cast<list_count>(sh[a][b]));
      }
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&ls->blocks_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // The last block: the digit of each select, as block_radix_select picks it.
  for (int a = 0; a < 2; ++a) {
    if (((which >> a) & 1u) == 0u) continue;
    const list_count* g = list_hist<Buckets>(hist_base, pass, a);
    const unsigned long long rank = pass == 0 ? src.initial_rank(st, a) : ls->rank[a];
    const unsigned long long above = ls->above[a];
    if (threadIdx.x == 0) {
      pick_digit[a] = 0;  // stays 0 only if the invariant 1 <= rank <= matching keys breaks
      pick_rank[a] = rank;
      pick_above[a] = above;
      pick_equal[a] = 0;
    }
    __syncthreads();
    const unsigned hi_bucket = Buckets - threadIdx.x * per_thread;  // thread 0: the top
    unsigned long long sum = 0;
    for (unsigned j = 0; j < per_thread; ++j) sum += __ldcg(&g[hi_bucket - 1 - j]);
    unsigned long long before = 0;
    scan_t(scan_sm).ExclusiveSum(sum, before);
    if (before < rank && rank <= before + sum) {
      unsigned long long r = rank - before;
      unsigned long long ab = above + before;
      for (unsigned j = 0; j < per_thread; ++j) {
        const unsigned d = hi_bucket - 1 - j;
        const unsigned long long h = __ldcg(&g[d]);
        if (h >= r) {
          pick_digit[a] = d;
          pick_equal[a] = h;
          break;
        }
        r -= h;
        ab += h;
      }
      pick_rank[a] = r;
      pick_above[a] = ab;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      ls->prefix[a] = static_cast<key>(prefix[a] | (static_cast<key>(pick_digit[a])
                                                    << detail::radix_shift(bits, pass)));
      ls->mask[a] = detail::radix_fixed_mask<key>(bits, pass);
      ls->rank[a] = pick_rank[a];
      ls->above[a] = pick_above[a];
      ls->equal[a] = pick_equal[a];
    }
    __syncthreads();  // scan_sm is reused by the next select
  }
  if (threadIdx.x == 0) ls->blocks_done = 0;  // for the next pass
  if (pass + 1 == passes) {
    __threadfence_block();
    __syncthreads();
    src.end(st, ls);
  }
}

}  // namespace gradcomp::cuda::select_impl
