// doctest's main for the CUDA tests: without a usable CUDA device it prints why and exits with
// 77, which ctest reports as "Skipped" (SKIP_RETURN_CODE), so machines without a GPU (CI)
// build every CUDA test and skip them visibly instead of passing them silently.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t rc = cudaGetDeviceCount(&devices);
  if (rc != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (cudaGetDeviceCount: %s, %d devices); the device "
                "code was compiled but not run\n",
                rc == cudaSuccess ? "ok" : cudaGetErrorString(rc), devices);
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("CUDA device 0: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  }
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  return context.run();
}
