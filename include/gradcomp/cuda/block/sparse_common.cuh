// gradcomp/cuda/block/sparse_common.cuh: what the sparse and quantize device calls share: the
// device-side error record that lets a kernel reject bad input before anything is written, and
// the choice of whether to check. (The carving of the caller's scratch buffer and the launch
// helpers are the dispatch layer's: dispatch/scratch.cuh, dispatch/launch.cuh.)
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

namespace cuda {

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

}  // namespace cuda
}  // namespace gradcomp
