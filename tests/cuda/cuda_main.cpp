// doctest's main for the CUDA tests: without a usable CUDA device it prints why and exits with
// 77, which ctest reports as "Skipped" (SKIP_RETURN_CODE), so machines without a GPU (CI)
// build every CUDA test and skip them visibly instead of passing them silently.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdio>
#include <initializer_list>

#define GRADCOMP_STRINGIFY_(...) #__VA_ARGS__
#define GRADCOMP_STRINGIFY(...) GRADCOMP_STRINGIFY_(__VA_ARGS__)

namespace {

// Whether device code compiled for GRADCOMP_CUDA_TEST_ARCHS (tests/cuda/CMakeLists.txt:
// machine code for each architecture, PTX for the last) runs on a device of compute
// capability major.minor: machine code for sm_XY runs on sm_XZ with Z >= Y of the same major
// version, and the PTX is compiled by the driver for any later device.
bool compiled_for(int major, int minor) {
  const int device = major * 10 + minor;
  int last = 0;
  for (const int arch : {GRADCOMP_CUDA_TEST_ARCHS}) {
    if (arch / 10 == major && arch % 10 <= minor) return true;
    last = arch;
  }
  return device >= last;
}

}  // namespace

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
    if (!compiled_for(prop.major, prop.minor)) {
      std::printf("SKIPPED: the tests' device code was compiled for sm_{%s}, which cannot run on "
                  "sm_%d%d; configure with -DGRADCOMP_CUDA_TEST_ARCHITECTURES=%d%d\n",
                  GRADCOMP_STRINGIFY(GRADCOMP_CUDA_TEST_ARCHS), prop.major, prop.minor,
                  prop.major, prop.minor);
      return 77;
    }
  }
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  return context.run();
}
