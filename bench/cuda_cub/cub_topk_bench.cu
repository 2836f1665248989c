// gradcomp_cub_topk_bench: the baseline for gradcomp's exact device top-k, cub::DeviceTopK
// (CCCL 3.6, the AIR top-k: unordered output, ties not deterministic), on the same inputs,
// sizes and densities as gradcomp_cuda_bench's cuda/select/* families (normal_input.cuh),
// with a device copy of g in the same binary. Built only when GRADCOMP_CCCL_TOPK_DIR names a
// CCCL with DeviceTopK (3.3 or newer), its headers first on this program's include path and
// on no other target's (bench/CMakeLists.txt): the toolkit's CCCL never enters this binary.
//   cuda/baseline/cub_topk         MaxPairs(keys = |g| as float, values = indices 0..n-1,
//                                  32-bit n and k), keys and values made before the timing;
//                                  one graph launch
//   cuda/baseline/cub_topk_i64     the same with 64-bit n and k (CUB's other offset type)
//   cuda/baseline/cub_topk_stream  the same call launched directly
//   cuda/baseline/cub_copy         cudaMemcpyAsync device to device of g's 4n bytes
// Arguments n:<n>/ppm:<ppm> (cub_copy: n:<n>). Bytes processed: g's 4n, as in
// gradcomp_cuda_bench, so the rates compare.
#include <benchmark/benchmark.h>
#include <cub/device/device_topk.cuh>
#include <cuda/execution>
#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <gradcomp/context.hpp>
#include <gradcomp/cuda/memory.cuh>

#include "../cuda/normal_input.cuh"
#include "../cuda/timing.cuh"

#if !defined(CCCL_VERSION) || CCCL_VERSION < 3003000
#error "gradcomp_cub_topk_bench needs CCCL 3.3 or newer (cub::DeviceTopK) first on the include path"
#endif

namespace {

using gradcomp::detail::cuda_check;

__global__ void abs_index_kernel(const float* g, std::size_t n, float* keys, std::uint32_t* idx) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    keys[i] = fabsf(g[i]);
    idx[i] = static_cast<std::uint32_t>(i);
  }
}

std::size_t k_of(std::size_t n, std::int64_t ppm) {
  return gradcomp::k_for_density(n, static_cast<double>(ppm) * 1e-6);
}

void set_bytes(benchmark::State& state, std::size_t n) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n * sizeof(float)));
}

template <class Offset>
void bm_cub_topk(benchmark::State& state, bool graph) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t k = k_of(n, state.range(1));
  const float* g = gradcomp_bench::normal_input(n);
  gradcomp::device_buffer<float> keys(n), keys_out(k);
  gradcomp::device_buffer<std::uint32_t> idx(n), idx_out(k);
  abs_index_kernel<<<gradcomp_bench::grid_blocks, 256>>>(g, n, keys.data(), idx.data());
  cuda_check(cudaGetLastError(), "abs_index_kernel");
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  // CUB's only DeviceTopK configuration: unordered, ties not deterministic.
  const auto env_on = [](cudaStream_t s) {
    return ::cuda::std::execution::env{
        ::cuda::stream_ref{s},
        ::cuda::execution::require(::cuda::execution::determinism::not_guaranteed,
                                   ::cuda::execution::output_ordering::unsorted)};
  };
  std::size_t bytes = 0;
  cuda_check(cub::DeviceTopK::MaxPairs(nullptr, bytes, keys.data(), keys_out.data(), idx.data(),
                                       idx_out.data(), static_cast<Offset>(n), static_cast<Offset>(k),
                                       env_on(nullptr)),
             "cub::DeviceTopK::MaxPairs (size)");
  gradcomp::device_buffer<char> scratch(bytes);
  auto call = [&](cudaStream_t s) {
    cuda_check(cub::DeviceTopK::MaxPairs(scratch.data(), bytes, keys.data(), keys_out.data(),
                                         idx.data(), idx_out.data(), static_cast<Offset>(n),
                                         static_cast<Offset>(k), env_on(s)),
               "cub::DeviceTopK::MaxPairs");
  };
  if (graph) {
    gradcomp_bench::timed_graph_events(state, call);
  } else {
    cudaStream_t stream = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    gradcomp_bench::timed_events(state, stream, [&] { call(stream); });
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    cudaStreamDestroy(stream);
  }
  set_bytes(state, n);
  state.counters["k"] = static_cast<double>(k);
  state.counters["bytes_scratch"] = static_cast<double>(bytes);
}

void bm_cub_copy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const float* g = gradcomp_bench::normal_input(n);
  gradcomp::device_buffer<float> out(n);
  gradcomp_bench::timed_events(state, nullptr, [&] {
    cuda_check(cudaMemcpyAsync(out.data(), g, n * sizeof(float), cudaMemcpyDeviceToDevice),
               "cudaMemcpyAsync");
  });
  set_bytes(state, n);
}

void bm_cub_topk_graph(benchmark::State& state) { bm_cub_topk<int>(state, true); }
void bm_cub_topk_stream(benchmark::State& state) { bm_cub_topk<int>(state, false); }
void bm_cub_topk_i64(benchmark::State& state) { bm_cub_topk<std::int64_t>(state, true); }

using gradcomp_bench::sizes_only;
using gradcomp_bench::sizes_ppm;

}  // namespace

BENCHMARK(bm_cub_topk_graph)->Name("cuda/baseline/cub_topk")->Apply(sizes_ppm);
BENCHMARK(bm_cub_topk_stream)->Name("cuda/baseline/cub_topk_stream")->Apply(sizes_ppm);
BENCHMARK(bm_cub_topk_i64)->Name("cuda/baseline/cub_topk_i64")->Apply(sizes_ppm);
BENCHMARK(bm_cub_copy)->Name("cuda/baseline/cub_copy")->Apply(sizes_only);
