// python/src/cuda_bucket.cu: cuda_bucket.hpp's calls, over gradcomp's device policies
// (gradcomp/cuda.cuh). No torch header is included here.
#include "cuda_bucket.hpp"

#include <cstddef>
#include <cstdint>

#include <gradcomp/cuda.cuh>
#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/dispatch/scratch.cuh>
#include <gradcomp/cuda/kernels/step_kernels.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/tuning.cuh>

namespace gradcomp::torch_cuda {

namespace {

// The selection's scratch, then gather_and_clear's, back to back (each 256-byte aligned by
// the carver); with DGC, one error record after them (dgc_accumulate_kernel reports a
// non-finite v there; the engine learns of it from the energies instead).
struct compress_layout {
  std::size_t select = 0;
  std::size_t clear = 0;
  std::size_t errors = 0;
};

// dgc: the selection reads v (a plain select), not e + g (select_accumulate).
compress_layout compress_sizes(const topk& sel, std::size_t n, std::size_t k, bool dgc) {
  compress_layout out;
  temp_storage q;
  const select_context ctx{k, 0.0, {}};
  const auto d_stats = reinterpret_cast<selection_stats*>(alignof(selection_stats));
  if (dgc) {
    on_device(sel).select(q, device_span<const float>(nullptr, n), ctx,
                          device_span<std::uint32_t>(nullptr, k), d_stats);
    out.errors = sizeof(cuda::error_record);
  } else {
    on_device(sel).select_accumulate(q, device_span<float>(nullptr, n),
                                     device_span<const float>(nullptr, n), ctx,
                                     device_span<std::uint32_t>(nullptr, k), d_stats);
  }
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

namespace {

// compress_layout's parts carved out of the caller's scratch, refused (naming `where`) when it
// is too small.
struct compress_parts {
  temp_storage select_tmp, clear_tmp;
  cuda::error_record* errors = nullptr;
};

std::size_t layout_bytes(const compress_layout& l) {
  cuda::scratch_carver s(nullptr);
  s.take_bytes(l.select);
  s.take_bytes(l.clear);
  if (l.errors) s.take_bytes(l.errors);
  return s.bytes();
}

compress_parts carve(const compress_layout& l, void* scratch, std::size_t scratch_bytes,
                     const char* where, const char* query) {
  cuda::scratch_carver s(scratch);
  compress_parts out;
  out.select_tmp = temp_storage{s.take_bytes(l.select), l.select};
  out.clear_tmp = temp_storage{s.take_bytes(l.clear), l.clear};
  if (l.errors) out.errors = static_cast<cuda::error_record*>(s.take_bytes(l.errors));
  if (s.bytes() > scratch_bytes) {
    detail::throw_invalid_argument(where, "scratch_bytes", scratch_bytes,
                                   detail::concat(">= ", s.bytes(), " (", query, ")"));
  }
  return out;
}

// values[j] = x[indices[j]], then x[indices[j]] = 0: the residual's gather_and_clear. The
// indices are the selector's own: trusted (no validation pass, no wait).
void take_picks(temp_storage tmp, float* x, std::size_t n, const std::uint32_t* indices,
                std::size_t k, const selection_stats* stats, float* values, cudaStream_t stream) {
  residual feedback;
  on_device(feedback).gather_and_clear(tmp, device_span<float>(x, n),
                                         device_span<const std::uint32_t>(indices, k), stats,
                                         device_span<float>(values, k), stream,
                                         device_validation::trusted);
}

}  // namespace

std::size_t compress_scratch(const topk& sel, std::size_t n, std::size_t k) {
  return layout_bytes(compress_sizes(sel, n, k, false));
}

std::size_t compress_dgc_scratch(const topk& sel, std::size_t n, std::size_t k) {
  return layout_bytes(compress_sizes(sel, n, k, true));
}

void compress_dgc(const topk& sel, void* scratch, std::size_t scratch_bytes, float* u, float* v,
                  const float* u0, const float* v0, const float* g, std::size_t n, std::size_t k,
                  float momentum, std::uint32_t* indices, float* values, selection_stats* stats,
                  cudaStream_t stream) {
  auto [select_tmp, clear_tmp, errors] = carve(compress_sizes(sel, n, k, true), scratch,
                                               scratch_bytes, "torch_cuda::compress_dgc",
                                               "compress_dgc_scratch");
  // dgc_accumulate_kernel reports a non-finite v here; the engine learns of it from the
  // energies instead (as for the residual), so the record is cleared and not read.
  detail::cuda_check(cudaMemsetAsync(errors, 0xff, sizeof(cuda::error_record), stream),
                     "cudaMemsetAsync");
  constexpr unsigned threads = 256;
  if (n) {
    cuda::step_impl::dgc_accumulate_kernel<float>
        <<<cuda::grid_for(n, threads, 4096), threads, 0, stream>>>(u, v, u0, v0, g, n, momentum,
                                                                  nullptr, 0, errors);
    cuda::check_launch("dgc_accumulate_kernel");
  }
  const select_context ctx{k, 0.0, {}};
  on_device(sel).select(select_tmp, device_span<const float>(v, n), ctx,
                        device_span<std::uint32_t>(indices, k), stats, stream);
  take_picks(clear_tmp, v, n, indices, k, stats, values, stream);
  if (k) {
    cuda::step_impl::clear_at_kernel<float, std::uint32_t>
        <<<cuda::grid_for(k, threads, 4096), threads, 0, stream>>>(u, indices, k);
    cuda::check_launch("clear_at_kernel");
  }
}

void compress(const topk& sel, void* scratch, std::size_t scratch_bytes, float* e,
              const float* g, std::size_t n, std::size_t k, std::uint32_t* indices,
              float* values, selection_stats* stats, cudaStream_t stream) {
  auto [select_tmp, clear_tmp, errors] = carve(compress_sizes(sel, n, k, false), scratch,
                                               scratch_bytes, "torch_cuda::compress",
                                               "compress_scratch");
  (void)errors;
  const select_context ctx{k, 0.0, {}};
  on_device(sel).select_accumulate(select_tmp, device_span<float>(e, n),
                                   device_span<const float>(g, n), ctx,
                                   device_span<std::uint32_t>(indices, k), stats, stream);
  take_picks(clear_tmp, e, n, indices, k, stats, values, stream);
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
