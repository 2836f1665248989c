// gradcomp/cuda/dispatch/scratch.cuh: how every device call uses the caller's one scratch
// buffer (CUB's convention). A scratch_carver cuts 256-byte aligned pieces from it; with a null
// base (the size query) it only measures, and the same sequence of take() calls then carves
// the real buffer. finish_size_query ends the size query, or checks the real buffer's size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <gradcomp/device.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp::cuda {

class scratch_carver {
 public:
  explicit scratch_carver(void* base) : base_(static_cast<char*>(base)) {}

  template <class U>
  U* take(std::size_t count) {
    const auto addr = reinterpret_cast<std::uintptr_t>(base_) + offset_;
    offset_ += (alignment - addr % alignment) % alignment;
    U* p = base_ ? reinterpret_cast<U*>(base_ + offset_) : nullptr;
    offset_ += count * sizeof(U);
    measured_ = (measured_ + alignment - 1) / alignment * alignment + count * sizeof(U);
    return p;
  }
  // Bytes for a CUB call that sized itself, at an aligned address.
  void* take_bytes(std::size_t n) { return take<std::byte>(n); }

  // The size query's answer, the same whatever the base: what the pieces take from an aligned
  // base plus `alignment` bytes of slack, so that a base that is not itself aligned still fits
  // (its padding adds less than `alignment`); never 0, so that a buffer of this size is never
  // mistaken for another size query.
  [[nodiscard]] std::size_t bytes() const noexcept { return measured_ + alignment; }

 private:
  static constexpr std::size_t alignment = 256;
  char* base_;
  std::size_t offset_ = 0;    // from base_, with the padding its alignment needs
  std::size_t measured_ = 0;  // from an aligned base
};

// The CUB convention: a size query sets tmp.bytes and returns true (the caller returns at
// once); a real call whose buffer is too small throws before anything is launched.
inline bool finish_size_query(std::string_view where, temp_storage& tmp,
                              const scratch_carver& c) {
  if (tmp.is_size_query()) {
    tmp.bytes = c.bytes();
    return true;
  }
  if (tmp.bytes < c.bytes()) {
    detail::throw_invalid_argument(where, "tmp.bytes", tmp.bytes,
                                   detail::concat(">= ", c.bytes(), " (the size query's answer)"));
  }
  return false;
}

}  // namespace gradcomp::cuda
