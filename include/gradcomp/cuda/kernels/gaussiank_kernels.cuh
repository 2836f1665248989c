// gradcomp/cuda/kernels/gaussiank_kernels.cuh: Gaussian-k's kernels: its moments and counting
// passes.
// (kernels/select_kernels.cuh says how the selection's kernels work together.)
#pragma once

#include <gradcomp/cuda/kernels/select_state.cuh>

namespace gradcomp::cuda::select_impl {

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

}  // namespace gradcomp::cuda::select_impl
