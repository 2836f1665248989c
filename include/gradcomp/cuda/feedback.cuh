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
// which is compressor<>'s accumulate/select/update with exact (unquantized) values.
//
// The host's promises hold by construction: sizes are checked like the host's before anything
// is launched; no index at or past e.size() is ever read or written (every access is guarded);
// a repeated index is added once per entry by update/restore (atomic adds), and given to one
// entry only by gather_and_clear (an atomic exchange with 0), so nothing is lost or counted
// twice. With device_validation::check (the default) the indices are checked on the device
// first (update, restore: each < e.size(); gather_and_clear: ascending and distinct too, the
// selector's promise), nothing is written when one is bad, and the call waits for the stream
// once to throw the host's invalid_argument; device_validation::trusted skips the check and
// the wait (for indices a device selector just made, and inside CUDA graphs). update, restore
// and gather_and_clear use a few bytes of scratch (the size query tells how many); accumulate
// none.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <gradcomp/context.hpp>
#include <gradcomp/cuda/block/sparse_common.cuh>
#include <gradcomp/cuda/dispatch/feedback.cuh>
#include <gradcomp/cuda/dispatch/scratch.cuh>
#include <gradcomp/cuda/dispatch/sparse.cuh>
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
    cuda::feedback_impl::launch_accumulate(e.data(), g.data(), e.size(), stream);
  }

  template <class T, class I, class F>
  void update(temp_storage& tmp, device_span<T> e, device_span<I> idx, device_span<F> decoded,
              cudaStream_t stream = nullptr,
              device_validation validation = device_validation::check) const {
    scatter(tmp, e, idx, decoded, -1.0f, "residual::update", stream, validation);
  }

  template <class T, class I, class F>
  void restore(temp_storage& tmp, device_span<T> e, device_span<I> idx, device_span<F> decoded,
               cudaStream_t stream = nullptr,
               device_validation validation = device_validation::check) const {
    scatter(tmp, e, idx, decoded, 1.0f, "residual::restore", stream, validation);
  }

  template <class T, class I>
  requires std::is_same_v<std::remove_const_t<I>, std::uint32_t>
  void gather_and_clear(temp_storage& tmp, device_span<T> e, device_span<I> idx,
                        const selection_stats* stats, device_span<T> values,
                        cudaStream_t stream = nullptr,
                        device_validation validation = device_validation::check) const {
    constexpr std::string_view where = "residual::gather_and_clear";
    if (values.size() < idx.size()) {
      detail::throw_invalid_argument(where, "values.size()", values.size(),
                                     detail::concat(">= indices.size() (", idx.size(), ")"));
    }
    if (stats == nullptr) {
      detail::throw_invalid_argument(where, "stats", "nullptr", "a selection_stats in device memory");
    }
    cuda::scratch_carver s(tmp.ptr);
    cuda::error_record* errors = s.take<cuda::error_record>(1);
    if (cuda::finish_size_query(where, tmp, s) || idx.empty()) return;
    const bool check = validation == device_validation::check;
    if (check) {
      detail::cuda_check(cudaMemsetAsync(errors, 0xff, sizeof(cuda::error_record), stream),
                         "cudaMemsetAsync");
      cuda::feedback_impl::launch_validate_selection(idx.data(), stats, idx.size(), e.size(),
                                                     errors, stream);
    }
    cuda::feedback_impl::launch_gather_clear(e.data(), e.size(), idx.data(), stats, idx.size(),
                                             values.data(), check ? errors : nullptr, stream);
    if (check) finish_check(where, errors, idx.data(), e.size(), stream);
  }

 private:
  template <class T, class I, class F>
  void scatter(temp_storage& tmp, device_span<T> e, device_span<I> idx, device_span<F> decoded,
               float sign, std::string_view where, cudaStream_t stream,
               device_validation validation) const {
    static_assert(std::is_same_v<std::remove_const_t<I>, std::uint32_t>, "indices are uint32");
    static_assert(std::is_same_v<std::remove_const_t<F>, float>, "decoded values are float");
    if (idx.size() != decoded.size()) {
      detail::throw_invalid_argument(where, "decoded.size()", decoded.size(),
                                     detail::concat("equal to indices.size() (", idx.size(), ")"));
    }
    cuda::scratch_carver s(tmp.ptr);
    cuda::error_record* errors = s.take<cuda::error_record>(1);
    if (cuda::finish_size_query(where, tmp, s) || idx.empty()) return;
    const bool check = validation == device_validation::check;
    // Only the range, as the host's update() and restore() check.
    if (check) {
      cuda::sparse_impl::launch_index_check(errors, idx.data(), idx.size(), e.size(),
                                            /*increasing=*/false, stream);
    }
    cuda::feedback_impl::launch_scatter_add(e.data(), e.size(), idx.data(), decoded.data(),
                                            idx.size(), sign, check ? errors : nullptr, stream);
    if (check) finish_check(where, errors, idx.data(), e.size(), stream);
  }

  // Waits for the stream and throws the host's invalid_argument for the first bad index.
  static void finish_check(std::string_view where, const cuda::error_record* errors,
                           const std::uint32_t* idx, std::size_t n, cudaStream_t stream) {
    cuda::error_record found{};
    detail::cuda_check(
        cudaMemcpyAsync(&found, errors, sizeof(found), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync");
    detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (found.first == cuda::no_error) return;
    const auto j = static_cast<std::size_t>(found.first);
    std::uint32_t pair[2] = {0, 0};  // idx[j - 1], idx[j]
    const std::size_t from = j > 0 ? j - 1 : j;
    detail::cuda_check(cudaMemcpyAsync(pair + (j > 0 ? 0 : 1), idx + from,
                                       (j - from + 1) * sizeof(std::uint32_t),
                                       cudaMemcpyDeviceToHost, stream),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (pair[1] >= n) {
      detail::throw_invalid_argument(where, detail::concat("indices[", j, "]"), pair[1],
                                     detail::concat("< n (n = ", n, ")"));
    }
    detail::throw_invalid_argument(where, detail::concat("indices[", j, "]"), pair[1],
                                   detail::concat("> indices[", j - 1, "] = ", pair[0],
                                                  " (a selection is ascending and distinct)"));
  }
};

}  // namespace gradcomp
