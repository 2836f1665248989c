// python/src/cuda_bucket.cu: cuda_bucket.hpp's calls, over gradcomp's device policies
// (gradcomp/cuda.cuh). No torch header is included here.
#include "cuda_bucket.hpp"

#include <cstddef>
#include <cstdint>

#include <gradcomp/cuda.cuh>
#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/dispatch/scratch.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/tuning.cuh>

namespace gradcomp::torch_cuda {

namespace {

// The selection's scratch, then gather_and_clear's, back to back (each 256-byte aligned by
// the carver).
struct compress_layout {
  std::size_t select = 0;
  std::size_t clear = 0;
};

compress_layout compress_sizes(const topk& sel, std::size_t n, std::size_t k) {
  compress_layout out;
  temp_storage q;
  const select_context ctx{k, 0.0, {}};
  on_device(sel).select_accumulate(q, device_span<float>(nullptr, n),
                                   device_span<const float>(nullptr, n), ctx,
                                   device_span<std::uint32_t>(nullptr, k),
                                   reinterpret_cast<selection_stats*>(alignof(selection_stats)));
  out.select = q.bytes;
  temp_storage c;
  residual feedback;
  on_device(feedback).gather_and_clear(c, device_span<float>(nullptr, n),
                                         device_span<const std::uint32_t>(nullptr, k),
                                         reinterpret_cast<const selection_stats*>(alignof(selection_stats)),
                                         device_span<float>(nullptr, k));
  out.clear = c.bytes;
  return out;
}

__global__ void divide_kernel(float* out, std::size_t n, float divisor) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] /= divisor;  // a division, as the host's rank_order_mean: not a reciprocal product
  }
}

// Per vector: partials[0, energy_blocks) values, [energy_blocks, 2 energy_blocks) e.
constexpr unsigned energy_threads = cuda::energy_tuning_sm90.threads;
constexpr unsigned energy_blocks = cuda::energy_tuning_sm90.blocks;
static_assert(energy_threads % 32 == 0, "the energy kernel sums whole warps");

// The block's sum of x[i]^2 over its grid-stride share, in double, into partials[blockIdx.x]
// (blockIdx.y: 0 the values, 1 e).
__global__ void energy_partials_kernel(const float* values, std::size_t k, const float* e,
                                       std::size_t n, double* partials) {
  const float* x = blockIdx.y == 0 ? values : e;
  const std::size_t m = blockIdx.y == 0 ? k : n;
  double acc = 0.0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < m;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const double v = x[i];
    acc += v * v;
  }
  __shared__ double warp_sums[energy_threads / 32];
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (unsigned w = 0; w < energy_threads / 32; ++w) sum += warp_sums[w];
    partials[blockIdx.y * energy_blocks + blockIdx.x] = sum;
  }
}

// out[y] = the sum of partials[y * energy_blocks, (y + 1) * energy_blocks), in order.
__global__ void energy_finish_kernel(const double* partials, double* out) {
  if (threadIdx.x < 2) {
    double sum = 0.0;
    for (unsigned b = 0; b < energy_blocks; ++b) sum += partials[threadIdx.x * energy_blocks + b];
    out[threadIdx.x] = sum;
  }
}

}  // namespace

std::size_t energy_partials() { return 2 * std::size_t{energy_blocks}; }

void energies(const float* values, std::size_t k, const float* e, std::size_t n, double* out,
              double* partials, cudaStream_t stream) {
  energy_partials_kernel<<<dim3(energy_blocks, 2), energy_threads, 0, stream>>>(values, k, e, n,
                                                                              partials);
  detail::cuda_check(cudaGetLastError(), "energy_partials_kernel launch");
  energy_finish_kernel<<<1, 32, 0, stream>>>(partials, out);
  detail::cuda_check(cudaGetLastError(), "energy_finish_kernel launch");
}

std::size_t compress_scratch(const topk& sel, std::size_t n, std::size_t k) {
  const compress_layout l = compress_sizes(sel, n, k);
  cuda::scratch_carver s(nullptr);
  s.take_bytes(l.select);
  s.take_bytes(l.clear);
  return s.bytes();
}

void compress(const topk& sel, void* scratch, std::size_t scratch_bytes, float* e,
              const float* g, std::size_t n, std::size_t k, std::uint32_t* indices,
              float* values, selection_stats* stats, cudaStream_t stream) {
  const compress_layout l = compress_sizes(sel, n, k);
  cuda::scratch_carver s(scratch);
  temp_storage select_tmp{s.take_bytes(l.select), l.select};
  temp_storage clear_tmp{s.take_bytes(l.clear), l.clear};
  if (s.bytes() > scratch_bytes) {
    detail::throw_invalid_argument("torch_cuda::compress", "scratch_bytes", scratch_bytes,
                                   detail::concat(">= ", s.bytes(), " (compress_scratch)"));
  }
  const select_context ctx{k, 0.0, {}};
  on_device(sel).select_accumulate(select_tmp, device_span<float>(e, n),
                                   device_span<const float>(g, n), ctx,
                                   device_span<std::uint32_t>(indices, k), stats, stream);
  // The indices are the selector's own: trusted (no validation pass, no wait).
  residual feedback;
  on_device(feedback).gather_and_clear(clear_tmp, device_span<float>(e, n),
                                         device_span<const std::uint32_t>(indices, k), stats,
                                         device_span<float>(values, k), stream,
                                         device_validation::trusted);
}

std::size_t combine_scratch(std::size_t total, std::size_t n) {
  temp_storage q;
  cuda::scatter_add_sorted(q, device_span<const std::uint32_t>(nullptr, total),
                           device_span<const float>(nullptr, total), device_span<float>(nullptr, n));
  return q.bytes;
}

void combine(void* scratch, std::size_t scratch_bytes, const std::uint32_t* indices,
             const float* values, std::size_t total, float* out, std::size_t n, int ranks,
             cudaStream_t stream) {
  if (ranks < 1) {
    detail::throw_invalid_argument("torch_cuda::combine", "ranks", ranks, ">= 1");
  }
  if (n == 0) return;
  detail::cuda_check(cudaMemsetAsync(out, 0, n * sizeof(float), stream), "cudaMemsetAsync");
  temp_storage tmp{scratch, scratch_bytes};
  // Checked on the device before anything is added: a peer's index at or past n throws here.
  cuda::scatter_add_sorted(tmp, device_span<const std::uint32_t>(indices, total),
                           device_span<const float>(values, total), device_span<float>(out, n),
                           stream, device_validation::check);
  if (ranks == 1) return;  // x / 1 == x
  constexpr cuda::elementwise_tuning t = cuda::divide_tuning_sm90;
  divide_kernel<<<cuda::grid_for(n, t.threads, t.max_blocks), t.threads, 0, stream>>>(
      out, n, static_cast<float>(ranks));
  cuda::check_launch("divide_kernel launch");
}

}  // namespace gradcomp::torch_cuda
