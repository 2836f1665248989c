// gradcomp_cuda_bench's main: Google Benchmark's, after a check for a CUDA device. Without
// one it prints why and exits with 77 (ctest reports the smoke run as skipped); no figure is
// ever produced without a device.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t rc = cudaGetDeviceCount(&devices);
  if (rc != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (cudaGetDeviceCount: %s, %d devices)\n",
                rc == cudaSuccess ? "ok" : cudaGetErrorString(rc), devices);
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    benchmark::AddCustomContext("cuda_device", prop.name);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
