// python/src/cuda_bucket.hpp: the device work of one CUDA bucket for gradcomp.torch's
// CudaEngine (cuda_engine.hpp), over raw device pointers. Compiled by nvcc in cuda_bucket.cu,
// which includes no torch header, so that the torch side (g++) and the kernels (nvcc) meet
// only here. Every call is asynchronous on `stream` unless it says otherwise; scratch is the
// caller's (a size query first, CUB style).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <gradcomp/context.hpp>
#include <gradcomp/select/topk.hpp>

namespace gradcomp::torch_cuda {

// Scratch bytes compress() needs for n elements and k picks.
std::size_t compress_scratch(const topk& sel, std::size_t n, std::size_t k);

// The fused TopK-SGD compression with residual feedback, in place on e (the bucket's new
// feedback state, already a copy of the committed one): e = e + g; indices[0, k) = the
// top-k of e (the host's index set, ascending); values[j] = e[indices[j]]; e[indices[j]] = 0;
// *stats (device memory) = the selection's statistics.
void compress(const topk& sel, void* scratch, std::size_t scratch_bytes, float* e,
              const float* g, std::size_t n, std::size_t k, std::uint32_t* indices,
              float* values, selection_stats* stats, cudaStream_t stream);

// Scratch bytes compress_dgc() needs for n elements and k picks.
std::size_t compress_dgc_scratch(const topk& sel, std::size_t n, std::size_t k);

// TopK-SGD with DGC's momentum correction (feedback 'dgc', without clipping), from the
// bucket's committed state (u0, v0) into its new one (u, v), as the host's dgc_momentum
// (operation for operation): u = momentum * u0 + g; v = v0 + u; indices[0, k) = the top-k of
// v (the host's index set, ascending); values[j] = v[indices[j]]; v and u = 0 there (momentum
// factor masking); *stats (device memory) = the selection's statistics.
void compress_dgc(const topk& sel, void* scratch, std::size_t scratch_bytes, float* u, float* v,
                  const float* u0, const float* v0, const float* g, std::size_t n, std::size_t k,
                  float momentum, std::uint32_t* indices, float* values, selection_stats* stats,
                  cudaStream_t stream);

// out[0] = sum of values[j]^2 (j < k), out[1] = sum of e[i]^2 (i < n), both in double, each
// added in a fixed order (per-block partials, then one block): the same bits on every run.
// A NaN or Inf anywhere makes the sum non-finite. `partials` holds energy_partials() doubles.
std::size_t energy_partials();
void energies(const float* values, std::size_t k, const float* e, std::size_t n, double* out,
              double* partials, cudaStream_t stream);

// Scratch bytes combine() needs for `total` received picks.
std::size_t combine_scratch(std::size_t total, std::size_t n);

// out[0, n) = (0 + rank 0's values + rank 1's + ...) / ranks at their indices, the ranks'
// picks concatenated in rank order in indices/values[0, total): the host's rank-order mean bit
// for bit. The indices are checked on the device first; one at or past n makes it throw
// payload_error (after waiting for the stream) with out unwritten.
void combine(void* scratch, std::size_t scratch_bytes, const std::uint32_t* indices,
             const float* values, std::size_t total, float* out, std::size_t n, int ranks,
             cudaStream_t stream);

}  // namespace gradcomp::torch_cuda
