// gradcomp/device.hpp: the host-side half of the device vocabulary. It needs no CUDA header, so
// that host code can name device memory and the one entry to the device forms:
//  - device_span<T>: a non-owning view of device memory (never dereferenced on the host);
//  - temp_storage: the caller's scratch buffer, CUB style: call once with ptr == nullptr to
//    learn `bytes`, allocate, call again to do the work;
//  - on_device(policy): the policy's calls on device spans, given a temp_storage and a stream,
//    through device_policy<P>, which the headers under gradcomp/cuda/ specialise (include
//    gradcomp/cuda.cuh and compile with nvcc). The same topk, qsgd or residual object works on
//    host spans through its own members.
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

// The device forms of policy P: a class bound to one policy object, with the policy's calls on
// device spans (select, select_accumulate, encode, decode, accumulate, update, restore,
// gather_and_clear; each takes a temp_storage first and a stream last). gradcomp/cuda/*.cuh
// specialise it for topk, gaussiank, threshold, randomk, residual and the six quantizers; this
// primary template stands for "no device form is visible here".
template <class P>
struct device_policy {
  using not_available = void;
};

// Whether P's device forms are visible in this translation unit (gradcomp/cuda.cuh included).
template <class P>
concept has_device_policy = !requires { typename device_policy<P>::not_available; };

namespace detail {

template <class>
inline constexpr bool dependent_false = false;

// What on_device returns, after its static_assert, when no device form is visible: it takes
// every device call, so that the static_assert's sentence is the only error.
struct no_device_form {
  template <class... A> void select(A&&...) const {}
  template <class... A> void select_accumulate(A&&...) const {}
  template <class... A> void encode(A&&...) const {}
  template <class... A> void decode(A&&...) const {}
  template <class... A> void accumulate(A&&...) const {}
  template <class... A> void update(A&&...) const {}
  template <class... A> void restore(A&&...) const {}
  template <class... A> void gather_and_clear(A&&...) const {}
};

}  // namespace detail

// The one entry to every device form: on_device(policy) binds the policy, and the call names
// the operation, e.g.
//   gradcomp::on_device(sel).select(tmp, g, ctx, indices, d_stats, stream);
//   gradcomp::on_device(q).encode(tmp, values, call, encoded, stream);
//   gradcomp::on_device(fb).gather_and_clear(tmp, e, indices, d_stats, values, stream);
// The policy is held by reference: use the result within the statement, or while the policy
// lives. The same policy object with the same settings works on the host, by its own members.
template <class P>
auto on_device(P& policy) {
  using policy_type = std::remove_cv_t<P>;
  if constexpr (has_device_policy<policy_type>) {
    return device_policy<policy_type>(policy);
  } else {
    static_assert(detail::dependent_false<P>,
                  "gradcomp::on_device(policy): no device form of this policy is visible here; "
                  "topk, gaussiank, threshold, randomk, residual and the six quantizers have "
                  "theirs in <gradcomp/cuda.cuh>, so include it and compile this file with "
                  "nvcc (the other policies run on the host only).");
    return detail::no_device_form{};
  }
}

}  // namespace gradcomp
