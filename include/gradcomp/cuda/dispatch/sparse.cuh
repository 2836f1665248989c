// gradcomp/cuda/dispatch/sparse.cuh: launch sequences of the sparse device calls: scratch
// carving (CUB convention), validation, CUB's stable radix sort for the deterministic
// scatter-add, and the one host round trip that turns a device-found bad index into the
// host's exception.
#pragma once

#include <cuda_runtime.h>
#include <cub/device/device_radix_sort.cuh>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <gradcomp/cuda/block/sparse_common.cuh>
#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/dispatch/scratch.cuh>
#include <gradcomp/cuda/kernels/sparse.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/tuning.cuh>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/device.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp::cuda::sparse_impl {

// Launch shapes: cuda/tuning.cuh.
using sparse_tuning = elementwise_tuning;

// How a rejected index is reported: invalid_argument for a gather's indices (the caller's
// selection), payload_error for scattered payloads (the host decoders' exception).
enum class index_error_kind { argument, payload };

inline void sparse_launched(const char* what) { detail::cuda_check(cudaGetLastError(), what); }

// Starts the validation of indices on `stream`: errors[0] is set to the first bad position.
inline void launch_index_check(error_record* errors, const std::uint32_t* indices, std::size_t m,
                               std::size_t n, bool increasing, cudaStream_t stream,
                               const sparse_tuning& t = sparse_tuning_sm90) {
  detail::cuda_check(cudaMemsetAsync(errors, 0xff, sizeof(error_record), stream),
                     "cudaMemsetAsync");
  if (m == 0) return;
  validate_indices_kernel<std::uint32_t>
      <<<grid_for(m, t.threads, t.max_blocks), t.threads, 0, stream>>>(indices, m, n, increasing,
                                                                       errors);
  sparse_launched("validate_indices_kernel launch");
}

// The host round trip after the kernels: waits for the stream, and throws the host's message
// for the first bad index (the kernels wrote nothing).
inline void finish_index_check(std::string_view where, index_error_kind kind,
                               const error_record* errors, const std::uint32_t* indices,
                               std::size_t n, cudaStream_t stream) {
  error_record found{};
  detail::cuda_check(cudaMemcpyAsync(&found, errors, sizeof(found), cudaMemcpyDeviceToHost, stream),
                     "cudaMemcpyAsync");
  detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (found.first == no_error) return;
  const auto j = static_cast<std::size_t>(found.first);
  std::uint32_t pair[2] = {0, 0};  // indices[j - 1], indices[j]
  const std::size_t from = j > 0 ? j - 1 : j;
  // On the caller's stream: a plain cudaMemcpy would wait for every blocking stream of the
  // device (the legacy default stream), other threads' communication included.
  detail::cuda_check(cudaMemcpyAsync(pair + (j > 0 ? 0 : 1), indices + from,
                                     (j - from + 1) * sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                                     stream),
                     "cudaMemcpyAsync");
  detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  const std::uint32_t x = pair[1];
  if (kind == index_error_kind::argument) {
    detail::throw_invalid_argument(where, detail::concat("indices[", j, "]"), x,
                                   detail::concat("< ", n, " (the dense size)"));
  }
  if (x >= n) {
    detail::throw_payload_error(where, "indices[", j, "] = ", x, "; expected < dense_size (", n,
                                ")");
  }
  detail::throw_payload_error(where, "indices[", j, "] = ", x, " after ", pair[0],
                              "; expected strictly increasing (sorted, unique)");
}

inline void check_same_size(std::string_view where, std::size_t indices, std::size_t values) {
  if (indices != values) {
    detail::throw_invalid_argument(where, "values.size()", values,
                                   detail::concat("== indices.size() (", indices, ")"));
  }
}

template <class T>
void gather(temp_storage& tmp, device_span<const T> g, device_span<const std::uint32_t> indices,
            device_span<float> values, cudaStream_t stream, device_validation validation,
            const sparse_tuning& t = sparse_tuning_sm90) {
  constexpr std::string_view where = "cuda::gather";
  check_same_size(where, indices.size(), values.size());
  scratch_carver s(tmp.ptr);
  error_record* errors = s.take<error_record>(1);
  if (finish_size_query(where, tmp, s) || indices.empty()) return;
  const bool check = validation == device_validation::check;
  if (check) launch_index_check(errors, indices.data(), indices.size(), g.size(), false, stream);
  const std::size_t m = indices.size();
  gather_kernel<T><<<grid_for(m, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      g.data(), g.size(), indices.data(), m, values.data(), check ? errors : nullptr);
  sparse_launched("gather_kernel launch");
  if (check) {
    finish_index_check(where, index_error_kind::argument, errors, indices.data(), g.size(), stream);
  }
}

template <class T>
void scatter_add_atomic(temp_storage& tmp, device_span<const std::uint32_t> indices,
                        device_span<const float> values, device_span<T> dense, cudaStream_t stream,
                        device_validation validation, const sparse_tuning& t = sparse_tuning_sm90) {
  constexpr std::string_view where = "cuda::scatter_add_atomic";
  check_same_size(where, indices.size(), values.size());
  scratch_carver s(tmp.ptr);
  error_record* errors = s.take<error_record>(1);
  if (finish_size_query(where, tmp, s) || indices.empty()) return;
  const bool check = validation == device_validation::check;
  const std::size_t m = indices.size();
  if (check) launch_index_check(errors, indices.data(), m, dense.size(), false, stream);
  scatter_add_atomic_kernel<T><<<grid_for(m, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      indices.data(), values.data(), m, dense.data(), dense.size(), check ? errors : nullptr);
  sparse_launched("scatter_add_atomic_kernel launch");
  if (check) {
    finish_index_check(where, index_error_kind::payload, errors, indices.data(), dense.size(),
                       stream);
  }
}

// Key bits the radix sort needs for indices < n (all 32 when the indices are not checked,
// so that an index out of range cannot alias an index in range).
inline int sort_end_bit(std::size_t n, bool checked) {
  if (!checked || n > 0xffffffffu) return 32;
  const int bits = static_cast<int>(detail::bit_width_u32(static_cast<std::uint32_t>(n - 1)));
  return bits > 0 ? bits : 1;
}

template <class T>
void scatter_add_sorted(temp_storage& tmp, device_span<const std::uint32_t> indices,
                        device_span<const float> values, device_span<T> dense, cudaStream_t stream,
                        device_validation validation, const sparse_tuning& t = sparse_tuning_sm90) {
  constexpr std::string_view where = "cuda::scatter_add_sorted";
  check_same_size(where, indices.size(), values.size());
  const std::size_t m = indices.size();
  const bool check = validation == device_validation::check;
  const int end_bit = dense.empty() ? 1 : sort_end_bit(dense.size(), check);
  std::size_t sort_bytes = 0;
  if (m > 0) {
    detail::cuda_check(cub::DeviceRadixSort::SortPairs(
                           nullptr, sort_bytes, static_cast<const std::uint32_t*>(nullptr),
                           static_cast<std::uint32_t*>(nullptr), static_cast<const float*>(nullptr),
                           static_cast<float*>(nullptr), m, 0, end_bit, stream),
                       "cub::DeviceRadixSort::SortPairs (size query)");
  }
  scratch_carver s(tmp.ptr);
  error_record* errors = s.take<error_record>(1);
  std::uint32_t* keys = s.take<std::uint32_t>(m);
  float* sorted = s.take<float>(m);
  void* sort_tmp = s.take_bytes(sort_bytes);
  if (finish_size_query(where, tmp, s) || m == 0) return;
  if (check) launch_index_check(errors, indices.data(), m, dense.size(), false, stream);
  // Stable: entries of one index keep their order, so the runs add in payload (rank) order.
  detail::cuda_check(cub::DeviceRadixSort::SortPairs(sort_tmp, sort_bytes, indices.data(), keys,
                                                     values.data(), sorted, m, 0, end_bit, stream),
                     "cub::DeviceRadixSort::SortPairs");
  scatter_add_runs_kernel<T><<<grid_for(m, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      keys, sorted, m, dense.data(), dense.size(), check ? errors : nullptr);
  sparse_launched("scatter_add_runs_kernel launch");
  if (check) {
    finish_index_check(where, index_error_kind::payload, errors, indices.data(), dense.size(),
                       stream);
  }
}

template <class T>
void decompress(temp_storage& tmp, device_span<const std::uint32_t> indices,
                device_span<const float> values, device_span<T> dense, cudaStream_t stream,
                device_validation validation, const sparse_tuning& t = sparse_tuning_sm90) {
  constexpr std::string_view where = "cuda::decompress";
  check_same_size(where, indices.size(), values.size());
  if (indices.size() > dense.size()) {
    detail::throw_payload_error(where, "count ", indices.size(), " exceeds dense_size ",
                                dense.size());
  }
  scratch_carver s(tmp.ptr);
  error_record* errors = s.take<error_record>(1);
  if (finish_size_query(where, tmp, s) || dense.empty()) return;
  const bool check = validation == device_validation::check;
  const std::size_t m = indices.size();
  if (check) launch_index_check(errors, indices.data(), m, dense.size(), true, stream);
  const error_record* gate = check ? errors : nullptr;
  zero_kernel<T><<<grid_for(dense.size(), t.threads, t.max_blocks), t.threads, 0, stream>>>(
      dense.data(), dense.size(), gate);
  sparse_launched("zero_kernel launch");
  if (m > 0) {
    scatter_overwrite_kernel<T><<<grid_for(m, t.threads, t.max_blocks), t.threads, 0, stream>>>(
        indices.data(), values.data(), m, dense.data(), dense.size(), gate);
    sparse_launched("scatter_overwrite_kernel launch");
  }
  if (check) {
    finish_index_check(where, index_error_kind::payload, errors, indices.data(), dense.size(),
                       stream);
  }
}

}  // namespace gradcomp::cuda::sparse_impl
