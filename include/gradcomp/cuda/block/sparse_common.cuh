// gradcomp/cuda/block/sparse_common.cuh: what the sparse and quantize device calls share:
// the carving of the caller's one scratch buffer, the device-side error record that lets a
// kernel reject bad input before anything is written, and the choice of whether to check.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <gradcomp/config.hpp>
#include <gradcomp/device.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp {

// Whether a device call checks its input on the device (indices in range, side values and
// codes valid). `check` costs one extra read of the input and one host round trip (a
// cudaStreamSynchronize) to turn a problem into the host's exception; `trusted` is for input
// the caller has already validated (a payload the host wire decoder accepted, the output of
// the device encoder) and never leaves the stream. Either way no index out of range is
// ever written.
enum class device_validation { check, trusted };

// Internals of the sparse and quantize device calls.
namespace cuda::qs {

// The first problem a validation kernel found, as one 64-bit key (smaller = earlier, built by
// the caller, e.g. position << 32 | detail); no_error when none. A kernel that writes results
// first reads its error records and does nothing when one is set, so a rejected call changes
// nothing even though the host learns of it later.
inline constexpr unsigned long long no_error = ~0ull;

struct error_record {
  unsigned long long first;
};

GRADCOMP_DEVICE void report_error(error_record* r, unsigned long long key) {
  atomicMin(&r->first, key);
}

GRADCOMP_DEVICE bool any_error(const error_record* r, unsigned count) {
  if (r == nullptr) return false;
  bool bad = false;
  for (unsigned i = 0; i < count; ++i) bad = bad || r[i].first != no_error;
  return bad;
}

// Cuts aligned pieces from the caller's scratch buffer. With base == nullptr (a size query)
// it only counts; `bytes()` is then what the call needs, never 0, so that a second call with
// a buffer of that size is never mistaken for another size query.
class scratch {
 public:
  explicit scratch(void* base) : base_(static_cast<std::byte*>(base)) {}

  template <class T>
  T* take(std::size_t n) {
    used_ = (used_ + alignment - 1) / alignment * alignment;
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + used_);
    used_ += n * sizeof(T);
    return p;
  }
  // The remaining bytes from an aligned offset, for a CUB call that sized itself.
  void* take_bytes(std::size_t n) { return take<std::byte>(n); }

  [[nodiscard]] std::size_t bytes() const { return used_ > 0 ? used_ : 1; }

 private:
  static constexpr std::size_t alignment = 256;
  std::byte* base_;
  std::size_t used_ = 0;
};

// The CUB convention: a size query sets tmp.bytes and reports true ("done"); a real call with
// too small a buffer throws before anything is launched.
inline bool finish_size_query(std::string_view where, temp_storage& tmp, const scratch& s) {
  if (tmp.is_size_query()) {
    tmp.bytes = s.bytes();
    return true;
  }
  if (tmp.bytes < s.bytes()) {
    detail::throw_invalid_argument(where, "tmp.bytes", tmp.bytes,
                                   detail::concat(">= ", s.bytes(), " (the size query's answer)"));
  }
  return false;
}

inline unsigned grid_for(std::size_t items, unsigned threads, std::size_t max_blocks) {
  const std::size_t blocks = (items + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks > max_blocks ? max_blocks : blocks);
}

}  // namespace cuda::qs
}  // namespace gradcomp
