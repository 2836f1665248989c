// gradcomp/cuda/kernels/topk_kernels.cuh: the exact top-k's kernels: the sample, its bracket, the
// fused filter pass and the exact finish on the candidates.
// (kernels/select_kernels.cuh says how the selection's kernels work together.)
#pragma once

#include <gradcomp/cuda/kernels/select_state.cuh>

namespace gradcomp::cuda::select_impl {

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

}  // namespace gradcomp::cuda::select_impl
