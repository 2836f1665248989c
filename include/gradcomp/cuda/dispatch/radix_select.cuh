// gradcomp/cuda/dispatch/radix_select.cuh: launching the radix select and the ordered take on
// a stream, and carving their scratch from the caller's one buffer. The radix select over n
// values: per pass one read of the values (histogram of the digit of the keys that match the
// digits fixed so far) and one single-block pick, all on the device; then the ordered take
// (per-tile counts, one scan, one write in index order) writes the k indices already sorted.
// For float keys that is 3 + 2 reads of g, for double 6 + 2.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/dispatch/scratch.cuh>
#include <gradcomp/cuda/dispatch/feedback.cuh>
#include <gradcomp/cuda/kernels/select_kernels.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/tuning.cuh>
#include <gradcomp/detail/radix_digits.hpp>

namespace gradcomp::cuda::select_impl {

inline constexpr select_tuning tune = default_select_tuning;
inline constexpr int tile_threads = tune.threads;
inline constexpr int tile_items = tune.items;
inline constexpr int single_threads = tune.single_threads;
inline constexpr unsigned buckets = 1u << tune.radix_bits;

// The most blocks a grid-stride launch of the select path takes.
inline constexpr std::size_t max_grid_blocks = 65535u * 16u;

inline std::size_t num_tiles(std::size_t n) { return (n + tune.tile() - 1) / tune.tile(); }

// Blocks of a gated tile kernel: every tile, up to tune.tile_blocks (then grid-stride).
inline unsigned tile_grid(std::size_t tiles) {
  return static_cast<unsigned>(
      std::min<std::size_t>(tiles, static_cast<std::size_t>(tune.tile_blocks)));
}

// A selection of nothing (k == 0): with e (select_accumulate) it still leaves e = e + g; the
// stats say 0 selected.
template <class T>
void launch_empty_selection(T* e, const T* g, std::size_t n, selection_stats* stats,
                            cudaStream_t stream) {
  if (e && n > 0) {
    feedback_impl::launch_accumulate(e, g, n, stream);
  }
  write_stats_kernel<<<1, 1, 0, stream>>>(stats, 0, 0.0, 0, false);
  check_launch("write_stats_kernel");
}

// The scratch of the radix select and the take.
struct radix_scratch {
  unsigned long long* hist = nullptr;   // passes * buckets, zeroed by launch_radix_topk
  unsigned* tile_counts = nullptr;      // 2 per tile
  unsigned long long* bases = nullptr;  // 2 per tile
};

template <class T>
radix_scratch carve_radix(scratch_carver& c, std::size_t n) {
  radix_scratch r;
  const std::size_t tiles = num_tiles(n) == 0 ? 1 : num_tiles(n);
  r.hist = c.take<unsigned long long>(
      std::size_t{detail::radix_passes(detail::abs_key_traits<T>::bits)} * buckets);
  r.tile_counts = c.take<unsigned>(2 * tiles);
  r.bases = c.take<unsigned long long>(2 * tiles);
  return r;
}

// The ordered take of the selection state->kth / state->ties over n values: counts and scan
// run when state->mode has a bit of gate_count, the write when it has one of gate_write.
template <class T, class Values>
void launch_take(Values vals, std::size_t n, select_state<T>* st, unsigned gate_count,
                 unsigned gate_write, const radix_scratch& rs, std::uint32_t* out, std::size_t cap,
                 cudaStream_t stream, bool count = true, bool write = true) {
  const std::size_t tiles = num_tiles(n);
  if (tiles == 0) return;
  if (count) {
    take_count_kernel<T, Values, tile_threads, tile_items>
        <<<tile_grid(tiles), tile_threads, 0, stream>>>(vals, n, st, gate_count, rs.tile_counts);
    check_launch("take_count_kernel");
    take_scan_kernel<T, single_threads>
        <<<1, single_threads, 0, stream>>>(rs.tile_counts, tiles, st, gate_count, rs.bases);
    check_launch("take_scan_kernel");
  }
  if (write) {
    take_write_kernel<T, Values, tile_threads, tile_items>
        <<<tile_grid(tiles), tile_threads, 0, stream>>>(vals, n, st, gate_write, rs.bases, out,
                                                        cap);
    check_launch("take_write_kernel");
  }
}

// The top `state->rank` (set by init_kernel) of n values by radix select, written sorted to
// out; everything gated by mode_radix, so a pipeline may launch it for a fallback that the
// device decides on.
template <class T, class Values>
void launch_radix_topk(Values vals, std::size_t n, select_state<T>* st, const radix_scratch& rs,
                       std::uint32_t* out, std::size_t cap, cudaStream_t stream) {
  constexpr unsigned passes = detail::radix_passes(detail::abs_key_traits<T>::bits);
  const std::size_t tiles = num_tiles(n);
  if (tiles == 0) return;
  detail::cuda_check(
      cudaMemsetAsync(rs.hist, 0, sizeof(unsigned long long) * passes * buckets, stream),
      "cudaMemsetAsync");
  for (unsigned p = 0; p < passes; ++p) {
    radix_hist_kernel<T, Values, tile_threads, tile_items, buckets>
        <<<tile_grid(tiles), tile_threads, 0, stream>>>(vals, n, st, p, rs.hist + p * buckets);
    check_launch("radix_hist_kernel");
    radix_pick_kernel<T, single_threads, buckets>
        <<<1, single_threads, 0, stream>>>(rs.hist + p * buckets, p, st);
    check_launch("radix_pick_kernel");
  }
  launch_take<T>(vals, n, st, mode_radix, mode_radix, rs, out, cap, stream);
}

}  // namespace gradcomp::cuda::select_impl
