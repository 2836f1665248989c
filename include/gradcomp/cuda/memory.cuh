// gradcomp/cuda/memory.cuh: CUDA runtime error checks and an owning device buffer. Host code
// only (no kernels), so host-compiled files that include cuda_runtime.h may use it too.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>
#include <vector>

#include <gradcomp/device.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

namespace detail {

// Throws gradcomp::error naming the call and CUDA's error when rc is not cudaSuccess.
inline void cuda_check(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess) {
    throw error(concat("gradcomp::cuda: ", call, " failed: ", cudaGetErrorName(rc), ": ",
                       cudaGetErrorString(rc)));
  }
}

// n elements at device pointer p, copied to the host on `stream` and waited for (the stream's
// earlier work first).
template <class T>
std::vector<T> download_on(cudaStream_t stream, const T* p, std::size_t n) {
  std::vector<T> v(n);
  if (n) {
    cuda_check(cudaMemcpyAsync(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync");
  }
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return v;
}

// v copied to device pointer p on `stream` (not waited for: v must outlive the copy).
template <class T>
void upload_on(cudaStream_t stream, T* p, const std::vector<T>& v) {
  if (v.empty()) return;
  cuda_check(cudaMemcpyAsync(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync");
}

}  // namespace detail

// Device memory from cudaMalloc, grown on demand. resize() keeps no contents when it has to
// reallocate: these are scratch and receive buffers.
template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t n) { resize(n); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)),
        capacity_(std::exchange(o.capacity_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = std::exchange(o.size_, 0);
      capacity_ = std::exchange(o.capacity_, 0);
    }
    return *this;
  }
  ~device_buffer() { release(); }

  void resize(std::size_t n) {
    if (n > capacity_) {
      release();
      void* p = nullptr;
      detail::cuda_check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
      ptr_ = static_cast<T*>(p);
      capacity_ = n;
    }
    size_ = n;
  }

  [[nodiscard]] T* data() const noexcept { return ptr_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] device_span<T> span() const noexcept { return {ptr_, size_}; }

 private:
  void release() noexcept {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    size_ = capacity_ = 0;
  }

  T* ptr_ = nullptr;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
};

}  // namespace gradcomp
