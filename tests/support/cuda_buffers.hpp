// Staging between host vectors and device buffers for the CUDA tests (tests/cuda/): every
// call checks CUDA's result and throws gradcomp::error naming the copy, which doctest reports
// as a failure of the running test case.
#pragma once

#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include <gradcomp/cuda/memory.cuh>

namespace gradcomp_test {

// A device copy of v; never a 0-byte cudaMalloc (an empty v gets a buffer of one element).
template <class T>
gradcomp::device_buffer<T> upload(const std::vector<T>& v) {
  gradcomp::device_buffer<T> d(v.empty() ? 1 : v.size());
  if (!v.empty()) {
    gradcomp::detail::cuda_check(
        cudaMemcpy(d.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
        "cudaMemcpy host to device");
  }
  return d;
}

// The n elements at device pointer p, on the host.
template <class T>
std::vector<T> download(const T* p, std::size_t n) {
  std::vector<T> v(n);
  if (n > 0) {
    gradcomp::detail::cuda_check(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost),
                                 "cudaMemcpy device to host");
  }
  return v;
}

// The scratch of a device call, CUB style: make the size query with `tmp`, then allocate()
// points tmp at a buffer of the size it asked for.
struct scratch_buffer {
  gradcomp::device_buffer<std::byte> buf;
  gradcomp::temp_storage tmp;
  void allocate() {
    REQUIRE(tmp.bytes > 0);
    buf.resize(tmp.bytes);
    tmp.ptr = buf.data();
  }
};

}  // namespace gradcomp_test
