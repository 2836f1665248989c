// gradcomp/detail/float16.hpp: float <-> IEEE binary16 and float <-> bfloat16 conversions
// (round to nearest even, NaN kept quiet, subnormals exact), written once for host and device,
// and the 16-bit value types gradcomp::half and gradcomp::bfloat16 that summable payloads add.
//
// One deliberate departure from IEEE: a finite float too large for the 16-bit format saturates
// to the largest finite value (+-65504 for binary16, +-3.3895e38 for bfloat16) instead of
// becoming Inf. Error feedback computes residual = acc - decoded; a decoded Inf would turn
// the residual into -Inf and poison it forever, while saturation keeps the excess in the
// residual so it is sent later. Inf inputs stay Inf, NaN stays NaN.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#include <gradcomp/config.hpp>

namespace gradcomp::detail {

GRADCOMP_HOST_DEVICE std::uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

GRADCOMP_HOST_DEVICE float bits_to_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

// Position of the highest set bit plus one (0 for 0).
GRADCOMP_HOST_DEVICE unsigned bit_width_u32(std::uint32_t x) {
#if defined(__CUDA_ARCH__)
  return 32u - static_cast<unsigned>(__clz(x));
#else
  return static_cast<unsigned>(std::bit_width(x));
#endif
}

inline constexpr std::uint16_t half_max_bits = 0x7bffu;  // 65504
inline constexpr std::uint16_t bf16_max_bits = 0x7f7fu;  // 3.38953139e38
inline constexpr float half_max = 65504.0f;

// Integer-only, so the result does not depend on the device's flush-to-zero mode.
GRADCOMP_HOST_DEVICE std::uint16_t float_to_half_bits(float f) {
  const std::uint32_t x = float_to_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {
    if (ax == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    // Keep the top payload bits, and set the quiet bit so that a NaN whose top payload
    // bits are zero cannot turn into Inf.
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  }
  // 65520 is the halfway point between 65504 and 2^16: IEEE rounding gives Inf from here on.
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | half_max_bits);
  if (ax >= 0x38800000u) {  // >= 2^-14: a normal half
    // Rebias the exponent (127 -> 15) in place; a rounding carry out of the mantissa moves
    // correctly into the exponent.
    const std::uint32_t r = ax - 0x38000000u;
    return static_cast<std::uint16_t>(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
  }
  // Below 2^-25 (half of the smallest subnormal, 2^-24) everything rounds to zero; exactly
  // 2^-25 is a tie and rounds to the even zero in the general path below.
  if (ax < 0x33000000u) return static_cast<std::uint16_t>(sign);
  // Subnormal half: the result is the 24-bit significand scaled to units of 2^-24.
  const std::uint32_t e = ax >> 23;  // 102..112
  const std::uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - e;  // 14..24
  std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u) != 0u)) ++q;  // may reach 0x400: 2^-14
  return static_cast<std::uint16_t>(sign | q);
}

// Exact; a NaN comes back quiet (as hardware conversions do) with its payload kept.
GRADCOMP_HOST_DEVICE float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  const std::uint32_t e = (static_cast<std::uint32_t>(h) >> 10) & 0x1fu;
  const std::uint32_t m = static_cast<std::uint32_t>(h) & 0x3ffu;
  if (e == 0x1fu) {
    return bits_to_float(sign | 0x7f800000u | (m << 13) | (m != 0u ? 0x400000u : 0u));
  }
  if (e != 0u) return bits_to_float(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0u) return bits_to_float(sign);
  // Subnormal m * 2^-24: normalise by the leading bit, integer-only for flush-to-zero devices.
  const unsigned k = bit_width_u32(m) - 1u;  // 0..9
  return bits_to_float(sign | ((k + 103u) << 23) | ((m << (23u - k)) & 0x7fffffu));
}

GRADCOMP_HOST_DEVICE std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t x = float_to_bits(f);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  if (ax == 0x7f800000u) return static_cast<std::uint16_t>(x >> 16);
  // Halfway between the largest bfloat16 and 2^128: IEEE rounding gives Inf from here on.
  if (ax >= 0x7f7f8000u) return static_cast<std::uint16_t>(((x >> 16) & 0x8000u) | bf16_max_bits);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

GRADCOMP_HOST_DEVICE float bf16_bits_to_float(std::uint16_t b) {
  std::uint32_t x = static_cast<std::uint32_t>(b) << 16;
  if ((x & 0x7fffffffu) > 0x7f800000u) x |= 0x400000u;  // quiet, like half_bits_to_float
  return bits_to_float(x);
}

}  // namespace gradcomp::detail

namespace gradcomp {

// IEEE binary16 value. Arithmetic is done in float and rounded once: float carries more than
// 2 * 11 + 2 significand bits, so the double rounding equals a native half addition.
// Default construction leaves `bits` uninitialised (the type stays trivial, usable in device
// shared memory); half{} is zero.
struct half {
  std::uint16_t bits;

  half() = default;
  GRADCOMP_HOST_DEVICE explicit half(float f) : bits(detail::float_to_half_bits(f)) {}
  GRADCOMP_HOST_DEVICE static half from_bits(std::uint16_t b) {
    half h;
    h.bits = b;
    return h;
  }
  GRADCOMP_HOST_DEVICE explicit operator float() const { return detail::half_bits_to_float(bits); }

  GRADCOMP_HOST_DEVICE half& operator+=(half o) {
    bits = detail::float_to_half_bits(static_cast<float>(*this) + static_cast<float>(o));
    return *this;
  }
  friend GRADCOMP_HOST_DEVICE half operator+(half a, half b) { return a += b; }
  // IEEE comparisons: NaN is unequal to everything, +0 == -0.
  friend GRADCOMP_HOST_DEVICE bool operator==(half a, half b) {
    return static_cast<float>(a) == static_cast<float>(b);
  }
  friend GRADCOMP_HOST_DEVICE bool operator<(half a, half b) {
    return static_cast<float>(a) < static_cast<float>(b);
  }
};

// bfloat16 value (the top half of a float). Same arithmetic rules as half (8 + 8 + 2 <= 24).
struct bfloat16 {
  std::uint16_t bits;

  bfloat16() = default;
  GRADCOMP_HOST_DEVICE explicit bfloat16(float f) : bits(detail::float_to_bf16_bits(f)) {}
  GRADCOMP_HOST_DEVICE static bfloat16 from_bits(std::uint16_t b) {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  GRADCOMP_HOST_DEVICE explicit operator float() const { return detail::bf16_bits_to_float(bits); }

  GRADCOMP_HOST_DEVICE bfloat16& operator+=(bfloat16 o) {
    bits = detail::float_to_bf16_bits(static_cast<float>(*this) + static_cast<float>(o));
    return *this;
  }
  friend GRADCOMP_HOST_DEVICE bfloat16 operator+(bfloat16 a, bfloat16 b) { return a += b; }
  friend GRADCOMP_HOST_DEVICE bool operator==(bfloat16 a, bfloat16 b) {
    return static_cast<float>(a) == static_cast<float>(b);
  }
  friend GRADCOMP_HOST_DEVICE bool operator<(bfloat16 a, bfloat16 b) {
    return static_cast<float>(a) < static_cast<float>(b);
  }
};

// Communicators move these as raw bytes.
static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half> &&
              std::is_trivially_default_constructible_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16> &&
              std::is_trivially_default_constructible_v<bfloat16>);

}  // namespace gradcomp
