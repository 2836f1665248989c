// gradcomp/detail/select/keys.hpp: |g| as an integer key (the order every host and device
// selector ranks by), radix digits of a key, and thresholds expressed as keys.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#include <gradcomp/config.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp::detail {

// Keys. Clearing the sign bit of an IEEE value leaves an unsigned pattern whose integer
// order is the order of |g| for finite values and +Inf; NaN patterns land above +Inf, and
// -0 and +0 share key 0. The sign bit is always clear, so the key also fits the signed type
// of the same width: thresholds use -1 for "everything", and the block test below can work
// with signed arithmetic.

template <class T>
struct abs_key_traits;

template <>
struct abs_key_traits<float> {
  using key = std::uint32_t;
  using signed_key = std::int32_t;
  static constexpr key mask = 0x7fffffffu;
  static constexpr unsigned bits = 31;  // significant key bits
};

template <>
struct abs_key_traits<double> {
  using key = std::uint64_t;
  using signed_key = std::int64_t;
  static constexpr key mask = 0x7fffffffffffffffull;
  static constexpr unsigned bits = 63;
};

template <class T>
using abs_key_t = typename abs_key_traits<T>::key;
template <class T>
using signed_key_t = typename abs_key_traits<T>::signed_key;

template <class T>
GRADCOMP_HOST_DEVICE constexpr abs_key_t<T> abs_key(T x) noexcept {
  return std::bit_cast<abs_key_t<T>>(x) & abs_key_traits<T>::mask;
}

// Same key as a signed integer (never negative).
template <class T>
GRADCOMP_HOST_DEVICE constexpr signed_key_t<T> signed_abs_key(T x) noexcept {
  return static_cast<signed_key_t<T>>(abs_key(x));
}

// The key of the largest finite T: the keys above it are exactly those of +-Inf and NaN.
template <class T>
inline constexpr signed_key_t<T> finite_key_max = signed_abs_key(std::numeric_limits<T>::max());

// |g| of a key, the inverse of abs_key on non-negative values.
template <class T>
GRADCOMP_HOST_DEVICE constexpr T key_magnitude(abs_key_t<T> k) noexcept {
  return std::bit_cast<T>(k);
}

// Radix digit `width` bits wide starting at bit `shift`.
template <class Key>
GRADCOMP_HOST_DEVICE constexpr unsigned radix_digit(Key key, unsigned shift,
                                                    unsigned width) noexcept {
  return static_cast<unsigned>((key >> shift) & ((Key{1} << width) - 1));
}

inline constexpr unsigned radix_digit_bits = 11;

// ---------------------------------------------------------------------------------------
// Thresholds as keys: the selectors compute thresholds in double, the scan compares keys,
// and "key > t" must mean exactly "|g| > v" (or ">= v") in the element type T, including
// when v falls between two floats.

// Largest representable T not above v (v >= 0, may be +Inf), as a signed key: then
// key(x) > t <=> |x| > v for every non-NaN x. Negative v gives -1 (everything).
template <class T>
signed_key_t<T> key_threshold_above(double v) {
  if (v < 0.0) return -1;
  T f;
  if constexpr (std::is_same_v<T, float>) {
    if (v >= static_cast<double>(std::numeric_limits<float>::max())) {
      // Out of float range: the conversion itself would be undefined behaviour.
      f = std::isinf(v) ? std::numeric_limits<float>::infinity()
                        : std::numeric_limits<float>::max();
    } else {
      f = static_cast<float>(v);
      if (static_cast<double>(f) > v) f = std::nextafter(f, 0.0f);
    }
  } else {
    f = v;
  }
  return static_cast<signed_key_t<T>>(abs_key(f));
}

// Key t with key(x) > t <=> |x| >= v for every non-NaN x (v >= 0). v <= 0 gives -1.
template <class T>
signed_key_t<T> key_threshold_at_least(double v) {
  if (!(v > 0.0)) return -1;
  signed_key_t<T> t = key_threshold_above<T>(v);
  // The largest value <= v equals v: step one key down to the largest value < v.
  if (static_cast<double>(key_magnitude<T>(static_cast<abs_key_t<T>>(t))) == v) --t;
  return t;
}

// Indices are uint32: n - 1 must fit.
inline void check_index_range(std::string_view where, std::size_t n) {
  if (static_cast<std::uint64_t>(n) > (std::uint64_t{1} << 32)) {
    throw_invalid_argument(where, "g.size()", n, "n <= 2^32 (indices are 32-bit)");
  }
}

}  // namespace gradcomp::detail
