// gradcomp/cuda/kernels/feedback_kernels.cuh: the residual feedback's kernels (not a selector's:
// the feedback facade, cuda/feedback.cuh, launches them through the dispatch layer).
// (kernels/select_kernels.cuh says how the selection's kernels work together.)
#pragma once

#include <gradcomp/cuda/kernels/select_state.cuh>

namespace gradcomp::cuda::select_impl {

// ---------------------------------------------------------------------------------------
// Residual feedback.

// e[idx[j]] += sign * decoded[j] for j < m.
// e[idx[j]] += sign * decoded[j] for j < m: residual feedback's update (sign -1) and restore
// (+1). Every write is guarded by idx[j] < n and is an atomic add, so an index out of range is
// never written and repeated indices all count, validated or not; with the indices a selector
// makes (distinct) the result is the host's bit for bit. Does nothing when the validation
// before it found a bad index.
template <class T>
__global__ void scatter_add_kernel(T* e, std::size_t n, const std::uint32_t* idx,
                                   const float* decoded, std::size_t m, float sign,
                                   const error_record* errors) {
  if (any_error(errors, 1)) return;
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t i = idx[j];
    if (i < n) atomicAdd(e + i, static_cast<T>(sign * decoded[j]));
  }
}

// The value at *p, which becomes 0 in the same atomic step.
__device__ __forceinline__ float take_and_clear(float* p) { return atomicExch(p, 0.0f); }
__device__ __forceinline__ double take_and_clear(double* p) {
  return __longlong_as_double(static_cast<long long>(
      atomicExch(reinterpret_cast<unsigned long long*>(p), 0ull)));
}

// values[j] = e[idx[j]], then e[idx[j]] = 0, for j < min(stats->count, cap), as one atomic
// exchange per entry: an index out of range is never read or written, and a repeated index
// gives its value once (to one of its entries) and 0 to the others, so nothing is counted
// twice. Does nothing when the validation before it found a bad index.
template <class T>
__global__ void gather_clear_kernel(T* e, std::size_t n, const std::uint32_t* idx,
                                    const selection_stats* stats, std::size_t cap, T* values,
                                    const error_record* errors) {
  if (any_error(errors, 1)) return;
  const std::size_t m = stats->count < cap ? static_cast<std::size_t>(stats->count) : cap;
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t i = idx[j];
    values[j] = i < n ? take_and_clear(e + i) : T(0);
  }
}

// errors[0] = the first position j < min(stats->count, cap) with idx[j] >= n or, past the first,
// idx[j] <= idx[j - 1]: the selection's promise (ascending, distinct, in range), checked where
// its length is only known on the device. (Index is std::uint32_t: a template only so that the
// header can be part of several translation units of one program.)
template <class Index>
__global__ void validate_selection_kernel(const Index* idx, const selection_stats* stats,
                                          std::size_t cap, std::size_t n, error_record* errors) {
  const std::size_t m = stats->count < cap ? static_cast<std::size_t>(stats->count) : cap;
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const Index x = idx[j];
    if (x >= n || (j > 0 && x <= idx[j - 1])) report_error(errors, j);
  }
}

}  // namespace gradcomp::cuda::select_impl
