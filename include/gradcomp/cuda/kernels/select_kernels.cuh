// gradcomp/cuda/kernels/select_kernels.cuh: the kernels of the device selectors. Tile kernels
// (one tile of threads * items consecutive elements per block) read g once each; single-block
// kernels work on short lists (the sample, the candidates, per-tile counts, histograms) and
// make the decisions the host selectors make between passes, so no pass waits for the host.
// Every kernel after the first reads the pipeline's select_state in device memory; a kernel
// whose gate bits are not set in state->mode returns at once (the paths not taken cost a
// launch each, not a read of g).
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>

#include <gradcomp/context.hpp>
#include <gradcomp/cuda/block/select_block.cuh>
#include <gradcomp/cuda/block/sparse_common.cuh>
#include <gradcomp/detail/radix_digits.hpp>
#include <gradcomp/detail/select/bracket.hpp>
#include <gradcomp/detail/select/gaussian_search.hpp>
#include <gradcomp/detail/select/keys.hpp>

namespace gradcomp::cuda::select_impl {

// Gate bits of select_state::mode.
inline constexpr unsigned mode_radix = 1;  // the radix select over all of g, then its take
inline constexpr unsigned mode_count = 2;  // Gaussian-k's counting passes
inline constexpr unsigned mode_write =
    4;  // the ordered write of "key > kth" (threshold, Gaussian-k)

// The state of one selection, in device memory (zeroed, then set by init_kernel).
template <class T>
struct select_state {
  using key = detail::abs_key_t<T>;
  using skey = detail::signed_key_t<T>;
  unsigned mode;
  unsigned fallback;
  // topk bracket: [lo, hi] and what the filter pass found (tail: past the last full 32-block)
  key lo;
  key hi;
  unsigned long long n_sure;
  unsigned long long n_cand;
  unsigned long long n_sure_tail;
  unsigned long long n_cand_tail;
  // radix select: digits fixed so far, rank within them, count above them
  key prefix;
  key mask;
  unsigned long long rank;
  unsigned long long above;
  // the ordered take: key > kth, plus the first `ties` keys == kth in index order
  skey kth;
  unsigned long long ties;
  unsigned long long count;  // how many the take selects
  // Gaussian-k
  double shift;
  double mean;
  double sd;
  double thr;
  detail::gaussian_bracket bracket;  // the banded search's closest thresholds either side
  unsigned iterations;
  unsigned last;
};

// selection_stats::energy where the device does not measure it: NaN.
__device__ __forceinline__ double not_measured() {
  return __longlong_as_double(static_cast<long long>(0x7ff8000000000000ULL));
}

// The values a pass reads: g, or e + g (select_accumulate). load() only reads; load_store()
// also stores e = e + g, which only the one pass that owns the accumulation calls.
template <class T>
struct read_values {
  const T* g;
  __device__ __forceinline__ T load(std::size_t i) const { return g[i]; }
  __device__ __forceinline__ T load_store(std::size_t i) const { return g[i]; }
};

template <class T>
struct accumulate_values {
  T* e;
  const T* g;
  __device__ __forceinline__ T load(std::size_t i) const { return e[i] + g[i]; }
  __device__ __forceinline__ T load_store(std::size_t i) const {
    const T v = e[i] + g[i];
    e[i] = v;
    return v;
  }
};

template <class T>
__device__ __forceinline__ bool gate_open(const select_state<T>* st, unsigned bits) {
  return (st->mode & bits) != 0u;
}

// ---------------------------------------------------------------------------------------
// Setup and small kernels.

// Sets the state of a new selection (one thread). With read_shift, Gaussian-k's shift: the
// first value, read before any pass writes e.
template <class T, class Values>
__global__ void init_kernel(select_state<T>* st, unsigned mode, unsigned long long k, Values vals,
                            bool read_shift) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  st->mode = mode;
  st->fallback = 0;
  st->lo = 0;
  st->hi = 0;
  st->n_sure = st->n_cand = st->n_sure_tail = st->n_cand_tail = 0;
  st->prefix = 0;
  st->mask = 0;
  st->rank = k;
  st->above = 0;
  st->kth = -1;
  st->ties = 0;
  st->count = 0;
  st->shift = read_shift ? static_cast<double>(vals.load(0)) : 0.0;
  st->mean = st->sd = st->thr = 0.0;
  st->iterations = 0;
  st->last = 0;
}

// A take of "key > t" with no ties (threshold): sets kth = t.
template <class T>
__global__ void set_take_kernel(select_state<T>* st, detail::signed_key_t<T> t) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    st->kth = t;
    st->ties = 0;
  }
}

template <int Unused = 0>
__global__ void write_stats_kernel(selection_stats* out, unsigned long long count, double threshold,
                                   unsigned iterations, bool fallback) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    out->count = count;
    out->threshold = threshold;
    out->iterations = iterations;
    out->fallback = fallback;
    out->energy = not_measured();  // the device passes do not add it up
  }
}

// e[i] += g[i] (the residual's accumulate, and select_accumulate's paths that select from e).
template <class T>
__global__ void axpy_kernel(T* e, const T* g, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    e[i] += g[i];
  }
}

// ---------------------------------------------------------------------------------------
// topk: sample, bracket, filter, finish.

// keys[j] = key of the value at floor(j n / s), j < s (reads e + g without writing).
template <class T, class Values>
__global__ void sample_kernel(Values vals, std::size_t n, std::size_t s,
                              detail::abs_key_t<T>* keys) {
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < s;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    keys[j] = detail::abs_key(vals.load(detail::strided_position(j, n, s)));
  }
}

// The bracket from the sample's order statistics, as topk's host code takes them with
// nth_element: lo = the (lo_pos + 1)-th largest sample key (0 when lo_pos == s), hi = the
// (hi_pos + 1)-th largest (bracket_hi::sample_rank), lo (bracket_hi::lo), or the largest
// possible key (bracket_hi::largest_key: nothing is sure).
template <class T, int Threads, unsigned Buckets>
__global__ void __launch_bounds__(Threads)
    bracket_kernel(const detail::abs_key_t<T>* keys, std::size_t s, std::size_t lo_pos,
                   detail::bracket_hi hi_from, std::size_t hi_pos, select_state<T>* st) {
  using key = detail::abs_key_t<T>;
  using select_t = block_radix_select<Threads, Buckets>;
  __shared__ typename select_t::storage sm;
  constexpr unsigned bits = detail::abs_key_traits<T>::bits;
  auto item = [keys](std::size_t i, key& out) {
    out = keys[i];
    return true;
  };
  key lo = 0;
  if (lo_pos < s) lo = select_t::template run<key>(sm, bits, s, item, lo_pos + 1).kth;
  key hi = detail::abs_key_traits<T>::mask;
  if (hi_from == detail::bracket_hi::lo) hi = lo;
  if (hi_from == detail::bracket_hi::sample_rank) {
    hi = select_t::template run<key>(sm, bits, s, item, hi_pos + 1).kth;
  }
  if (threadIdx.x == 0) {
    st->lo = lo;
    st->hi = hi;
  }
}

// The fused filter pass: for every value (adding g into e on the way when accumulating) the
// key of |value| is compared with the bracket; keys > hi go to `sure` (room for sure_cap),
// keys in [lo, hi] with their keys to the candidate lists (room for cand_cap). Positions come
// from a block scan and one atomic per counter per block, so the lists are in no particular
// order; the counts keep growing past the capacities (the finish then declares a miss).
template <class T, class Values, int Threads, int Items>
__global__ void __launch_bounds__(Threads)
    filter_kernel(Values vals, std::size_t n, std::size_t n_full, select_state<T>* st,
                  std::uint32_t* sure, std::size_t sure_cap, std::uint32_t* cand_idx,
                  detail::abs_key_t<T>* cand_keys, std::size_t cand_cap) {
  using key = detail::abs_key_t<T>;
  using scan_t = cub::BlockScan<unsigned, Threads>;
  __shared__ typename scan_t::TempStorage scan_sm;
  __shared__ unsigned long long base_sure;
  __shared__ unsigned long long base_cand;
  const key lo = st->lo;
  const key hi = st->hi;
  const std::size_t tile0 = blockIdx.x * static_cast<std::size_t>(Threads) * Items;
  key keys[Items];
  unsigned mine = 0;  // candidates << 16 | sure, at most Items each
  unsigned tail_sure = 0;
  unsigned tail_cand = 0;
#pragma unroll
  for (int r = 0; r < Items; ++r) {
    const std::size_t i = tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x;
    keys[r] = 0;
    if (i < n) {
      keys[r] = detail::abs_key(vals.load_store(i));
      const auto c = detail::classify_bracket(keys[r], lo, hi);
      const unsigned is_sure = c == detail::bracket_class::sure;
      const unsigned is_cand = c == detail::bracket_class::candidate;
      mine += is_sure + (is_cand << 16);
      if (i >= n_full) {
        tail_sure += is_sure;
        tail_cand += is_cand;
      }
    }
  }
  if (tail_sure) atomicAdd(&st->n_sure_tail, static_cast<unsigned long long>(tail_sure));
  if (tail_cand) atomicAdd(&st->n_cand_tail, static_cast<unsigned long long>(tail_cand));
  unsigned offset = 0;
  unsigned total = 0;
  scan_t(scan_sm).ExclusiveSum(mine, offset, total);
  if (threadIdx.x == 0) {
    const unsigned ts = total & 0xffffu;
    const unsigned tc = total >> 16;
    base_sure = ts ? atomicAdd(&st->n_sure, static_cast<unsigned long long>(ts)) : 0ull;
    base_cand = tc ? atomicAdd(&st->n_cand, static_cast<unsigned long long>(tc)) : 0ull;
  }
  __syncthreads();
  if (mine == 0) return;
  unsigned long long ps = base_sure + (offset & 0xffffu);
  unsigned long long pc = base_cand + (offset >> 16);
#pragma unroll
  for (int r = 0; r < Items; ++r) {
    const std::size_t i = tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x;
    if (i < n) {
      const auto c = detail::classify_bracket(keys[r], lo, hi);
      if (c == detail::bracket_class::sure) {
        if (ps < sure_cap) sure[ps] = static_cast<std::uint32_t>(i);
        ++ps;
      } else if (c == detail::bracket_class::candidate) {
        if (pc < cand_cap) {
          cand_idx[pc] = static_cast<std::uint32_t>(i);
          cand_keys[pc] = keys[r];
        }
        ++pc;
      }
    }
  }
}

// The exact finish on the candidates (one block). A miss (the host's conditions: more than k
// sure, more candidates than the budget within the full 32-blocks, or fewer than k in the
// bracket) switches the pipeline to the radix select and sets fallback. Otherwise the
// (k - sure)-th largest candidate key and the ties at it are found by radix selects on the
// candidate list (the ties by lowest index: a radix select over the complemented indices),
// and the chosen candidates are appended to the sure indices in `picks` (k in all, unordered).
template <class T, int Threads, unsigned Buckets>
__global__ void __launch_bounds__(Threads)
    finish_kernel(select_state<T>* st, std::size_t k, std::size_t budget, const T* values,
                  std::uint32_t* picks, const std::uint32_t* cand_idx,
                  const detail::abs_key_t<T>* cand_keys, selection_stats* stats) {
  using key = detail::abs_key_t<T>;
  using select_t = block_radix_select<Threads, Buckets>;
  using reduce_t = cub::BlockReduce<key, Threads>;
  __shared__ typename select_t::storage sm;
  __shared__ typename reduce_t::TempStorage reduce_sm;
  __shared__ unsigned long long write_pos;  // up to k - sure, and k may be 2^32 - 1
  const unsigned long long ns = st->n_sure;
  const unsigned long long nc = st->n_cand;
  const unsigned long long ns_full = ns - st->n_sure_tail;
  const unsigned long long nc_full = nc - st->n_cand_tail;
  const bool miss = ns_full > k || nc_full > budget || ns > k || ns + nc < k;
  if (miss) {
    if (threadIdx.x == 0) {
      st->mode = mode_radix;
      st->fallback = 1;
    }
    // The sort that follows still reads the k picks (the radix take then overwrites its
    // output): defined contents, for memory checkers.
    for (std::size_t i = threadIdx.x; i < k; i += Threads) picks[i] = 0;
    return;
  }
  const std::size_t need = k - static_cast<std::size_t>(ns);
  key kth;
  if (need == 0) {
    key lowest = detail::abs_key_traits<T>::mask;
    for (std::size_t i = threadIdx.x; i < ns; i += Threads) {
      const key kk = detail::abs_key(values[picks[i]]);
      lowest = kk < lowest ? kk : lowest;
    }
    kth = reduce_t(reduce_sm).Reduce(lowest, [](key a, key b) { return a < b ? a : b; });
  } else {
    const auto ncs = static_cast<std::size_t>(nc);
    auto by_key = [cand_keys](std::size_t i, key& out) {
      out = cand_keys[i];
      return true;
    };
    const auto res =
        select_t::template run<key>(sm, detail::abs_key_traits<T>::bits, ncs, by_key, need);
    kth = res.kth;
    // Of the candidates equal to kth, the res.tie_rank with the lowest indices: the
    // tie_rank-th largest complemented index is the last one taken.
    auto by_index = [cand_keys, cand_idx, kth](std::size_t i, std::uint32_t& out) {
      out = ~cand_idx[i];
      return cand_keys[i] == kth;
    };
    // Usually every candidate equal to kth is taken (no ties): no second select then.
    std::uint32_t last_tie = 0xffffffffu;
    if (res.equal != res.tie_rank) {
      last_tie = ~select_t::template run<std::uint32_t>(sm, 32u, ncs, by_index, res.tie_rank).kth;
    }
    if (threadIdx.x == 0) write_pos = 0;
    __syncthreads();
    for (std::size_t base = 0; base < ncs; base += Threads) {  // uniform: warp_append
      const std::size_t i = base + threadIdx.x;
      bool take = false;
      std::uint32_t idx = 0;
      if (i < ncs) {
        const key kk = cand_keys[i];
        idx = cand_idx[i];
        take = kk > kth || (kk == kth && idx <= last_tie);
      }
      const unsigned long long w = warp_append(&write_pos, take);
      if (take && ns + w < k) picks[ns + w] = idx;  // never past picks[k): by construction
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // (the reduction's result is valid in thread 0)
    stats->count = k;
    stats->threshold = static_cast<double>(detail::key_magnitude<T>(kth));
    stats->iterations = 0;
    stats->fallback = false;
    stats->energy = not_measured();  // the device passes do not add it up
  }
}

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

// ---------------------------------------------------------------------------------------
// Gaussian-k.

// Per block: sums of (value - shift) and its square in double over a grid-stride set of
// tiles, adding g into e on the way when accumulating; partials[2 b], [2 b + 1].
template <class T, class Values, int Threads, int Items>
__global__ void __launch_bounds__(Threads)
    moments_kernel(Values vals, std::size_t n, const select_state<T>* st, double* partials) {
  using reduce_t = cub::BlockReduce<double, Threads>;
  __shared__ typename reduce_t::TempStorage reduce_sm;
  const double shift = st->shift;
  double s1 = 0.0;
  double s2 = 0.0;
  constexpr std::size_t tile = static_cast<std::size_t>(Threads) * Items;
  for (std::size_t tile0 = blockIdx.x * tile; tile0 < n; tile0 += gridDim.x * tile) {
#pragma unroll
    for (int r = 0; r < Items; ++r) {
      const std::size_t i = tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x;
      if (i < n) {
        const double d = static_cast<double>(vals.load_store(i)) - shift;
        s1 += d;
        s2 += d * d;
      }
    }
  }
  const double t1 = reduce_t(reduce_sm).Sum(s1);
  __syncthreads();
  const double t2 = reduce_t(reduce_sm).Sum(s2);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = t1;
    partials[2 * blockIdx.x + 1] = t2;
  }
}

// One block: mean and sd from the partials (in a fixed order: deterministic), the threshold
// |mean| + sd z (z = inverse_normal_upper(rho / 2), from the host), and the first counting
// threshold; NaN or Inf switch to the exact top-k by radix select (fallback).
template <class T, int Threads>
__global__ void __launch_bounds__(Threads)
    moments_final_kernel(const double* partials, unsigned blocks, std::size_t n, double z,
                         select_state<T>* st) {
  using reduce_t = cub::BlockReduce<double, Threads>;
  __shared__ typename reduce_t::TempStorage reduce_sm;
  double s1 = 0.0;
  double s2 = 0.0;
  for (unsigned b = threadIdx.x; b < blocks; b += Threads) {
    s1 += partials[2 * b];
    s2 += partials[2 * b + 1];
  }
  const double sum = reduce_t(reduce_sm).Sum(s1);
  __syncthreads();
  const double sq = reduce_t(reduce_sm).Sum(s2);
  if (threadIdx.x != 0) return;
  const double nd = static_cast<double>(n);
  const double mean = st->shift + sum / nd;
  const double var = (sq - sum * sum / nd) / nd;
  const double sd = ::sqrt(var > 0.0 ? var : 0.0);
  const double thr = sd > 0.0 ? ::fabs(mean) + sd * z : 0.0;
  st->mean = mean;
  st->sd = sd;
  st->thr = thr;
  st->bracket = detail::gaussian_bracket{};
  if (!::isfinite(mean) || !::isfinite(sd) || !::isfinite(sum) || !::isfinite(sq) ||
      !::isfinite(thr)) {
    st->mode = mode_radix;
    st->fallback = 1;
    return;
  }
  st->mode = mode_count;
  st->kth = detail::key_threshold_above_hd<T>(thr);
  st->ties = 0;
}

// One thread, after each counting pass: Gaussian-k's correction step (gaussiank.hpp): stop in
// the band [2k/3, 4k/3], else detail::gaussian_correction (published: halve or multiply by
// 1.5; banded: the same until bracketed, then geometric bisection), at most max_refinements
// times; the count after a correction to 0 or Inf is the last. When done: the ordered write
// of the last count, or the exact top-k (radix select) with cap_at_k and more than k, or
// with until_in_band and the count outside the band.
template <class T>
__global__ void gaussian_step_kernel(select_state<T>* st, unsigned long long k,
                                     unsigned max_refinements, bool until_in_band,
                                     bool cap_at_k) {
  if (threadIdx.x != 0 || blockIdx.x != 0 || !gate_open(st, mode_count)) return;
  const unsigned long long c = st->count;
  const bool too_few = 3 * c < 2 * k;
  const bool in_band = !too_few && 3 * c <= 4 * k;
  bool done = st->last != 0 || !(st->sd > 0.0) || st->iterations >= max_refinements || in_band;
  double thr = st->thr;
  if (!done) {
    thr = detail::gaussian_correction(thr, too_few, until_in_band, st->bracket);
    st->thr = thr;
    ++st->iterations;
    st->kth = detail::key_threshold_above_hd<T>(thr);
    if (thr == 0.0 || !::isfinite(thr)) st->last = 1;
    return;
  }
  if ((cap_at_k && c > k) || (until_in_band && !in_band)) {
    st->mode = mode_radix;  // the exact top-k: rank = k, prefix = 0 from init
  } else {
    st->mode = mode_write;
  }
}

template <class T>
__global__ void gaussian_stats_kernel(const select_state<T>* st, unsigned long long k,
                                      selection_stats* stats) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (st->mode & mode_radix) {
    stats->count = k;
    stats->threshold =
        static_cast<double>(detail::key_magnitude<T>(static_cast<detail::abs_key_t<T>>(st->kth)));
    stats->iterations = st->fallback ? 0u : st->iterations;
    stats->fallback = st->fallback != 0;
    stats->energy = not_measured();  // the device passes do not add it up
  } else {
    stats->count = st->count;
    stats->threshold = st->thr;
    stats->iterations = st->iterations;
    stats->fallback = false;
    stats->energy = not_measured();  // the device passes do not add it up
  }
}

// Stats of a plain take (threshold): the count, the caller's threshold.
template <class T>
__global__ void take_stats_kernel(const select_state<T>* st, double threshold,
                                  selection_stats* stats) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  stats->count = st->count;
  stats->threshold = threshold;
  stats->iterations = 0;
  stats->fallback = false;
  stats->energy = not_measured();  // the device passes do not add it up
}

// ---------------------------------------------------------------------------------------
// Residual feedback.

// e[idx[j]] += sign * decoded[j] for j < m.
// e[idx[j]] += sign * decoded[j] for j < m: residual feedback's update (sign -1) and restore
// (+1). Every write is guarded by idx[j] < n and is an atomic add, so an index out of range is
// never written and repeated indices all count, validated or not; with the indices a selector
// makes (distinct) the result is the host's bit for bit. Does nothing when the validation
// before it found a bad index.
template <class T>
__global__ void scatter_add_kernel(T* e, std::size_t n, const std::uint32_t* idx,
                                   const float* decoded, std::size_t m, float sign,
                                   const error_record* errors) {
  if (any_error(errors, 1)) return;
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t i = idx[j];
    if (i < n) atomicAdd(e + i, static_cast<T>(sign * decoded[j]));
  }
}

// The value at *p, which becomes 0 in the same atomic step.
__device__ __forceinline__ float take_and_clear(float* p) { return atomicExch(p, 0.0f); }
__device__ __forceinline__ double take_and_clear(double* p) {
  return __longlong_as_double(static_cast<long long>(
      atomicExch(reinterpret_cast<unsigned long long*>(p), 0ull)));
}

// values[j] = e[idx[j]], then e[idx[j]] = 0, for j < min(stats->count, cap), as one atomic
// exchange per entry: an index out of range is never read or written, and a repeated index
// gives its value once (to one of its entries) and 0 to the others, so nothing is counted
// twice. Does nothing when the validation before it found a bad index.
template <class T>
__global__ void gather_clear_kernel(T* e, std::size_t n, const std::uint32_t* idx,
                                    const selection_stats* stats, std::size_t cap, T* values,
                                    const error_record* errors) {
  if (any_error(errors, 1)) return;
  const std::size_t m = stats->count < cap ? static_cast<std::size_t>(stats->count) : cap;
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t i = idx[j];
    values[j] = i < n ? take_and_clear(e + i) : T(0);
  }
}

// errors[0] = the first position j < min(stats->count, cap) with idx[j] >= n or, past the first,
// idx[j] <= idx[j - 1]: the selection's promise (ascending, distinct, in range), checked where
// its length is only known on the device. (Index is std::uint32_t: a template only so that the
// header can be part of several translation units of one program.)
template <class Index>
__global__ void validate_selection_kernel(const Index* idx, const selection_stats* stats,
                                          std::size_t cap, std::size_t n, error_record* errors) {
  const std::size_t m = stats->count < cap ? static_cast<std::size_t>(stats->count) : cap;
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const Index x = idx[j];
    if (x >= n || (j > 0 && x <= idx[j - 1])) report_error(errors, j);
  }
}

}  // namespace gradcomp::cuda::select_impl
