// gradcomp/cuda/sparse.cuh: sparse payloads on the device: gather the selected values of a
// gradient, and add received payloads (or write one) into a dense buffer. Every call takes
// the caller's scratch CUB style (tmp.ptr == nullptr: only set tmp.bytes) and a stream.
//
// Indices are uint32 as in the host payload. Input that concatenates several payloads must
// keep them in rank order (payload of rank 0 first, ...); within a payload the order does not
// matter to these calls.
//
// Determinism and agreement with the host (T = float or double, values float):
//  - gather: exact, values[j] = float(g[indices[j]]).
//  - scatter_add_sorted: bit-identical from run to run and to the host's rank-order sum
//    (sparse_allgather: dense[x] += value, payload after payload), for any starting dense:
//    a stable radix sort by index keeps each index's entries in input order and one thread
//    adds them to dense[x] left to right. CUB's ReduceByKey is not used because its
//    decoupled look-back may group the additions differently from run to run. Not
//    bit-identical: NaN payload bits (device arithmetic returns the canonical NaN where the
//    host keeps the operand's payload); every non-NaN bit pattern is.
//  - scatter_add_atomic: the fast path, NOT deterministic: entries of the same index are added
//    in whatever order the atomics land, so results can differ from run to run and from the
//    host in the last bits (within a few ulp of the sum magnitudes). With unique indices (one
//    payload) each element gets exactly one addition and the result is exact.
//  - decompress (overwrite, one payload with strictly increasing indices): bit-identical to
//    the host's fill-with-zero-then-add (-0 becomes +0 as there; a quiet NaN keeps its bits).
//
// Validation (device_validation::check, the default): indices are checked on the device
// before anything is written (in range; for decompress also strictly increasing, the host's
// validate_indices rule); the writing kernels do nothing if one is bad, and the call waits for
// the stream once to throw the host's exception (payload_error for scatter and decompress,
// invalid_argument for gather) naming the first bad position. device_validation::trusted skips
// the check and the wait, for indices the host wire decoder already accepted; even then an
// index out of range is never written (it is skipped).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <gradcomp/cuda/dispatch/sparse.cuh>
#include <gradcomp/device.hpp>

namespace gradcomp::cuda {

// values[j] = float(g[indices[j]]), j < indices.size() == values.size().
// T: float or double, const or not.
template <class T>
void gather(temp_storage& tmp, device_span<T> g, device_span<const std::uint32_t> indices,
            device_span<float> values, cudaStream_t stream = nullptr,
            device_validation validation = device_validation::check) {
  using U = std::remove_const_t<T>;
  sparse_impl::gather<U>(tmp, device_span<const U>(g), indices, values, stream, validation);
}

// dense[indices[j]] += T(values[j]) with atomics: fast, not deterministic (see above).
template <class T>
void scatter_add_atomic(temp_storage& tmp, device_span<const std::uint32_t> indices,
                        device_span<const float> values, device_span<T> dense,
                        cudaStream_t stream = nullptr,
                        device_validation validation = device_validation::check) {
  sparse_impl::scatter_add_atomic<T>(tmp, indices, values, dense, stream, validation);
}

// dense[indices[j]] += T(values[j]) in input order per index: deterministic, equal to the host.
template <class T>
void scatter_add_sorted(temp_storage& tmp, device_span<const std::uint32_t> indices,
                        device_span<const float> values, device_span<T> dense,
                        cudaStream_t stream = nullptr,
                        device_validation validation = device_validation::check) {
  sparse_impl::scatter_add_sorted<T>(tmp, indices, values, dense, stream, validation);
}

// dense = 0, then dense[indices[j]] = values[j]: one payload, indices strictly increasing.
template <class T>
void decompress(temp_storage& tmp, device_span<const std::uint32_t> indices,
                device_span<const float> values, device_span<T> dense,
                cudaStream_t stream = nullptr,
                device_validation validation = device_validation::check) {
  sparse_impl::decompress<T>(tmp, indices, values, dense, stream, validation);
}

}  // namespace gradcomp::cuda
