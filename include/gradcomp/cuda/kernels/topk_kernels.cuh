// gradcomp/cuda/kernels/topk_kernels.cuh: the exact top-k's kernels: the sample and its bracket
// (list selects), the fused filter pass and the exact finish on the candidates.
// (kernels/select_kernels.cuh says how the selection's kernels work together.)
#pragma once

#include <gradcomp/cuda/kernels/list_select_kernels.cuh>
#include <gradcomp/cuda/kernels/select_state.cuh>

namespace gradcomp::cuda::select_impl {

// ---------------------------------------------------------------------------------------
// topk: sample, bracket, filter, finish.

// The bracket from the sample's order statistics, as topk's host code takes them with
// nth_element: lo = the (lo_pos + 1)-th largest sample key (0 when lo_pos == s), hi = the
// (hi_pos + 1)-th largest (bracket_hi::sample_rank), lo (bracket_hi::lo), or the largest
// possible key (bracket_hi::largest_key: nothing is sure). The two order statistics are list
// selects over the sample (list_select_kernels.cuh), run in the same passes; the first pass
// reads the sample from g (keys[j] = the key of the value at floor(j n / s), e + g read
// without writing) and keeps it for the others.
template <class T, class Values>
struct sample_source {
  using key = detail::abs_key_t<T>;
  Values vals;
  std::size_t n;
  std::size_t s;
  key* keys;
  unsigned sel;                 // bit 0: lo is a sample rank; bit 1: hi is
  unsigned long long lo_rank;   // lo_pos + 1
  unsigned long long hi_rank;   // hi_pos + 1
  detail::bracket_hi hi_from;

  __device__ unsigned which() const { return sel; }
  __device__ bool active(const select_state<T>*) const { return true; }
  __device__ std::size_t count(const select_state<T>*) const { return s; }
  __device__ key load(std::size_t i, unsigned pass) const {
    if (pass != 0) return keys[i];
    const key k = detail::abs_key(vals.load(static_cast<std::size_t>(detail::strided_position(i, n, s))));
    keys[i] = k;
    return k;
  }
  __device__ unsigned long long initial_rank(const select_state<T>*, int a) const {
    return a == 0 ? lo_rank : hi_rank;
  }
  __device__ void end(select_state<T>* st, const list_select<key>* ls) const {
    if (threadIdx.x != 0) return;
    const key lo = (sel & 1u) ? ls->prefix[0] : key{0};
    key hi = detail::abs_key_traits<T>::mask;
    if (hi_from == detail::bracket_hi::lo) hi = lo;
    if (hi_from == detail::bracket_hi::sample_rank) hi = ls->prefix[1];
    st->lo = lo;
    st->hi = hi;
  }
};

// The bracket when the sample decides nothing (lo_pos == s: lo = 0; hi = lo or the largest key).
template <class T>
__global__ void bracket_fixed_kernel(select_state<T>* st, detail::bracket_hi hi_from) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  st->lo = 0;
  st->hi = hi_from == detail::bracket_hi::lo ? detail::abs_key_t<T>{0} : detail::abs_key_traits<T>::mask;
}

// The fused filter pass: for every value (adding g into e on the way when accumulating) the
// key of |value| is compared with the bracket; keys > hi go to `sure` (room for sure_cap),
// keys in [lo, hi] with their keys to the candidate lists (room for cand_cap). Positions come
// from a warp scan and one atomic per counter per warp that has any, so the lists are in no
// particular order; the counts keep growing past the capacities (the finish then declares a
// miss). No block-wide barrier, and no key kept in registers across the loads (the few
// flagged rows are read again): the kernel kept 16 keys a thread and ran at 67 registers, 3
// blocks an SM, and streamed g at a quarter of the device's bandwidth on an H100.
template <class T, class Values, int Threads, int Items, int MinBlocks>
__global__ void __launch_bounds__(Threads, MinBlocks)
    filter_kernel(Values vals, std::size_t n, std::size_t n_full, select_state<T>* st,
                  std::uint32_t* sure, std::size_t sure_cap, std::uint32_t* cand_idx,
                  detail::abs_key_t<T>* cand_keys, std::size_t cand_cap) {
  using key = detail::abs_key_t<T>;
  const key lo = st->lo;
  const key hi = st->hi;
  const std::size_t tile0 = blockIdx.x * static_cast<std::size_t>(Threads) * Items;
  const unsigned lane = threadIdx.x & 31u;
  static_assert(Items <= 16, "two class bits an item in 32");
  unsigned classes = 0;  // bit 2r: row r is sure, bit 2r + 1: a candidate
  unsigned mine = 0;     // candidates << 16 | sure, at most Items each
  unsigned tail_sure = 0;
  unsigned tail_cand = 0;
#pragma unroll
  for (int r = 0; r < Items; ++r) {
    const std::size_t i = tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x;
    if (i < n) {
      const auto c = detail::classify_bracket(detail::abs_key(vals.load_store(i)), lo, hi);
      const unsigned is_sure = c == detail::bracket_class::sure;
      const unsigned is_cand = c == detail::bracket_class::candidate;
      classes |= (is_sure << (2 * r)) | (is_cand << (2 * r + 1));
      mine += is_sure + (is_cand << 16);
      if (i >= n_full) {
        tail_sure += is_sure;
        tail_cand += is_cand;
      }
    }
  }
  if (tail_sure) atomicAdd(&st->n_sure_tail, static_cast<unsigned long long>(tail_sure));
  if (tail_cand) atomicAdd(&st->n_cand_tail, static_cast<unsigned long long>(tail_cand));
  // The warp's inclusive scan of the packed counts (at most 32 * Items < 2^16 each).
  unsigned incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned y = __shfl_up_sync(full_warp, incl, d);
    if (static_cast<int>(lane) >= d) incl += y;
  }
  const unsigned total = __shfl_sync(full_warp, incl, 31);
  if (total == 0) return;  // uniform within the warp
  const unsigned offset = incl - mine;
  unsigned long long base_sure = 0;
  unsigned long long base_cand = 0;
  if (lane == 0) {
    const unsigned ts = total & 0xffffu;
    const unsigned tc = total >> 16;
    if (ts) base_sure = atomicAdd(&st->n_sure, static_cast<unsigned long long>(ts));
    if (tc) base_cand = atomicAdd(&st->n_cand, static_cast<unsigned long long>(tc));
  }
  base_sure = __shfl_sync(full_warp, base_sure, 0);
  base_cand = __shfl_sync(full_warp, base_cand, 0);
  if (classes == 0) return;
  unsigned long long ps = base_sure + (offset & 0xffffu);
  unsigned long long pc = base_cand + (offset >> 16);
  // The few flagged rows are read again (e + g as stored by the loop above), so that the keys
  // need no registers while the loads are in flight.
#pragma unroll
  for (int r = 0; r < Items; ++r) {
    const std::size_t i = tile0 + static_cast<std::size_t>(r) * Threads + threadIdx.x;
    if ((classes >> (2 * r)) & 1u) {
      if (ps < sure_cap) sure[ps] = static_cast<std::uint32_t>(i);
      ++ps;
    } else if ((classes >> (2 * r + 1)) & 1u) {
      if (pc < cand_cap) {
        cand_idx[pc] = static_cast<std::uint32_t>(i);
        cand_keys[pc] = detail::abs_key(vals.stored(i));
      }
      ++pc;
    }
  }
}

// The exact finish on the candidates, in three steps:
//  - finish_begin_kernel (one block) decides a miss (the host's conditions: more than k sure,
//    more candidates than the budget within the full 32-blocks, or fewer than k in the
//    bracket), which switches the pipeline to the radix select over g and sets fallback; when
//    the sure indices are exactly k, the k-th key is the smallest of theirs;
//  - the list select over the candidate keys (candidate_source) finds the (k - sure)-th
//    largest and, where fewer than all candidates equal to it are taken, the highest index
//    taken (ties to the lowest indices: a block radix select over the complemented indices
//    of those candidates, in the last block);
//  - collect_kernel appends the chosen candidates to the sure indices in `picks` (k in all,
//    unordered).
template <class T>
__device__ __forceinline__ bool finish_missed(const select_state<T>* st, std::size_t k,
                                              std::size_t budget) {
  const unsigned long long ns = st->n_sure;
  const unsigned long long nc = st->n_cand;
  const unsigned long long ns_full = ns - st->n_sure_tail;
  const unsigned long long nc_full = nc - st->n_cand_tail;
  return ns_full > k || nc_full > budget || ns > k || ns + nc < k;
}

template <class T>
__device__ __forceinline__ void write_topk_stats(selection_stats* stats, std::size_t k,
                                                 detail::abs_key_t<T> kth) {
  stats->count = k;
  stats->threshold = static_cast<double>(detail::key_magnitude<T>(kth));
  stats->iterations = 0;
  stats->fallback = false;
  stats->energy = not_measured();  // the device passes do not add it up
}

template <class T, int Threads>
__global__ void __launch_bounds__(Threads)
    finish_begin_kernel(select_state<T>* st, std::size_t k, std::size_t budget, const T* values,
                        const std::uint32_t* picks, selection_stats* stats) {
  using key = detail::abs_key_t<T>;
  using reduce_t = cub::BlockReduce<key, Threads>;
  __shared__ typename reduce_t::TempStorage reduce_sm;
  if (finish_missed(st, k, budget)) {
    if (threadIdx.x == 0) {
      st->mode = mode_radix;
      st->fallback = 1;
    }
    return;
  }
  const unsigned long long ns = st->n_sure;
  if (ns != k) return;  // the list select finds the k-th among the candidates
  key lowest = detail::abs_key_traits<T>::mask;
  for (std::size_t i = threadIdx.x; i < ns; i += Threads) {
    const key kk = detail::abs_key(values[picks[i]]);
    lowest = kk < lowest ? kk : lowest;
  }
  const key kth = reduce_t(reduce_sm).Reduce(lowest, [](key a, key b) { return a < b ? a : b; });
  if (threadIdx.x == 0) {  // (the reduction's result is valid in thread 0)
    st->fin_kth = kth;
    write_topk_stats<T>(stats, k, kth);
  }
}

template <class T, int Threads, unsigned Buckets>
struct candidate_source {
  using key = detail::abs_key_t<T>;
  const key* cand_keys;
  const std::uint32_t* cand_idx;
  std::size_t k;
  selection_stats* stats;

  __device__ unsigned which() const { return 1u; }
  __device__ bool active(const select_state<T>* st) const {
    return (st->mode & mode_radix) == 0u && st->n_sure < k;
  }
  __device__ std::size_t count(const select_state<T>* st) const {
    return static_cast<std::size_t>(st->n_cand);
  }
  __device__ key load(std::size_t i, unsigned) const { return cand_keys[i]; }
  __device__ unsigned long long initial_rank(const select_state<T>* st, int) const {
    return k - st->n_sure;
  }
  __device__ void end(select_state<T>* st, const list_select<key>* ls) const {
    using select_t = block_radix_select<Threads, Buckets>;
    __shared__ typename select_t::storage sm;
    const key kth = ls->prefix[0];
    const unsigned long long tie_rank = ls->rank[0];
    // Usually every candidate equal to kth is taken (no ties): no index select then.
    std::uint32_t last_tie = 0xffffffffu;
    if (ls->equal[0] != tie_rank) {  // uniform: every thread reads the same
      const key* ck = cand_keys;
      const std::uint32_t* ci = cand_idx;
      auto by_index = [ck, ci, kth](std::size_t i, std::uint32_t& out) {
        out = ~ci[i];
        return ck[i] == kth;
      };
      last_tie = ~select_t::template run<std::uint32_t>(sm, 32u, count(st), by_index, tie_rank).kth;
    }
    if (threadIdx.x == 0) {
      st->fin_kth = kth;
      st->last_tie = last_tie;
      write_topk_stats<T>(stats, k, kth);
    }
  }
};

template <class T, int Threads>
__global__ void __launch_bounds__(Threads)
    collect_kernel(select_state<T>* st, std::size_t k, std::uint32_t* picks,
                   const std::uint32_t* cand_idx, const detail::abs_key_t<T>* cand_keys) {
  using key = detail::abs_key_t<T>;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * Threads;
  if ((st->mode & mode_radix) != 0u) {
    // The sort that follows still reads the k picks (the radix take then overwrites its
    // output): defined contents, for memory checkers.
    for (std::size_t i = blockIdx.x * static_cast<std::size_t>(Threads) + threadIdx.x; i < k;
         i += stride) {
      picks[i] = 0;
    }
    return;
  }
  const unsigned long long ns = st->n_sure;
  if (ns >= k) return;  // the sure indices are the k
  const auto nc = static_cast<std::size_t>(st->n_cand);
  const key kth = st->fin_kth;
  const std::uint32_t last_tie = st->last_tie;
  for (std::size_t base = blockIdx.x * static_cast<std::size_t>(Threads); base < nc;
       base += stride) {  // uniform within a warp: warp_append
    const std::size_t i = base + threadIdx.x;
    bool take = false;
    std::uint32_t idx = 0;
    if (i < nc) {
      const key kk = cand_keys[i];
      idx = cand_idx[i];
      take = kk > kth || (kk == kth && idx <= last_tie);
    }
    const unsigned long long w = warp_append(&st->collected, take);
    if (take && ns + w < k) picks[ns + w] = idx;  // never past picks[k): by construction
  }
}

}  // namespace gradcomp::cuda::select_impl
