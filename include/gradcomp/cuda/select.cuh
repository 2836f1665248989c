// gradcomp/cuda/select.cuh: the device implementations of topk, gaussiank, threshold and
// randomk, so that the same selector objects work on device memory:
//
//   gradcomp::topk sel;                       // same settings as on the host
//   gradcomp::temp_storage tmp;               // CUB convention: size query, then the call
//   gradcomp::on_device(sel).select(tmp, g, ctx, indices, d_stats, stream);  // sets tmp.bytes
//   cudaMalloc(&tmp.ptr, tmp.bytes);
//   gradcomp::on_device(sel).select(tmp, g, ctx, indices, d_stats, stream);  // asynchronous
//
// g is a device_span<const T> (T float or double), indices a device_span<uint32_t>, d_stats a
// selection_stats* in device memory that receives what the host call returns. The size query
// depends only on the selector's settings, n and k. Arguments are checked like the host's (same
// exceptions, thrown before anything is launched); device contents are not looked at.
//
//  - topk: the host's index set (largest |g| keys, NaN above +Inf, ties to the lower index),
//    ascending, in indices[0, k); indices.size() >= k. stats as the host's: threshold = |g| of
//    the k-th, fallback when the sampled bracket missed (the host's plan and criteria), and
//    iterations = radix passes after a miss or with topk_method::radix.
//  - gaussiank: {i : |g_i| > threshold} ascending (with cap_at_k at most k), within the
//    tolerance documented in dispatch/gaussiank.cuh; stats.count is the full count and at most
//    indices.size() indices are written (pass n for all). NaN or Inf: the exact top-k, fallback.
//  - threshold: {i : |g_i| >= tau} ascending, the same count rule as gaussiank.
//  - randomk: the host's k indices (a function of ctx.id's seed, step and tensor id, n and k,
//    never of g), ascending. Floyd's draw is sequential and reads no value, so it runs on the
//    host (O(k) work), and the indices are copied to the device on the stream from a host
//    vector; the call then waits for the stream, so that the vector outlives the copy: it
//    blocks, and cannot be captured in a CUDA graph. (device_sparsified_sgd draws all its
//    tensors into pinned memory instead, with one copy and no wait of its own.) stats as the
//    host's: count k, threshold 0.
//  - on_device(sel).select_accumulate(tmp, e, g, ctx, indices, d_stats, stream) for topk,
//    gaussiank and randomk: the selection of e + g, leaving e = e + g, with the addition fused
//    into the first pass (randomk: one pass that adds, as it reads nothing else).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <gradcomp/context.hpp>
#include <gradcomp/cuda/dispatch/gaussiank.cuh>
#include <gradcomp/cuda/dispatch/topk.cuh>
#include <gradcomp/device.hpp>
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/randomk.hpp>
#include <gradcomp/select/threshold.hpp>
#include <gradcomp/select/topk.hpp>

namespace gradcomp {

namespace cuda::select_impl {

template <class T>
inline constexpr bool device_value = std::is_same_v<T, float> || std::is_same_v<T, double>;

inline void check_device_outputs(const char* where, std::size_t capacity, std::size_t need,
                                 const selection_stats* stats) {
  if (capacity < need) {
    detail::throw_invalid_argument(where, "indices.size()", capacity,
                                   detail::concat(">= k (k = ", need, ")"));
  }
  if (stats == nullptr) {
    detail::throw_invalid_argument(where, "stats", "nullptr", "a selection_stats in device memory");
  }
}

inline void check_same_size(const char* where, std::size_t e, std::size_t g) {
  if (e != g) {
    detail::throw_invalid_argument(where, "e.size()", e, detail::concat("g.size() (", g, ")"));
  }
}

// The host's decisions for this call (topk::select_from's paths, topk::bracket_plan): the
// dispatch layer runs the plan and never sees the policy.
inline topk_plan plan_topk(const topk& sel, std::size_t n, std::size_t k) {
  topk_plan p;
  p.forced = sel.method == topk_method::radix;
  if (p.forced || k == n || n <= detail::topk_direct_max || k <= sel.heap_max_k) {
    p.radix_only = true;
    return p;
  }
  const detail::topk_bracket_plan b = sel.bracket_plan(n, k);
  p.s = b.s;
  p.lo_pos = b.lo_pos;
  p.hi = b.hi;
  p.hi_pos = b.hi_pos;
  p.budget = b.budget;
  return p;
}

}  // namespace cuda::select_impl

template <>
class device_policy<topk> {
 public:
  explicit device_policy(const topk& policy) noexcept : sel_(policy) {}

  template <class U>
  requires cuda::select_impl::device_value<std::remove_const_t<U>>
  void select(temp_storage& tmp, device_span<U> g, const select_context& ctx,
              device_span<std::uint32_t> indices, selection_stats* stats,
              cudaStream_t stream = nullptr) const {
    using T = std::remove_const_t<U>;
    sel_.check();
    detail::check_index_range("topk", g.size());
    check_k("topk", ctx.k, g.size());
    cuda::select_impl::check_device_outputs("topk", indices.size(), ctx.k, stats);
    const auto plan = cuda::select_impl::plan_topk(sel_, g.size(), ctx.k);
    cuda::select_impl::topk_run<T>(plan, tmp, nullptr, g.data(), g.size(), ctx.k, indices.data(),
                                   stats, stream);
  }

  template <class T, class U>
  requires cuda::select_impl::device_value<T> && std::is_same_v<std::remove_const_t<U>, T>
  void select_accumulate(temp_storage& tmp, device_span<T> e, device_span<U> g,
                         const select_context& ctx, device_span<std::uint32_t> indices,
                         selection_stats* stats, cudaStream_t stream = nullptr) const {
    cuda::select_impl::check_same_size("topk::select_accumulate", e.size(), g.size());
    sel_.check();
    detail::check_index_range("topk", g.size());
    check_k("topk", ctx.k, g.size());
    cuda::select_impl::check_device_outputs("topk", indices.size(), ctx.k, stats);
    const auto plan = cuda::select_impl::plan_topk(sel_, g.size(), ctx.k);
    cuda::select_impl::topk_run<T>(plan, tmp, e.data(), g.data(), g.size(), ctx.k, indices.data(),
                                   stats, stream);
  }

 private:
  const topk& sel_;
};

template <>
class device_policy<gaussiank> {
 public:
  explicit device_policy(const gaussiank& policy) noexcept : sel_(policy) {}

  template <class U>
  requires cuda::select_impl::device_value<std::remove_const_t<U>>
  void select(temp_storage& tmp, device_span<U> g, const select_context& ctx,
              device_span<std::uint32_t> indices, selection_stats* stats,
              cudaStream_t stream = nullptr) const {
    using T = std::remove_const_t<U>;
    sel_.check();
    detail::check_index_range("gaussiank", g.size());
    check_k("gaussiank", ctx.k, g.size());
    cuda::select_impl::check_device_outputs("gaussiank", indices.size(), sel_.cap_at_k ? ctx.k : 0,
                                            stats);
    cuda::select_impl::gaussiank_run<T>(sel_, tmp, nullptr, g.data(), g.size(), ctx.k,
                                        indices.data(), indices.size(), stats, stream);
  }

  template <class T, class U>
  requires cuda::select_impl::device_value<T> && std::is_same_v<std::remove_const_t<U>, T>
  void select_accumulate(temp_storage& tmp, device_span<T> e, device_span<U> g,
                         const select_context& ctx, device_span<std::uint32_t> indices,
                         selection_stats* stats, cudaStream_t stream = nullptr) const {
    cuda::select_impl::check_same_size("gaussiank::select_accumulate", e.size(), g.size());
    sel_.check();
    detail::check_index_range("gaussiank", g.size());
    check_k("gaussiank", ctx.k, g.size());
    cuda::select_impl::check_device_outputs("gaussiank", indices.size(), sel_.cap_at_k ? ctx.k : 0,
                                            stats);
    cuda::select_impl::gaussiank_run<T>(sel_, tmp, e.data(), g.data(), g.size(), ctx.k,
                                        indices.data(), indices.size(), stats, stream);
  }

 private:
  const gaussiank& sel_;
};

template <>
class device_policy<randomk> {
 public:
  // randomk has no settings (its sampler is the host calls' scratch).
  explicit device_policy(const randomk&) noexcept {}

  template <class U>
  requires cuda::select_impl::device_value<std::remove_const_t<U>>
  void select(temp_storage& tmp, device_span<U> g, const select_context& ctx,
              device_span<std::uint32_t> indices, selection_stats* stats,
              cudaStream_t stream = nullptr) const {
    run(tmp, static_cast<std::remove_const_t<U>*>(nullptr), g.data(), g.size(), ctx, indices,
        stats, stream);
  }

  template <class T, class U>
  requires cuda::select_impl::device_value<T> && std::is_same_v<std::remove_const_t<U>, T>
  void select_accumulate(temp_storage& tmp, device_span<T> e, device_span<U> g,
                         const select_context& ctx, device_span<std::uint32_t> indices,
                         selection_stats* stats, cudaStream_t stream = nullptr) const {
    cuda::select_impl::check_same_size("randomk::select_accumulate", e.size(), g.size());
    run(tmp, e.data(), g.data(), g.size(), ctx, indices, stats, stream);
  }

 private:
  // e != nullptr: e += g first (on the stream, before the indices are copied).
  template <class T>
  static void run(temp_storage& tmp, T* e, const T* g, std::size_t n, const select_context& ctx,
                  device_span<std::uint32_t> indices, selection_stats* stats,
                  cudaStream_t stream) {
    detail::check_index_range("randomk", n);
    check_k("randomk", ctx.k, n);
    cuda::select_impl::check_device_outputs("randomk", indices.size(), ctx.k, stats);
    const cuda::scratch_carver c(tmp.ptr);  // no scratch: the CUB convention all the same
    if (cuda::finish_size_query("randomk", tmp, c)) return;
    if (e && n > 0) cuda::feedback_impl::launch_accumulate(e, g, n, stream);
    const std::size_t k = ctx.k;
    if (k > 0) {
      std::vector<std::uint32_t> drawn(k);
      detail::floyd_sampler sampler;  // the policy's own is the host calls' scratch
      randomk::draw(sampler, n, k, ctx.id, drawn.data());
      detail::cuda_check(cudaMemcpyAsync(indices.data(), drawn.data(), k * sizeof(std::uint32_t),
                                         cudaMemcpyHostToDevice, stream),
                         "cudaMemcpyAsync");
      // The runtime may still read `drawn` after the call (pageable memory): it lives until
      // the copy is done.
      detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    }
    cuda::select_impl::write_stats_kernel<<<1, 1, 0, stream>>>(stats, k, 0.0, 0, false);
    cuda::check_launch("write_stats_kernel");
  }
};

template <>
class device_policy<threshold> {
 public:
  explicit device_policy(const threshold& policy) noexcept : sel_(policy) {}

  template <class U>
  requires cuda::select_impl::device_value<std::remove_const_t<U>>
  void select(temp_storage& tmp, device_span<U> g, const select_context& /*ctx: k unused*/,
              device_span<std::uint32_t> indices, selection_stats* stats,
              cudaStream_t stream = nullptr) const {
    using T = std::remove_const_t<U>;
    sel_.check();
    detail::check_index_range("threshold", g.size());
    cuda::select_impl::check_device_outputs("threshold", indices.size(), 0, stats);
    cuda::select_impl::threshold_run<T>(sel_, tmp, g.data(), g.size(), indices.data(),
                                        indices.size(), stats, stream);
  }

 private:
  const threshold& sel_;
};

}  // namespace gradcomp
