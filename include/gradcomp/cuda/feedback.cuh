// gradcomp/cuda/feedback.cuh: residual error feedback on device memory. The residual is a
// device_span<T> e (the host state's vector, on the device):
//   on_device(fb).accumulate(tmp, e, g, stream)                      e += g
//   on_device(fb).update(tmp, e, idx, decoded, stream)               e[idx[j]] -= decoded[j]
//   on_device(fb).restore(tmp, e, idx, decoded, stream)              e[idx[j]] += decoded[j]
//   on_device(fb).gather_and_clear(tmp, e, idx, d_stats, values, stream)
//        values[j] = e[idx[j]], then e[idx[j]] = 0, for j < d_stats->count (read on the device)
// The fused step of TopK-SGD with error feedback is then
//   on_device(sel).select_accumulate(tmp, e, g, ctx, idx, d_stats, stream);  // e += g, select
//   on_device(fb).gather_and_clear(tmp, e, idx, d_stats, values, stream);    // e = 0 there
// which is compressor<>'s accumulate/select/update with exact (unquantized) values. None of
// these needs scratch: the size query sets tmp.bytes = 0. Sizes are checked like the host's;
// the indices are device data and are not range-checked (they come from a selector).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <gradcomp/context.hpp>
#include <gradcomp/cuda/dispatch/radix_select.cuh>
#include <gradcomp/cuda/kernels/select_kernels.cuh>
#include <gradcomp/device.hpp>
#include <gradcomp/feedback/residual.hpp>

namespace gradcomp {

template <>
class device_policy<residual> {
 public:
  // residual has no settings: nothing to keep.
  explicit device_policy(const residual&) noexcept {}

  template <class T, class U>
  requires std::is_same_v<std::remove_const_t<U>, T>
  void accumulate(temp_storage& tmp, device_span<T> e, device_span<U> g,
                  cudaStream_t stream = nullptr) const {
    detail::check_feedback_size("residual::accumulate", g.size(), e.size());
    if (tmp.is_size_query()) {
      tmp.bytes = 0;
      return;
    }
    if (e.empty()) return;
    cuda::select_impl::axpy_kernel<T>
        <<<cuda::grid_for(e.size(), 256, 4096), 256, 0, stream>>>(e.data(), g.data(), e.size());
    cuda::check_launch("axpy_kernel");
  }

  template <class T, class I, class F>
  void update(temp_storage& tmp, device_span<T> e, device_span<I> idx, device_span<F> decoded,
              cudaStream_t stream = nullptr) const {
    scatter(tmp, e, idx, decoded, -1.0f, "residual::update", stream);
  }

  template <class T, class I, class F>
  void restore(temp_storage& tmp, device_span<T> e, device_span<I> idx, device_span<F> decoded,
               cudaStream_t stream = nullptr) const {
    scatter(tmp, e, idx, decoded, 1.0f, "residual::restore", stream);
  }

  template <class T, class I>
  requires std::is_same_v<std::remove_const_t<I>, std::uint32_t>
  void gather_and_clear(temp_storage& tmp, device_span<T> e, device_span<I> idx,
                        const selection_stats* stats, device_span<T> values,
                        cudaStream_t stream = nullptr) const {
    if (values.size() < idx.size()) {
      detail::throw_invalid_argument("residual::gather_and_clear", "values.size()", values.size(),
                                     detail::concat(">= indices.size() (", idx.size(), ")"));
    }
    if (stats == nullptr) {
      detail::throw_invalid_argument("residual::gather_and_clear", "stats", "nullptr",
                                     "a selection_stats in device memory");
    }
    if (tmp.is_size_query()) {
      tmp.bytes = 0;
      return;
    }
    if (idx.empty()) return;
    cuda::select_impl::gather_clear_kernel<T>
        <<<cuda::grid_for(idx.size(), 256, 4096), 256, 0, stream>>>(e.data(), idx.data(), stats,
                                                                    idx.size(), values.data());
    cuda::check_launch("gather_clear_kernel");
  }

 private:
  template <class T, class I, class F>
  void scatter(temp_storage& tmp, device_span<T> e, device_span<I> idx, device_span<F> decoded,
               float sign, const char* where, cudaStream_t stream) const {
    static_assert(std::is_same_v<std::remove_const_t<I>, std::uint32_t>, "indices are uint32");
    static_assert(std::is_same_v<std::remove_const_t<F>, float>, "decoded values are float");
    if (idx.size() != decoded.size()) {
      detail::throw_invalid_argument(where, "decoded.size()", decoded.size(),
                                     detail::concat("equal to indices.size() (", idx.size(), ")"));
    }
    if (tmp.is_size_query()) {
      tmp.bytes = 0;
      return;
    }
    if (idx.empty()) return;
    cuda::select_impl::scatter_add_kernel<T>
        <<<cuda::grid_for(idx.size(), 256, 4096), 256, 0, stream>>>(
            e.data(), idx.data(), decoded.data(), idx.size(), sign);
    cuda::check_launch("scatter_add_kernel");
  }
};

}  // namespace gradcomp
