// gradcomp/cuda/dispatch/feedback.cuh: the launches of the residual feedback's kernels
// (kernels/feedback_kernels.cuh) and of e += g, with the shapes of cuda/tuning.cuh. The facade
// (cuda/feedback.cuh, and the selectors that fuse the accumulation) checks its arguments and
// calls these; nothing above this layer launches a kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <gradcomp/context.hpp>
#include <gradcomp/cuda/block/sparse_common.cuh>
#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/kernels/feedback_kernels.cuh>
#include <gradcomp/cuda/kernels/select_state.cuh>
#include <gradcomp/cuda/tuning.cuh>

namespace gradcomp::cuda::feedback_impl {

// e[i] += g[i], i < n.
template <class T>
void launch_accumulate(T* e, const T* g, std::size_t n, cudaStream_t stream,
                       const elementwise_tuning& t = feedback_tuning_sm90) {
  select_impl::axpy_kernel<T><<<grid_for(n, t.threads, t.max_blocks), t.threads, 0, stream>>>(e, g, n);
  check_launch("axpy_kernel");
}

// Checks a selection's m indices on the device (each < n, ascending, distinct), recording the
// first bad one in `errors`.
inline void launch_validate_selection(const std::uint32_t* idx, const selection_stats* stats,
                                      std::size_t m, std::size_t n, error_record* errors,
                                      cudaStream_t stream,
                                      const elementwise_tuning& t = feedback_tuning_sm90) {
  select_impl::validate_selection_kernel<std::uint32_t>
      <<<grid_for(m, t.threads, t.max_blocks), t.threads, 0, stream>>>(idx, stats, m, n, errors);
  check_launch("validate_selection_kernel");
}

// values[j] = e[idx[j]], then e[idx[j]] = 0, for j < stats->count (m entries at most); writes
// nothing where `errors` (when given) holds a bad index.
template <class T>
void launch_gather_clear(T* e, std::size_t n, const std::uint32_t* idx,
                         const selection_stats* stats, std::size_t m, T* values,
                         const error_record* errors, cudaStream_t stream,
                         const elementwise_tuning& t = feedback_tuning_sm90) {
  select_impl::gather_clear_kernel<T><<<grid_for(m, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      e, n, idx, stats, m, values, errors);
  check_launch("gather_clear_kernel");
}

// e[idx[j]] += sign * decoded[j] for j < m (atomic adds, every write guarded by idx[j] < n);
// writes nothing where `errors` (when given) holds a bad index.
template <class T>
void launch_scatter_add(T* e, std::size_t n, const std::uint32_t* idx, const float* decoded,
                        std::size_t m, float sign, const error_record* errors, cudaStream_t stream,
                        const elementwise_tuning& t = feedback_tuning_sm90) {
  select_impl::scatter_add_kernel<T><<<grid_for(m, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      e, n, idx, decoded, m, sign, errors);
  check_launch("scatter_add_kernel");
}

}  // namespace gradcomp::cuda::feedback_impl
