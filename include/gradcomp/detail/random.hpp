// gradcomp/detail/random.hpp: a counter-based generator. The i-th random number of a stream
// is a pure function of (key, i), so host and device code, and every rank, draw the same
// numbers without sharing state, and element i can be drawn by any thread.
#pragma once

#include <cstdint>

#include <gradcomp/config.hpp>
#include <gradcomp/context.hpp>

namespace gradcomp::detail {

#if !defined(__CUDA_ARCH__)
__extension__ typedef unsigned __int128 uint128;  // GCC/Clang extension, silenced for -Wpedantic
#endif

// SplitMix64 finalizer: a bijective 64-bit mixer with full avalanche.
GRADCOMP_HOST_DEVICE std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Distinct purposes of random streams within one call, so that e.g. QSGD rounding and
// Random-k index choice never reuse numbers.
enum class stream_tag : std::uint64_t {
  select = 0x53454c45,    // "SELE"
  quantize = 0x5155414e,  // "QUAN"
  sample = 0x53414d50,    // "SAMP"
};

GRADCOMP_HOST_DEVICE std::uint64_t stream_key(std::uint64_t seed, std::uint64_t step,
                                              std::uint32_t tensor_id, stream_tag tag) {
  std::uint64_t k = mix64(seed ^ 0x6a09e667f3bcc909ULL);
  k = mix64(k ^ step);
  k = mix64(k ^ (static_cast<std::uint64_t>(tensor_id) << 32 | 0x9e37u));
  return mix64(k ^ static_cast<std::uint64_t>(tag));
}

// The stream of one call. Only the quantize stream depends on id.rank (see call_id); rank 0's
// is the stream of (seed, step, tensor_id) alone.
inline std::uint64_t stream_key(const call_id& id, stream_tag tag) {
  const std::uint64_t key = stream_key(id.seed, id.step, id.tensor_id, tag);
  if (tag != stream_tag::quantize || id.rank == 0) return key;
  return mix64(key ^ (0xd1b54a32d192ed03ULL * static_cast<std::uint64_t>(id.rank)));
}

struct counter_rng {
  std::uint64_t key = 0;

  // The i-th 64-bit number of the stream.
  GRADCOMP_HOST_DEVICE std::uint64_t bits(std::uint64_t i) const {
    return mix64(key + (i + 1) * 0x9e3779b97f4a7c15ULL);
  }
  // Uniform in [0, 1) with 24 random bits: exact in float, same on host and device.
  GRADCOMP_HOST_DEVICE float uniform(std::uint64_t i) const {
    return static_cast<float>(bits(i) >> 40) * 0x1.0p-24f;
  }
  // Uniform integer in [0, bound) by the multiply-shift method (bias < bound / 2^64).
  GRADCOMP_HOST_DEVICE std::uint64_t below(std::uint64_t i, std::uint64_t bound) const {
#if defined(__CUDA_ARCH__)
    return __umul64hi(bits(i), bound);
#else
    return static_cast<std::uint64_t>((static_cast<uint128>(bits(i)) * bound) >> 64);
#endif
  }
};

}  // namespace gradcomp::detail
