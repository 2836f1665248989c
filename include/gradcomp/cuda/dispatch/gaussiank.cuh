// gradcomp/cuda/dispatch/gaussiank.cuh: Gaussian-k and the fixed threshold on the device.
// Gaussian-k: one fused reduction for the mean and variance (adding g into e on the way when
// accumulating), the threshold |mean| + sd z on the device, then per correction round one
// counting read of g (per-tile counts) and a one-thread decision, launched
// min(max_refinements, device_max_rounds) + 1 times and skipped once the count is in the band;
// the corrections are the host's (detail::gaussian_correction, published or banded). The last
// count's tile scan places the final ordered write (indices ascending). NaN or Inf, cap_at_k
// with more than k selected, and the default (until_in_band) form ending outside the band
// switch to the exact top-k by radix select.
// Only when max_refinements > device_max_rounds and the device has not settled after those
// rounds does the host wait for the stream (one 4-byte copy per further round).
//
// Tolerance against the host: the device sums (value - first value) and its square in double
// per thread, then per block and over blocks in a fixed order; the host sums chunks of 256 in
// T lanes and the chunk totals in double. Mean and sd therefore agree to about 1e-7 relative
// for float (1e-15 for double), and so does the threshold; the selection is exactly
// {i : key(g_i) > key_threshold_above(device threshold)} and its count differs from the
// host's only by the values lying between the two thresholds (and, when that moves a count
// across the band's edges 2k/3 or 4k/3, by a different correction).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <gradcomp/context.hpp>
#include <gradcomp/cuda/dispatch/radix_select.cuh>
#include <gradcomp/cuda/kernels/select_kernels.cuh>
#include <gradcomp/detail/normal.hpp>
#include <gradcomp/detail/radix_digits.hpp>
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/threshold.hpp>

namespace gradcomp::cuda::select_impl {

inline constexpr unsigned device_max_rounds = 16;

template <class T>
void gaussiank_run(const gaussiank& sel, temp_storage& tmp, T* e, const T* g, std::size_t n,
                   std::size_t k, std::uint32_t* out, std::size_t cap, selection_stats* stats,
                   cudaStream_t stream) {
  scratch_carver c(tmp.ptr);
  auto* st = c.take<select_state<T>>(1);
  const radix_scratch rs = carve_radix<T>(c, n);
  const std::size_t tiles = num_tiles(n);
  const unsigned blocks =
      static_cast<unsigned>(std::min<std::size_t>(tiles == 0 ? 1 : tiles, tune.reduce_blocks));
  double* partials = c.take<double>(2 * std::size_t{blocks});
  if (finish_size_query("gaussiank", tmp, c)) return;
  if (k == 0) {
    launch_empty_selection<T>(e, g, n, stats, stream);
    return;
  }
  const T* values = e ? e : g;
  const read_values<T> final_vals{values};
  const double rho = static_cast<double>(k) / static_cast<double>(n);
  const double z = detail::inverse_normal_upper(rho / 2.0);
  auto stats_pass = [&](auto vals) {
    using V = decltype(vals);
    init_kernel<T, V><<<1, 1, 0, stream>>>(st, 0u, k, vals, true);
    check_launch("init_kernel");
    moments_kernel<T, V, tile_threads, tile_items>
        <<<blocks, tile_threads, 0, stream>>>(vals, n, st, partials);
    check_launch("moments_kernel");
  };
  if (e) {
    stats_pass(accumulate_values<T>{e, g});
  } else {
    stats_pass(read_values<T>{g});
  }
  moments_final_kernel<T, single_threads>
      <<<1, single_threads, 0, stream>>>(partials, blocks, n, z, st);
  check_launch("moments_final_kernel");
  auto round = [&] {
    launch_take<T>(final_vals, n, st, mode_count, 0u, rs, out, cap, stream, true, false);
    gaussian_step_kernel<T><<<1, 1, 0, stream>>>(st, k, sel.max_refinements, sel.until_in_band,
                                                   sel.cap_at_k);
    check_launch("gaussian_step_kernel");
  };
  const unsigned rounds = std::min(sel.max_refinements, device_max_rounds) + 1;
  for (unsigned r = 0; r < rounds; ++r) round();
  if (sel.max_refinements > device_max_rounds) {
    // Host round trip, only for very long correction chains: wait and look at the mode.
    for (;;) {
      unsigned mode = 0;
      detail::cuda_check(
          cudaMemcpyAsync(&mode, &st->mode, sizeof mode, cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync");
      detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      if ((mode & mode_count) == 0) break;
      round();
    }
  }
  launch_take<T>(final_vals, n, st, 0u, mode_write, rs, out, cap, stream, false, true);
  launch_radix_topk<T>(final_vals, n, st, rs, out, cap, stream);
  gaussian_stats_kernel<T><<<1, 1, 0, stream>>>(st, k, stats);
  check_launch("gaussian_stats_kernel");
}

// The fixed threshold: {i : |g_i| >= tau}, one counting read and one ordered write.
template <class T>
void threshold_run(const threshold& sel, temp_storage& tmp, const T* g, std::size_t n,
                   std::uint32_t* out, std::size_t cap, selection_stats* stats,
                   cudaStream_t stream) {
  scratch_carver c(tmp.ptr);
  auto* st = c.take<select_state<T>>(1);
  const radix_scratch rs = carve_radix<T>(c, n);
  if (finish_size_query("threshold", tmp, c)) return;
  if (n == 0) {
    write_stats_kernel<<<1, 1, 0, stream>>>(stats, 0, sel.tau, 0, false);
    check_launch("write_stats_kernel");
    return;
  }
  const read_values<T> vals{g};
  init_kernel<T><<<1, 1, 0, stream>>>(st, mode_write, 0, vals, false);
  check_launch("init_kernel");
  set_take_kernel<T><<<1, 1, 0, stream>>>(st, detail::key_threshold_at_least<T>(sel.tau));
  check_launch("set_take_kernel");
  launch_take<T>(vals, n, st, mode_write, mode_write, rs, out, cap, stream);
  take_stats_kernel<T><<<1, 1, 0, stream>>>(st, sel.tau, stats);
  check_launch("take_stats_kernel");
}

}  // namespace gradcomp::cuda::select_impl
