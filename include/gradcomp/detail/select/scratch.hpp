// gradcomp/detail/select/scratch.hpp: the buffers a host selector reuses between calls, in
// vectors that do not zero what they allocate.
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/detail/select/keys.hpp>

namespace gradcomp::detail {

// Scratch memory. Index and key buffers are written by branchless appends past their
// logical end, so they are sized before use and must not pay for zero-filling.

template <class T>
struct uninit_allocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = uninit_allocator<U>;
  };
  uninit_allocator() = default;
  template <class U>
  uninit_allocator(const uninit_allocator<U>&) noexcept {}

  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-initialise: no zeroing
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T>
using uninit_vector = std::vector<T, uninit_allocator<T>>;

// Buffers a selector reuses between calls. Copying a selector copies its settings, not its
// scratch: a copy starts with empty buffers.
//  - above: indices known to be selected (exact top-k's "sure" list, Gaussian-k's list of
//    everything above its predicted threshold);
//  - candidates: indices whose rank is still open, finished exactly at the end;
//  - list_keys<T>(): the key of each entry of a list, kept next to it by the pass that wrote it;
//  - keys<T>(): free-form keys (a sample, a sorted copy, the radix select's survivors).
struct select_scratch {
  uninit_vector<std::uint32_t> above;
  uninit_vector<std::uint32_t> candidates;
  uninit_vector<std::uint32_t> keys32;
  uninit_vector<std::uint64_t> keys64;
  uninit_vector<std::uint32_t> list_keys32;
  uninit_vector<std::uint64_t> list_keys64;

  select_scratch() = default;
  select_scratch(const select_scratch&) noexcept {}
  select_scratch(select_scratch&&) noexcept = default;
  select_scratch& operator=(const select_scratch&) noexcept { return *this; }
  select_scratch& operator=(select_scratch&&) noexcept = default;
  ~select_scratch() = default;

  template <class T>
  uninit_vector<abs_key_t<T>>& keys() {
    if constexpr (std::is_same_v<abs_key_t<T>, std::uint32_t>) {
      return keys32;
    } else {
      return keys64;
    }
  }
  template <class T>
  uninit_vector<abs_key_t<T>>& list_keys() {
    if constexpr (std::is_same_v<abs_key_t<T>, std::uint32_t>) {
      return list_keys32;
    } else {
      return list_keys64;
    }
  }
};

// Grow `v` to at least `size` elements (never shrinks, so capacity is kept between calls).
template <class V>
void ensure_size(V& v, std::size_t size) {
  if (v.size() < size) v.resize(size);
}

}  // namespace gradcomp::detail
