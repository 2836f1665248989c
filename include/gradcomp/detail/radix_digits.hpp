// gradcomp/detail/radix_digits.hpp: the per-element math of the selectors' device kernels,
// written once for the host compiler and nvcc (GRADCOMP_HOST_DEVICE) and tested on the host:
// the digit layout of the radix select (the same 11-bit digits, most significant first, as
// detail::radix_kth_largest), the strided sample positions of topk, the bracket test of the
// filter pass, and the threshold-to-key conversion without std:: calls nvcc cannot run on the
// device. Keys are those of detail/select/keys.hpp (abs_key: |g| as an unsigned integer, NaN above
// +Inf).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <gradcomp/config.hpp>
#include <gradcomp/detail/select/keys.hpp>

namespace gradcomp::detail {

// ---------------------------------------------------------------------------------------
// Digit layout. A key of `bits` significant bits is split from the top into digits of
// radix_digit_bits (11) bits; the last digit holds what is left. Pass p (0-based) reads the
// digit at shift radix_shift(bits, p) of width radix_width(bits, p). Float keys: 11@20, 11@9,
// 9@0 (3 passes); double keys: 11@52 ... 11@8, 8@0 (6 passes); 32-bit index keys: 11@21,
// 11@10, 10@0.

GRADCOMP_HOST_DEVICE constexpr unsigned radix_passes(unsigned bits) noexcept {
  return (bits + radix_digit_bits - 1) / radix_digit_bits;
}

GRADCOMP_HOST_DEVICE constexpr unsigned radix_shift(unsigned bits, unsigned pass) noexcept {
  const unsigned used = radix_digit_bits * (pass + 1);
  return used >= bits ? 0u : bits - used;
}

GRADCOMP_HOST_DEVICE constexpr unsigned radix_width(unsigned bits, unsigned pass) noexcept {
  return bits - radix_digit_bits * pass - radix_shift(bits, pass);
}

// The bits of the key that passes 0..pass fix (pass < radix_passes(bits)).
template <class Key>
GRADCOMP_HOST_DEVICE constexpr Key radix_fixed_mask(unsigned bits, unsigned pass) noexcept {
  const unsigned shift = radix_shift(bits, pass);
  const unsigned top = bits;  // bits above `bits` are always zero in our keys
  const Key all = top >= sizeof(Key) * 8 ? ~Key{0} : static_cast<Key>((Key{1} << top) - 1);
  return static_cast<Key>(all & ~static_cast<Key>((Key{1} << shift) - 1));
}

// Whether `key` agrees with `prefix` on the bits of `mask` (the candidates of a radix pass).
template <class Key>
GRADCOMP_HOST_DEVICE constexpr bool radix_matches(Key key, Key prefix, Key mask) noexcept {
  return (key & mask) == prefix;
}

// Digit of pass `pass` of a key with `bits` significant bits.
template <class Key>
GRADCOMP_HOST_DEVICE constexpr unsigned radix_pass_digit(Key key, unsigned bits,
                                                         unsigned pass) noexcept {
  return radix_digit(key, radix_shift(bits, pass), radix_width(bits, pass));
}

// One step of the select: given the counts of the 2^width digits of this pass (hist[d]) and
// the 1-based rank (from the largest) among the candidates, the digit that holds it; rank
// becomes the rank within that digit's bucket and `above` grows by the elements of higher
// digits. Returns 2^width when the counts hold fewer than rank elements (a broken invariant).
template <class Count>
GRADCOMP_HOST_DEVICE unsigned radix_pick_digit(const Count* hist, unsigned width,
                                               unsigned long long& rank,
                                               unsigned long long& above) noexcept {
  for (unsigned d = (1u << width); d-- > 0;) {
    const auto c = static_cast<unsigned long long>(hist[d]);
    if (c >= rank) return d;
    rank -= c;
    above += c;
  }
  return 1u << width;
}

// ---------------------------------------------------------------------------------------
// The strided sample of topk: sample j of s (1 <= s <= n) reads position floor(j n / s), as
// detail::for_each_strided does by quotient and remainder. j n < 2^64 for j < s <= 2^32 and
// n <= 2^32.
GRADCOMP_HOST_DEVICE constexpr std::uint64_t strided_position(std::uint64_t j, std::uint64_t n,
                                                              std::uint64_t s) noexcept {
  return j * n / s;
}

// ---------------------------------------------------------------------------------------
// The bracket test of the filter pass: keys above hi are surely selected, keys in [lo, hi]
// are candidates, the rest are out (topk's bracket_pass: candidates are key > lo - 1).
enum class bracket_class : unsigned { out = 0, candidate = 1, sure = 2 };

template <class Key>
GRADCOMP_HOST_DEVICE constexpr bracket_class classify_bracket(Key key, Key lo, Key hi) noexcept {
  return key > hi ? bracket_class::sure
                  : (key >= lo ? bracket_class::candidate : bracket_class::out);
}

// The class of an element in the final "take" of a selection by key: every key above `kth`
// is taken (2), keys equal to `kth` are ties (1) of which the caller takes the first few in
// index order, the rest are out (0). A threshold selection "key > t" is kth = t with no ties
// taken.
template <class Key>
GRADCOMP_HOST_DEVICE constexpr unsigned take_class(Key key, Key kth) noexcept {
  return key > kth ? 2u : (key == kth ? 1u : 0u);
}

// ---------------------------------------------------------------------------------------
// key_threshold_above<T> without std::nextafter and std::isinf, so that kernels can turn a
// threshold computed on the device into a key: the largest T not above v (v >= 0, +Inf
// allowed) as a signed key, -1 for v < 0 (everything). Equal to key_threshold_above<T>(v)
// for every v that is not NaN (tests/detail/radix_digits_test.cpp checks it).
template <class T>
GRADCOMP_HOST_DEVICE signed_key_t<T> key_threshold_above_hd(double v) noexcept {
  using S = signed_key_t<T>;
  if (v < 0.0) return -1;
  if constexpr (std::is_same_v<T, float>) {
    constexpr double fmax = static_cast<double>(std::numeric_limits<float>::max());
    constexpr S inf_key = 0x7f800000;
    constexpr S max_key = 0x7f7fffff;
    if (v >= fmax) return v > std::numeric_limits<double>::max() ? inf_key : max_key;
    const auto f = static_cast<float>(v);
    S key = static_cast<S>(abs_key(f));
    // Rounded up: one key down is the next float towards zero (f > v >= 0, so key >= 1).
    if (static_cast<double>(f) > v) --key;
    return key;
  } else {
    return static_cast<S>(abs_key(v));
  }
}

}  // namespace gradcomp::detail
