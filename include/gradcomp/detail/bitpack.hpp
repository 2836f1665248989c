// gradcomp/detail/bitpack.hpp: exact LSB-first packing of b-bit codes, 1 <= b <= 32. Code i
// occupies bits [i*b, (i+1)*b) of the stream, stream bit j is bit j%8 of byte j/8, and count
// codes take exactly ceil(count*b/8) bytes: no padding beyond the last byte, which is
// zero-filled above the last code. Per-element helpers for kernels, fast loops for the host.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include <gradcomp/config.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp::detail {

GRADCOMP_HOST_DEVICE constexpr std::uint32_t code_mask(unsigned bits) {
  return bits >= 32u ? 0xffffffffu : (1u << bits) - 1u;
}

// Same value as payload::packed_bytes; usable in device code.
GRADCOMP_HOST_DEVICE constexpr std::uint64_t packed_size(std::uint64_t count, unsigned bits) {
  return (count * bits + 7u) / 8u;
}

// The smallest number of codes that fill whole bytes, 8 / gcd(bits, 8). Groups of this many
// codes start on byte boundaries and never share a byte, so a kernel that gives each thread
// whole groups (pack_group) writes without atomics.
GRADCOMP_HOST_DEVICE constexpr unsigned codes_per_group(unsigned bits) {
  return (bits & 1u) != 0u ? 8u : (bits & 2u) != 0u ? 4u : (bits & 4u) != 0u ? 2u : 1u;
}

// Code i of a packed stream. Reads only the bytes that hold code i (at most 5), so it stays
// inside the ceil(count*bits/8) bytes of any stream with i < count.
GRADCOMP_HOST_DEVICE std::uint32_t code_at(const std::byte* packed, std::size_t i, unsigned bits) {
  const std::uint64_t first_bit = static_cast<std::uint64_t>(i) * bits;
  const std::byte* p = packed + first_bit / 8u;
  const unsigned shift = static_cast<unsigned>(first_bit % 8u);
  const unsigned nbytes = (shift + bits + 7u) / 8u;
  std::uint64_t w = 0;
  for (unsigned b = 0; b < nbytes; ++b) w |= static_cast<std::uint64_t>(p[b]) << (8u * b);
  return static_cast<std::uint32_t>((w >> shift) & code_mask(bits));
}

// Overwrites code i (only its low `bits` bits are used). A read-modify-write of bytes that
// neighbouring codes may share: not safe for concurrent calls on nearby i (see pack_group).
GRADCOMP_HOST_DEVICE void store_code(std::byte* packed, std::size_t i, unsigned bits,
                                     std::uint32_t code) {
  const std::uint64_t first_bit = static_cast<std::uint64_t>(i) * bits;
  std::byte* p = packed + first_bit / 8u;
  const unsigned shift = static_cast<unsigned>(first_bit % 8u);
  const unsigned nbytes = (shift + bits + 7u) / 8u;
  const std::uint64_t m = static_cast<std::uint64_t>(code_mask(bits)) << shift;
  const std::uint64_t v = static_cast<std::uint64_t>(code & code_mask(bits)) << shift;
  for (unsigned b = 0; b < nbytes; ++b) {
    const auto keep = static_cast<unsigned>(p[b]) & ~static_cast<unsigned>(m >> (8u * b)) & 0xffu;
    p[b] = static_cast<std::byte>(keep | static_cast<unsigned>((v >> (8u * b)) & 0xffu));
  }
}

// Packs the codes of group g (codes [g*G, min(count, (g+1)*G)), G = codes_per_group(bits)),
// calling code_of(i) in increasing i. Writes exactly the bytes of that group, the partial last
// byte of the stream included, so threads that own distinct groups never touch the same byte.
template <class CodeOf>
GRADCOMP_HOST_DEVICE void pack_group(std::byte* packed, std::size_t count, unsigned bits,
                                     std::size_t g, CodeOf&& code_of) {
  const std::size_t group = codes_per_group(bits);
  const std::size_t first = g * group;
  const std::size_t last = first + group < count ? first + group : count;
  std::byte* out = packed + static_cast<std::uint64_t>(first) * bits / 8u;
  const std::uint64_t mask = code_mask(bits);
  std::uint64_t acc = 0;
  unsigned n = 0;  // < 8 between codes, so acc never overflows for bits <= 32
  for (std::size_t i = first; i < last; ++i) {
    acc |= (static_cast<std::uint64_t>(static_cast<std::uint32_t>(code_of(i))) & mask) << n;
    n += bits;
    for (; n >= 8u; n -= 8u, acc >>= 8) *out++ = static_cast<std::byte>(acc & 0xffu);
  }
  if (n > 0u) *out = static_cast<std::byte>(acc & 0xffu);
}

// Little-endian stores and loads; memcpy keeps unaligned access defined.
inline void store_le16(std::byte* p, std::uint16_t v) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, 2);
  } else {
    for (unsigned b = 0; b < 2; ++b) p[b] = static_cast<std::byte>(v >> (8u * b));
  }
}
inline void store_le32(std::byte* p, std::uint32_t v) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, 4);
  } else {
    for (unsigned b = 0; b < 4; ++b) p[b] = static_cast<std::byte>(v >> (8u * b));
  }
}
inline void store_le64(std::byte* p, std::uint64_t v) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, 8);
  } else {
    for (unsigned b = 0; b < 8; ++b) p[b] = static_cast<std::byte>(v >> (8u * b));
  }
}
inline std::uint16_t load_le16(const std::byte* p) noexcept {
  std::uint16_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, 2);
  } else {
    for (unsigned b = 0; b < 2; ++b)
      v = static_cast<std::uint16_t>(v | static_cast<unsigned>(p[b]) << (8u * b));
  }
  return v;
}
inline std::uint32_t load_le32(const std::byte* p) noexcept {
  std::uint32_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, 4);
  } else {
    for (unsigned b = 0; b < 4; ++b) v |= static_cast<std::uint32_t>(p[b]) << (8u * b);
  }
  return v;
}
inline std::uint64_t load_le64(const std::byte* p) noexcept {
  std::uint64_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, 8);
  } else {
    for (unsigned b = 0; b < 8; ++b) v |= static_cast<std::uint64_t>(p[b]) << (8u * b);
  }
  return v;
}

// Widths that divide 64: whole 64-bit words of codes, then a tail of fewer than 8 bytes.
template <unsigned Bits, class CodeOf>
void pack_fixed(std::byte* out, std::size_t count, CodeOf& code_of) {
  static_assert(64u % Bits == 0u);
  constexpr std::size_t per_word = 64u / Bits;
  constexpr std::uint64_t mask = code_mask(Bits);
  const std::size_t full = count / per_word * per_word;
  std::size_t i = 0;
  for (; i < full; i += per_word) {
    std::uint64_t w = 0;
    for (std::size_t j = 0; j < per_word; ++j) {
      w |= (static_cast<std::uint64_t>(static_cast<std::uint32_t>(code_of(i + j))) & mask)
           << (j * Bits);
    }
    store_le64(out, w);
    out += 8;
  }
  if (i < count) {
    std::uint64_t w = 0;
    for (std::size_t j = 0; i < count; ++i, ++j) {
      w |= (static_cast<std::uint64_t>(static_cast<std::uint32_t>(code_of(i))) & mask)
           << (j * Bits);
    }
    const std::size_t nbytes = static_cast<std::size_t>(packed_size(count - full, Bits));
    for (std::size_t b = 0; b < nbytes; ++b) out[b] = static_cast<std::byte>(w >> (8u * b));
  }
}

// Any width: a 64-bit accumulator flushed 32 bits at a time.
template <class CodeOf>
void pack_any(std::byte* out, std::size_t count, unsigned bits, CodeOf& code_of) {
  const std::uint64_t mask = code_mask(bits);
  std::uint64_t acc = 0;
  unsigned n = 0;  // < 32 between codes, so n + bits < 64
  for (std::size_t i = 0; i < count; ++i) {
    acc |= (static_cast<std::uint64_t>(static_cast<std::uint32_t>(code_of(i))) & mask) << n;
    n += bits;
    if (n >= 32u) {
      store_le32(out, static_cast<std::uint32_t>(acc));
      out += 4;
      acc >>= 32;
      n -= 32u;
    }
  }
  for (; n > 0u; n = n > 8u ? n - 8u : 0u, acc >>= 8) *out++ = static_cast<std::byte>(acc & 0xffu);
}

template <unsigned Bits, class Sink>
void unpack_fixed(const std::byte* in, std::size_t count, Sink& sink) {
  static_assert(64u % Bits == 0u);
  constexpr std::size_t per_word = 64u / Bits;
  constexpr std::uint64_t mask = code_mask(Bits);
  const std::size_t full = count / per_word * per_word;
  std::size_t i = 0;
  for (; i < full; i += per_word) {
    const std::uint64_t w = load_le64(in);
    in += 8;
    for (std::size_t j = 0; j < per_word; ++j) {
      sink(i + j, static_cast<std::uint32_t>((w >> (j * Bits)) & mask));
    }
  }
  if (i < count) {
    const std::size_t nbytes = static_cast<std::size_t>(packed_size(count - full, Bits));
    std::uint64_t w = 0;
    for (std::size_t b = 0; b < nbytes; ++b) w |= static_cast<std::uint64_t>(in[b]) << (8u * b);
    for (std::size_t j = 0; i < count; ++i, ++j) {
      sink(i, static_cast<std::uint32_t>((w >> (j * Bits)) & mask));
    }
  }
}

template <class Sink>
void unpack_any(const std::byte* in, std::size_t count, unsigned bits, Sink& sink) {
  const std::uint64_t mask = code_mask(bits);
  std::uint64_t left = packed_size(count, bits);  // bytes not yet loaded
  std::uint64_t acc = 0;
  unsigned n = 0;  // < bits <= 32 before a load, so a 32-bit load fits
  for (std::size_t i = 0; i < count; ++i) {
    if (n < bits) {
      if (left >= 4u) {
        acc |= static_cast<std::uint64_t>(load_le32(in)) << n;
        in += 4;
        left -= 4u;
        n += 32u;
      } else {
        for (; left > 0u; --left, n += 8u) acc |= static_cast<std::uint64_t>(*in++) << n;
      }
    }
    sink(i, static_cast<std::uint32_t>(acc & mask));
    acc >>= bits;
    n -= bits;
  }
}

// Packs count codes into exactly packed_size(count, bits) bytes at out, calling code_of(i)
// once per i in increasing order (callers rely on that to track buckets). Only the low `bits`
// bits of each code are used. Precondition: 1 <= bits <= 32.
template <class CodeOf>
void pack_codes_with(std::byte* out, std::size_t count, unsigned bits, CodeOf&& code_of) {
  switch (bits) {
    case 1: pack_fixed<1>(out, count, code_of); return;
    case 2: pack_fixed<2>(out, count, code_of); return;
    case 4: pack_fixed<4>(out, count, code_of); return;
    case 8: pack_fixed<8>(out, count, code_of); return;
    case 16: pack_fixed<16>(out, count, code_of); return;
    case 32: pack_fixed<32>(out, count, code_of); return;
    default: pack_any(out, count, bits, code_of); return;
  }
}

// Calls sink(i, code) for i = 0..count-1 in increasing order, reading exactly the
// packed_size(count, bits) bytes at in. Precondition: 1 <= bits <= 32.
template <class Sink>
void unpack_codes_with(const std::byte* in, std::size_t count, unsigned bits, Sink&& sink) {
  switch (bits) {
    case 1: unpack_fixed<1>(in, count, sink); return;
    case 2: unpack_fixed<2>(in, count, sink); return;
    case 4: unpack_fixed<4>(in, count, sink); return;
    case 8: unpack_fixed<8>(in, count, sink); return;
    case 16: unpack_fixed<16>(in, count, sink); return;
    case 32: unpack_fixed<32>(in, count, sink); return;
    default: unpack_any(in, count, bits, sink); return;
  }
}

inline void check_pack_args(std::string_view where, std::size_t count, unsigned bits,
                            std::size_t bytes) {
  if (bits < 1u || bits > 32u) throw_invalid_argument(where, "bits", bits, "1 <= bits <= 32");
  const std::uint64_t need = packed_size(count, bits);
  if (bytes != need) {
    throw_invalid_argument(where, "packed byte span size", bytes,
                           concat("exactly ceil(count * bits / 8) = ", need));
  }
}

// Host loops over spans; out.size() must be exactly packed_size(codes.size(), bits).
inline void pack_codes(std::span<const std::uint32_t> codes, unsigned bits,
                       std::span<std::byte> out) {
  check_pack_args("pack_codes", codes.size(), bits, out.size());
  pack_codes_with(out.data(), codes.size(), bits, [codes](std::size_t i) { return codes[i]; });
}

inline void unpack_codes(std::span<const std::byte> in, unsigned bits,
                         std::span<std::uint32_t> codes) {
  check_pack_args("unpack_codes", codes.size(), bits, in.size());
  unpack_codes_with(in.data(), codes.size(), bits,
                    [codes](std::size_t i, std::uint32_t c) { codes[i] = c; });
}

}  // namespace gradcomp::detail
