// gradcomp/cuda/kernels/select_state.cuh: a selection's state in device memory, the values a pass
// reads (g, or e + g), and the setup and small kernels every selector uses.
// (kernels/select_kernels.cuh says how the selection's kernels work together.)
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
  // topk finish: the k-th key, the highest index taken among the candidates equal to it, and
  // how many candidates the collection has appended
  key fin_kth;
  std::uint32_t last_tie;
  unsigned long long collected;
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
// also stores e = e + g, which only the one pass that owns the accumulation calls; stored()
// reads back what load_store() returned.
template <class T>
struct read_values {
  const T* g;
  __device__ __forceinline__ T load(std::size_t i) const { return g[i]; }
  __device__ __forceinline__ T load_store(std::size_t i) const { return g[i]; }
  __device__ __forceinline__ T stored(std::size_t i) const { return g[i]; }
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
  // The value load_store(i) returned, after it ran (in this thread).
  __device__ __forceinline__ T stored(std::size_t i) const { return e[i]; }
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
  st->fin_kth = 0;
  st->last_tie = 0xffffffffu;
  st->collected = 0;
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

}  // namespace gradcomp::cuda::select_impl
