// gradcomp/cuda/dispatch/topk.cuh: exact top-k on the device. The common case reads g once:
//   bracket [lo, hi] (the sample's s strided keys and the two order statistics, list selects:
//   one launch a radix pass, many blocks) -> filter (one read of g, |g| keyed on the fly: sure
//   indices and candidates, warp scans and one atomic per counter per warp) -> finish (miss
//   check, a list select on the candidate keys, ties to the lowest indices, the collection of
//   the picks) -> sort of the k picks (cub::DeviceRadixSort on k keys).
// The plan (sample size, bracket ranks, candidate budget) is topk's host computation
// (topk::bracket_plan), so the bracket and the miss decision are the host's; a miss switches the
// pipeline, on the device, to the radix select over all of g (dispatch/radix_select.cuh), whose
// kernels were launched behind the finish and return at once when the bracket held. No host round
// trip.
#pragma once

#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include <gradcomp/context.hpp>
#include <gradcomp/cuda/dispatch/radix_select.cuh>
#include <gradcomp/cuda/kernels/select_kernels.cuh>
#include <gradcomp/detail/radix_digits.hpp>
#include <gradcomp/detail/select/bracket.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/scan.hpp>

namespace gradcomp::cuda::select_impl {

// What topk::select_from decides before it touches g: the same paths, and for the bracketed
// one the host's own plan (topk::bracket_plan), so the bracket and the miss decision are the
// host's. The facade (cuda/select.cuh) makes it from the policy; this layer needs only the plan.
struct topk_plan {
  bool radix_only = false;  // forced radix, k == n, tiny n or tiny k: radix select over g
  bool forced = false;      // topk_method::radix (stats.iterations = passes)
  std::size_t s = 0;        // sample size
  std::size_t lo_pos = 0;   // lo = (lo_pos + 1)-th largest sample key; lo_pos == s: lo = 0
  detail::bracket_hi hi = detail::bracket_hi::largest_key;  // as the host's plan
  std::size_t hi_pos = 0;   // bracket_hi::sample_rank: hi = the (hi_pos + 1)-th largest
  std::size_t budget = 0;  // candidate budget
};

// Bits needed for the indices 0 .. n-1 (at least 1): the sort of the picks looks at no more.
inline int index_bits(std::size_t n) {
  int b = 1;
  while (b < 32 && ((static_cast<std::uint64_t>(n) - 1) >> b) != 0) ++b;
  return b;
}

// The counters of one list select's histograms: a pair (two selects) per radix pass.
template <class T>
inline constexpr std::size_t list_hist_count_v =
    std::size_t{detail::radix_passes(detail::abs_key_traits<T>::bits)} * 2u * buckets;

// Scratch layout, measured (tmp.ptr == nullptr) or carved, and the launches. e == nullptr:
// select from g; else select from e + g and leave e = e + g.
template <class T>
void topk_run(const topk_plan& plan, temp_storage& tmp, T* e, const T* g, std::size_t n,
              std::size_t k, std::uint32_t* out, selection_stats* stats, cudaStream_t stream) {
  using key = detail::abs_key_t<T>;
  constexpr unsigned passes = detail::radix_passes(detail::abs_key_traits<T>::bits);
  constexpr std::size_t list_hist_count = list_hist_count_v<T>;
  scratch_carver c(tmp.ptr);
  auto* st = c.take<select_state<T>>(1);
  const radix_scratch rs = carve_radix<T>(c, n);
  key* sample = nullptr;
  std::uint32_t* picks = nullptr;
  std::uint32_t* cand_idx = nullptr;
  key* cand_keys = nullptr;
  void* sort_tmp = nullptr;
  std::size_t sort_bytes = 0;
  const std::size_t cand_cap = plan.budget + detail::scan_block;
  const int end_bit = index_bits(n);
  list_select<key>* lists = nullptr;  // [0] the bracket's, [1] the finish's
  list_count* list_hists = nullptr;   // then their histograms, zeroed with them
  if (!plan.radix_only && k > 0) {
    lists = c.take<list_select<key>>(2);
    list_hists = c.take<list_count>(std::size_t{2} * list_hist_count);
    sample = c.take<key>(plan.s);
    picks = c.take<std::uint32_t>(k);
    cand_idx = c.take<std::uint32_t>(cand_cap);
    cand_keys = c.take<key>(cand_cap);
    detail::cuda_check(
        cub::DeviceRadixSort::SortKeys(
            nullptr, sort_bytes, static_cast<const std::uint32_t*>(nullptr),
            static_cast<std::uint32_t*>(nullptr), static_cast<std::int64_t>(k), 0, end_bit, stream),
        "cub::DeviceRadixSort::SortKeys (size query)");
    sort_tmp = c.take<char>(sort_bytes);
  }
  if (finish_size_query("topk", tmp, c)) return;

  const T* values = e ? e : g;  // what holds the values once e += g is done
  if (k == 0) {
    launch_empty_selection<T>(e, g, n, stats, stream);
    return;
  }
  const read_values<T> final_vals{values};
  if (plan.radix_only) {
    if (e) {
      feedback_impl::launch_accumulate(e, g, n, stream);
    }
    init_kernel<T><<<1, 1, 0, stream>>>(st, mode_radix, k, final_vals, false);
    check_launch("init_kernel");
    launch_radix_topk<T>(final_vals, n, st, rs, out, k, stream);
    radix_stats_kernel<T><<<1, 1, 0, stream>>>(st, k, plan.forced ? passes : 0u, passes, stats);
    check_launch("radix_stats_kernel");
    return;
  }

  init_kernel<T><<<1, 1, 0, stream>>>(st, 0u, k, final_vals, false);
  check_launch("init_kernel");
  // The two states and their histograms, carved one after the other (pointers into the
  // scratch, so only now, after the size query has returned).
  const auto list_bytes = static_cast<std::size_t>(
      reinterpret_cast<char*>(list_hists + 2 * list_hist_count) - reinterpret_cast<char*>(lists));
  detail::cuda_check(cudaMemsetAsync(lists, 0, list_bytes, stream), "cudaMemsetAsync");
  const std::size_t tiles = num_tiles(n);
  const std::size_t n_full = n - n % detail::scan_block;
  const unsigned sel = (plan.lo_pos < plan.s ? 1u : 0u) |
                       (plan.hi == detail::bracket_hi::sample_rank ? 2u : 0u);
  auto filter = [&](auto vals) {
    using V = decltype(vals);
    if (sel != 0u) {
      const sample_source<T, V> src{vals, n, plan.s, sample, sel, plan.lo_pos + 1, plan.hi_pos + 1,
                                    plan.hi};
      for (unsigned p = 0; p < passes; ++p) {
        list_pass_kernel<T, tile_threads, buckets, sample_source<T, V>>
            <<<tune.list_grid(plan.s), tile_threads, 0, stream>>>(src, st, lists, p, list_hists);
        check_launch("list_pass_kernel (sample)");
      }
    } else {
      bracket_fixed_kernel<T><<<1, 1, 0, stream>>>(st, plan.hi);
      check_launch("bracket_fixed_kernel");
    }
    filter_kernel<T, V, tile_threads, tile_items, tune.filter_min_blocks>
        <<<static_cast<unsigned>(tiles), tile_threads, 0, stream>>>(vals, n, n_full, st, picks, k,
                                                                    cand_idx, cand_keys, cand_cap);
    check_launch("filter_kernel");
  };
  if (e) {
    filter(accumulate_values<T>{e, g});
  } else {
    filter(read_values<T>{g});
  }
  finish_begin_kernel<T, single_threads><<<1, single_threads, 0, stream>>>(st, k, plan.budget,
                                                                           values, picks, stats);
  check_launch("finish_begin_kernel");
  using cand_t = candidate_source<T, tile_threads, buckets>;
  const cand_t cand{cand_keys, cand_idx, k, stats};
  const unsigned cand_grid = tune.list_grid(cand_cap);
  for (unsigned p = 0; p < passes; ++p) {
    list_pass_kernel<T, tile_threads, buckets, cand_t>
        <<<cand_grid, tile_threads, 0, stream>>>(cand, st, lists + 1, p, list_hists + list_hist_count);
    check_launch("list_pass_kernel (candidates)");
  }
  collect_kernel<T, tile_threads>
      <<<cand_grid, tile_threads, 0, stream>>>(st, k, picks, cand_idx, cand_keys);
  check_launch("collect_kernel");
  // The sort runs either way; after a miss the radix take below overwrites its output.
  detail::cuda_check(
      cub::DeviceRadixSort::SortKeys(sort_tmp, sort_bytes, static_cast<const std::uint32_t*>(picks),
                                     out, static_cast<std::int64_t>(k), 0, end_bit, stream),
      "cub::DeviceRadixSort::SortKeys");
  launch_radix_topk<T>(final_vals, n, st, rs, out, k, stream);
  radix_stats_kernel<T><<<1, 1, 0, stream>>>(st, k, 0u, passes, stats);
  check_launch("radix_stats_kernel");
}

}  // namespace gradcomp::cuda::select_impl
