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
#include <gradcomp/select/gaussiank.hpp>
#include <gradcomp/select/randomk.hpp>
#include <gradcomp/select/threshold.hpp>
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

// Gaussian-k's: the same, with its picks (as many as it finds, written by the device into
// stats->count, at most `capacity`: k where it caps at k, else n) in indices and values
// [0, count). Scratch bytes from compress_scratch(sel, n, k, capacity).
std::size_t compress_scratch(const gaussiank& sel, std::size_t n, std::size_t k,
                             std::size_t capacity);
void compress(const gaussiank& sel, void* scratch, std::size_t scratch_bytes, float* e,
              const float* g, std::size_t n, std::size_t k, std::size_t capacity,
              std::uint32_t* indices, float* values, selection_stats* stats,
              cudaStream_t stream);

// Random-k's (its device form): e = e + g (element by element, as the host residual's
// accumulate), then the k indices the host draws for `id` (randomk::draw, as the host engine
// with the same call_id: seed, step, bucket, rank), copied to the device (the call waits for
// the stream once, for its pageable copy), gathered and cleared as above; stats count k.
std::size_t compress_scratch(const randomk& sel, std::size_t n, std::size_t k);
void compress(const randomk& sel, const call_id& id, void* scratch, std::size_t scratch_bytes,
              float* e, const float* g, std::size_t n, std::size_t k, std::uint32_t* indices,
              float* values, selection_stats* stats, cudaStream_t stream);

// Threshold's: e = e + g (element by element, as the host residual's accumulate), then every
// index whose |e| passes the selector's threshold (the host's set, ascending; stats->count of
// them, at most capacity = n), gathered and cleared as above.
std::size_t compress_scratch(const threshold& sel, std::size_t n, std::size_t capacity);
void compress(const threshold& sel, void* scratch, std::size_t scratch_bytes, float* e,
              const float* g, std::size_t n, std::size_t capacity, std::uint32_t* indices,
              float* values, selection_stats* stats, cudaStream_t stream);

// Scratch bytes compress_dgc() needs for n elements, k picks and clip_norm.
std::size_t compress_dgc_scratch(const topk& sel, std::size_t n, std::size_t k, double clip_norm);

// TopK-SGD with DGC's momentum correction (feedback 'dgc'), from the bucket's committed state
// (u0, v0) into its new one (u, v), as the host's dgc_momentum (operation for operation):
// u = momentum * u0 + s g; v = v0 + u; indices[0, k) = the top-k of v (the host's index set,
// ascending); values[j] = v[indices[j]]; v and u = 0 there (momentum factor masking); *stats
// (device memory) = the selection's statistics. s is DGC's clipping scale: 1 where clip_norm
// is 0 (then g itself, as the host's), else clip_norm / ||g|| where ||g|| > clip_norm (the
// bucket's L2 norm, its squares summed in double on the device in a fixed order: the host's
// bits where the squares add up exactly, else possibly a last-bit difference in s).
void compress_dgc(const topk& sel, void* scratch, std::size_t scratch_bytes, float* u, float* v,
                  const float* u0, const float* v0, const float* g, std::size_t n, std::size_t k,
                  float momentum, double clip_norm, std::uint32_t* indices, float* values,
                  selection_stats* stats, cudaStream_t stream);

// out[0] = sum of values[j]^2 (j < k), out[1] = sum of e[i]^2 (i < n), both in double, each
// added in a fixed order (per-block partials, then one block): the same bits on every run.
// A NaN or Inf anywhere makes the sum non-finite. `partials` holds energy_partials() doubles.
std::size_t energy_partials();
void energies(const float* values, std::size_t k, const float* e, std::size_t n, double* out,
              double* partials, cudaStream_t stream);

// The codes the picked values travel in (the state's quantizer): fp32 as they are, fp16 and
// bf16 as 16-bit codes (gradcomp's fp16 and bf16 quantizers: the host's codes bit for bit).
enum class pick_code : std::uint8_t { fp32, fp16, bf16 };

// Bytes of one value's code: 4, 2, 2.
std::size_t pick_code_bytes(pick_code code);

// Scratch bytes quantize_picks() needs for k picks, and decode_picks() for `count` codes
// (never 0, so that a buffer of that size has an address).
std::size_t quantize_picks_scratch(pick_code code, std::size_t k);
std::size_t decode_picks_scratch(pick_code code, std::size_t count);

// The k picked values (values[j] = x[indices[j]], where take_picks left x[indices[j]] = 0)
// encoded into codes[0, k * pick_code_bytes(code)), decoded again into decoded[0, k) (what
// every rank will add), and x[indices[j]] = values[j] - decoded[j]: the feedback keeps what
// the quantizer lost (the host's residual and dgc_momentum updates, x -= decoded, on x = the
// value sent). x: the residual e, or DGC's v. code is fp16 or bf16 (fp32 sends the values).
void quantize_picks(pick_code code, void* scratch, std::size_t scratch_bytes, const float* values,
                    std::size_t k, std::byte* codes, float* decoded, float* x,
                    const std::uint32_t* indices, cudaStream_t stream);

// out[0, count) = the values of codes[0, count * pick_code_bytes(code)) (fp16 or bf16; every
// 16-bit code is a value, so nothing can be refused).
void decode_picks(pick_code code, void* scratch, std::size_t scratch_bytes, const std::byte* codes,
                  std::size_t count, float* out, cudaStream_t stream);

// Selector 'dense' with exchange 'allreduce' (every coordinate, its codes added as they
// travel: dense_allreduce). Each code has pick_code_bytes(code) bytes: the quantizer's sum type
// (fp32: float, fp16: gradcomp::half, bf16: gradcomp::bfloat16).
//
// x[0, n) += g[0, n), element by element (the host residual's accumulate: e + g).
void accumulate(float* x, const float* g, std::size_t n, cudaStream_t stream);

// codes[0, n) = each x[i]'s code (the host encoder's), divided by `ranks` first where the
// quantizer divides before the sum (fp16: dense_allreduce's prescale, so that P large codes do
// not overflow), and x[i] -= float(code before that division): the residual keeps what the
// code lost (0 for fp32).
void encode_dense(pick_code code, float* x, std::byte* codes, std::size_t n, int ranks,
                  cudaStream_t stream);

// acc[0, m) = share 0 + share 1 + ... + share p - 1 (shares[s m, (s + 1) m)), added in rank
// order in the sum type: process_group_comm::allreduce's fold of one share, bit for bit.
void fold_shares(pick_code code, const std::byte* shares, std::size_t m, int p, std::byte* acc,
                 cudaStream_t stream);

// out[0, n) = float(sum[i]) / divisor (dense_allreduce's average: divisor P, or 1 for fp16's
// prescaled codes).
void average_codes(pick_code code, const std::byte* sum, std::size_t n, float divisor, float* out,
                   cudaStream_t stream);

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
