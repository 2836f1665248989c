// The selection benchmarks' input and sizes, shared by gradcomp_cuda_bench (select_bench.cu) and the
// cub::DeviceTopK baseline (bench/cuda_cub/), so that both time the same values: normal
// variates from a counter-based hash (Box-Muller on two hashed uniforms per element), generated
// on the device once per size and kept for the whole run. Needs only the CUDA runtime and
// gradcomp/cuda/memory.cuh (no CUB), so the baseline can build it against another CCCL.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include <gradcomp/cuda/memory.cuh>

namespace gradcomp_bench {

__device__ __forceinline__ std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void normal_kernel(float* g, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t a = mix(seed + 2 * i * 0x9e3779b97f4a7c15ull);
    const std::uint64_t b = mix(seed + (2 * i + 1) * 0x9e3779b97f4a7c15ull);
    const double u1 = (static_cast<double>(a >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = (static_cast<double>(b >> 11) + 0.5) * 0x1.0p-53;
    g[i] = static_cast<float>(::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2));
  }
}

inline constexpr unsigned grid_blocks = 132 * 16;  // enough blocks to fill an H100/H200

// One normal input per size (seed 12345), kept for the whole run.
inline const float* normal_input(std::size_t n) {
  static std::map<std::size_t, std::unique_ptr<gradcomp::device_buffer<float>>> cache;
  auto& slot = cache[n];
  if (!slot) {
    slot = std::make_unique<gradcomp::device_buffer<float>>(n);
    normal_kernel<<<grid_blocks, 256>>>(slot->data(), n, 12345);
    gradcomp::detail::cuda_check(cudaGetLastError(), "normal_kernel");
    gradcomp::detail::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  return slot->data();
}

// The sizes and densities every selection family runs at: 2^20, a 25 MB DDP bucket
// (6,553,600 floats), ResNet-50's 25,557,032 parameters, 2^27; 100, 1000 and 10000 ppm.
inline constexpr std::int64_t select_sizes[] = {std::int64_t{1} << 20, 6553600, 25557032,
                                                std::int64_t{1} << 27};
inline constexpr std::int64_t select_ppms[] = {100, 1000, 10000};

// Google Benchmark argument sets over them: n and ppm, or n alone (the baselines); manual
// (event) time in microseconds.
inline void sizes_ppm(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "ppm"});
  for (const std::int64_t n : select_sizes) {
    for (const std::int64_t ppm : select_ppms) b->Args({n, ppm});
  }
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

inline void sizes_only(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n"});
  for (const std::int64_t n : select_sizes) b->Args({n});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace gradcomp_bench
