// gradcomp/device.hpp: the host-side half of the device vocabulary. It needs no CUDA header,
// so that every policy header can declare its device overloads:
//  - device_span<T>: a non-owning view of device memory (never dereferenced on the host);
//  - temp_storage: the caller's scratch buffer, CUB style: call once with ptr == nullptr to
//    learn `bytes`, allocate, call again to do the work;
//  - device_policy<P>: the device implementation of policy P, specialised by the headers under
//    gradcomp/cuda/ (include gradcomp/cuda.cuh and compile with nvcc). A policy's device
//    overloads forward to it, so the same topk, qsgd or residual object works on host spans
//    and, given a temp_storage and a stream, on device spans.
#pragma once

#include <concepts>
#include <cstddef>
#include <type_traits>

namespace gradcomp {

// A non-owning view of `count` elements of device memory.
template <class T>
struct device_span {
  T* ptr = nullptr;
  std::size_t count = 0;

  device_span() = default;
  device_span(T* p, std::size_t n) noexcept : ptr(p), count(n) {}
  // Like std::span<T> to std::span<const T>.
  template <class U>
    requires std::is_convertible_v<U (*)[], T (*)[]>
  device_span(device_span<U> o) noexcept : ptr(o.ptr), count(o.count) {}  // NOLINT: implicit

  [[nodiscard]] T* data() const noexcept { return ptr; }
  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return count * sizeof(T); }
  [[nodiscard]] bool empty() const noexcept { return count == 0; }
  [[nodiscard]] device_span subspan(std::size_t at, std::size_t len) const noexcept {
    return {ptr + at, len};
  }
};

// The caller-provided scratch buffer of a device call (CUB's d_temp_storage and
// temp_storage_bytes in one object). With ptr == nullptr a device call only sets `bytes` to
// what it needs and does no work; otherwise `bytes` must be at least that.
struct temp_storage {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  [[nodiscard]] bool is_size_query() const noexcept { return ptr == nullptr; }
};

// The device implementation of policy P; defined by gradcomp/cuda/*.cuh. A policy declares
// its device overloads like this (the first parameter, temp_storage&, tells them apart from
// the host calls):
//
//   template <class... Args>
//   decltype(auto) select(temp_storage& tmp, Args&&... args) {
//     using impl = device_policy<typename detail::dependent_type<topk, Args...>::type>;
//     return impl::select(*this, tmp, std::forward<Args>(args)...);
//   }
template <class P>
struct device_policy;

namespace detail {

// P, but dependent on Args..., so that a policy's device overload names device_policy<P>
// only when it is instantiated (that is, only in code that included gradcomp/cuda.cuh).
template <class P, class... Args>
struct dependent_type {
  using type = P;
};

}  // namespace detail

}  // namespace gradcomp
