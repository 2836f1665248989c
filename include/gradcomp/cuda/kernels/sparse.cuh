// gradcomp/cuda/kernels/sparse.cuh: gather by index and scatter into a dense buffer. Every
// kernel that writes first reads the error record of the validation kernel before it (when
// there is one) and then does nothing, and every write is guarded by index < n, so an index
// out of range is never written, validated or not.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <gradcomp/config.hpp>
#include <gradcomp/cuda/block/sparse_common.cuh>

namespace gradcomp::cuda::sparse_impl {

GRADCOMP_DEVICE std::size_t first_index() {
  return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
GRADCOMP_DEVICE std::size_t grid_stride() {
  return static_cast<std::size_t>(gridDim.x) * blockDim.x;
}

// errors[0] = the first position j where indices[j] >= n, or (increasing) where
// indices[j] <= indices[j - 1]: the host's validate_indices rule, whose message the host
// side builds from indices[j] and indices[j - 1]. (Index is always std::uint32_t: a template
// only so that this header can be included by several translation units of one program.)
template <class Index>
__global__ void validate_indices_kernel(const Index* indices, std::size_t m, std::size_t n,
                                        bool increasing, error_record* errors) {
  for (std::size_t j = first_index(); j < m; j += grid_stride()) {
    const Index x = indices[j];
    if (x >= n || (increasing && j > 0 && x <= indices[j - 1])) report_error(errors, j);
  }
}

template <class T>
__global__ void gather_kernel(const T* g, std::size_t n, const std::uint32_t* indices,
                              std::size_t m, float* values, const error_record* errors) {
  if (any_error(errors, 1)) return;
  for (std::size_t j = first_index(); j < m; j += grid_stride()) {
    const std::uint32_t x = indices[j];
    if (x < n) values[j] = static_cast<float>(g[x]);
  }
}

// The fast path: one atomicAdd per entry. The order in which entries of the same index are
// added is up to the hardware, so the rounding (and the bits of the result) can change from
// run to run.
template <class T>
__global__ void scatter_add_atomic_kernel(const std::uint32_t* indices, const float* values,
                                          std::size_t m, T* dense, std::size_t n,
                                          const error_record* errors) {
  if (any_error(errors, 1)) return;
  for (std::size_t j = first_index(); j < m; j += grid_stride()) {
    const std::uint32_t x = indices[j];
    if (x < n) atomicAdd(dense + x, static_cast<T>(values[j]));
  }
}

// The deterministic path, after a stable sort of (index, value) by index: the first entry of
// each run of equal indices adds the run's values to dense[index] one by one, in their order
// before the sort, exactly as the host adds payloads in rank order:
// dense[x] = ((dense[x] + v_0) + v_1) + ... One thread per run, no atomics, no other order.
template <class T>
__global__ void scatter_add_runs_kernel(const std::uint32_t* keys, const float* values,
                                        std::size_t m, T* dense, std::size_t n,
                                        const error_record* errors) {
  if (any_error(errors, 1)) return;
  for (std::size_t j = first_index(); j < m; j += grid_stride()) {
    const std::uint32_t x = keys[j];
    if ((j > 0 && keys[j - 1] == x) || x >= n) continue;  // not the first of its run
    T acc = dense[x];
    for (std::size_t i = j; i < m && keys[i] == x; ++i) acc += static_cast<T>(values[i]);
    dense[x] = acc;
  }
}

template <class T>
__global__ void zero_kernel(T* dense, std::size_t n, const error_record* errors) {
  if (any_error(errors, 1)) return;
  for (std::size_t i = first_index(); i < n; i += grid_stride()) dense[i] = T(0);
}

// dense[indices[j]] = 0 + values[j] for unique indices, after zero_kernel: the host's
// fill-then-add, whose 0 + (-0) = +0 is kept by writing +0 for either zero; a NaN is
// copied with its bits (the host's 0 + NaN keeps a quiet NaN's bits too).
template <class T>
__global__ void scatter_overwrite_kernel(const std::uint32_t* indices, const float* values,
                                         std::size_t m, T* dense, std::size_t n,
                                         const error_record* errors) {
  if (any_error(errors, 1)) return;
  for (std::size_t j = first_index(); j < m; j += grid_stride()) {
    const std::uint32_t x = indices[j];
    const float v = values[j];
    if (x < n) dense[x] = v == 0.0f ? T(0) : static_cast<T>(v);
  }
}

}  // namespace gradcomp::cuda::sparse_impl
