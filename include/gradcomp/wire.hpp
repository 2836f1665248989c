// gradcomp/wire.hpp: the byte format of a payload (version 1, little-endian), an encoder that
// appends payloads to a stream, and a decoder that validates every field before it allocates
// or writes, so bytes from the network can never make gradcomp read or write out of bounds.
//
// One payload, byte offsets from its first byte:
//    0   4  magic "GCMP"
//    4   2  u16 version, 1
//    6   1  u8  index_layout (0 sparse, 1 dense)
//    7   1  u8  quantizer_id (1..6)
//    8   1  u8  bits_per_value, as gradcomp/detail/quantizer_layout.hpp says for the params
//    9   7  reserved, all zero
//   16   8  u64 dense_size n, <= 2^32
//   24   4  u32 count, <= n, and == n for the dense layout
//   28   4  u32 side_count, as the quantizer table says for (params, count)
//   32   4  u32 parameter word 0: QSGD's levels; TernGrad's and scaled sign's bucket size
//   36   4  u32 parameter word 1: QSGD's bucket size (0 for the others); see quantizer_params
//   40      body:
//           indices  count x u32, strictly increasing, each < n (sparse layout only)
//           side     side_count x f32, each finite and >= 0
//           values   ceil(count * bits_per_value / 8) bytes, codes packed LSB first
// Total: 40 + 4*count (sparse) + 4*side_count + ceil(count*bits/8) bytes, no padding, so
// payloads concatenate into a stream that decode_wire(bytes, out) walks one at a time.
// Reserved bytes and the version let later formats be told apart; this build reads version 1.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/detail/quantizer_layout.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

inline constexpr std::uint16_t wire_version = 1;
inline constexpr std::size_t wire_header_bytes = 40;
inline constexpr std::uint64_t wire_max_dense_size = std::uint64_t{1} << 32;

namespace detail {

inline constexpr std::byte wire_magic[4] = {std::byte{'G'}, std::byte{'C'}, std::byte{'M'},
                                            std::byte{'P'}};

// The header fields as numbers, before any of them is trusted.
struct wire_fields {
  std::uint8_t layout = 0;
  std::uint8_t quantizer = 0;
  unsigned bits = 0;
  std::uint64_t dense_size = 0;
  std::uint64_t count = 0;
  std::uint64_t side_count = 0;
  quantizer_params params{};
};

// Body size in bytes for checked fields; cannot overflow (count, side_count < 2^32).
inline std::uint64_t wire_total(const wire_fields& f) {
  const std::uint64_t index_bytes =
      f.layout == static_cast<std::uint8_t>(index_layout::sparse) ? 4u * f.count : 0u;
  return wire_header_bytes + index_bytes + 4u * f.side_count + packed_size(f.count, f.bits);
}

// Checks shared by the encoder (on a payload object) and the decoder (on header bytes).
inline void check_wire_fields(std::string_view where, const wire_fields& f) {
  if (f.layout > 1u) {
    throw_payload_error(where, "layout = ", static_cast<unsigned>(f.layout),
                        "; expected 0 (sparse) or 1 (dense)");
  }
  if (!is_known_quantizer(f.quantizer)) {
    throw_payload_error(where, "quantizer id = ", static_cast<unsigned>(f.quantizer),
                        "; expected a known id, 1..6");
  }
  const auto id = static_cast<quantizer_id>(f.quantizer);
  const value_layout vl = checked_layout(where, id, f.params, f.count);
  if (f.dense_size > wire_max_dense_size) {
    throw_payload_error(where, "dense_size = ", f.dense_size, "; expected <= 2^32");
  }
  if (f.count > f.dense_size) {
    throw_payload_error(where, "count = ", f.count, "; expected <= dense_size (", f.dense_size,
                        ")");
  }
  if (f.layout == static_cast<std::uint8_t>(index_layout::dense) && f.count != f.dense_size) {
    throw_payload_error(where, "count = ", f.count,
                        "; the dense layout needs count == dense_size (", f.dense_size, ")");
  }
  if (f.bits != vl.bits_per_value) {
    throw_payload_error(where, "bits_per_value = ", f.bits, "; expected ", vl.bits_per_value,
                        " for ", quantizer_name(id), " with levels ", f.params.levels,
                        " and bucket size ", f.params.bucket_size);
  }
  if (f.side_count != vl.side_count) {
    throw_payload_error(where, "side_count = ", f.side_count, "; expected ", vl.side_count, " for ",
                        quantizer_name(id), " with ", f.count, " values, levels ",
                        f.params.levels, " and bucket size ", f.params.bucket_size);
  }
}

inline wire_fields fields_of(const payload& p) {
  wire_fields f;
  f.layout = static_cast<std::uint8_t>(p.layout);
  f.quantizer = static_cast<std::uint8_t>(p.quantizer);
  f.bits = p.bits_per_value;
  f.dense_size = p.dense_size;
  f.count = p.count;
  f.side_count = p.side.size();
  f.params = p.params;
  return f;
}

// A validated encoding inside a byte span.
struct wire_view {
  wire_fields fields;
  const std::byte* indices = nullptr;
  const std::byte* side = nullptr;
  const std::byte* values = nullptr;
  std::size_t value_bytes = 0;
  std::size_t total = 0;
};

// Reads and validates the payload at the start of `bytes`; exact: it must fill `bytes`.
// Every length is checked against the span before anything is read from the body.
inline wire_view parse_wire(std::span<const std::byte> bytes, bool exact) {
  constexpr std::string_view where = "decode_wire";
  if (bytes.size() < wire_header_bytes) {
    throw_payload_error(where, "truncated: ", bytes.size(), " bytes; a header needs ",
                        wire_header_bytes);
  }
  const std::byte* h = bytes.data();
  if (std::memcmp(h, wire_magic, 4) != 0) {
    throw_payload_error(where, "magic = ", static_cast<unsigned>(h[0]), " ",
                        static_cast<unsigned>(h[1]), " ", static_cast<unsigned>(h[2]), " ",
                        static_cast<unsigned>(h[3]), "; expected \"GCMP\" (71 67 77 80)");
  }
  const std::uint16_t version = load_le16(h + 4);
  if (version != wire_version) {
    throw_payload_error(where, "unsupported version ", version,
                        "; this build reads version 1 only");
  }
  for (std::size_t k = 9; k < 16; ++k) {
    if (h[k] != std::byte{0}) {
      throw_payload_error(where, "reserved byte at offset ", k, " = ", static_cast<unsigned>(h[k]),
                          "; expected 0");
    }
  }
  wire_view v;
  wire_fields& f = v.fields;
  f.layout = static_cast<std::uint8_t>(h[6]);
  f.quantizer = static_cast<std::uint8_t>(h[7]);
  f.bits = static_cast<unsigned>(h[8]);
  f.dense_size = load_le64(h + 16);
  f.count = load_le32(h + 24);
  f.side_count = load_le32(h + 28);
  f.params = from_param_words(static_cast<quantizer_id>(f.quantizer), load_le32(h + 32),
                              load_le32(h + 36));
  check_wire_fields(where, f);

  const std::uint64_t total = wire_total(f);
  if (exact ? bytes.size() != total : bytes.size() < total) {
    throw_payload_error(where,
                        bytes.size() < total ? "truncated: " : "trailing bytes: ", bytes.size(),
                        " bytes; the header announces ", total);
  }
  v.total = static_cast<std::size_t>(total);
  const bool sparse = f.layout == static_cast<std::uint8_t>(index_layout::sparse);
  v.indices = h + wire_header_bytes;
  v.side = v.indices + (sparse ? 4u * f.count : 0u);
  v.values = v.side + 4u * f.side_count;
  v.value_bytes = static_cast<std::size_t>(packed_size(f.count, f.bits));

  if (sparse) {
    check_indices(where, f.count, f.dense_size,
                       [&v](std::uint64_t i) { return load_le32(v.indices + 4u * i); });
  }
  for (std::uint64_t b = 0; b < f.side_count; ++b) {
    const float x = bits_to_float(load_le32(v.side + 4u * b));
    if (!(std::isfinite(x) && x >= 0.0f)) {
      throw_payload_error(where, "side[", b, "] = ", x, "; expected finite and >= 0");
    }
  }
  return v;
}

// Copies a validated view into `out`. Allocation happens in reserve(), which leaves the
// contents alone if it throws; after the reserves nothing can throw, which gives the strong
// guarantee.
inline void assign_wire(const wire_view& v, payload& out) {
  const wire_fields& f = v.fields;
  const bool sparse = f.layout == static_cast<std::uint8_t>(index_layout::sparse);
  const auto count = static_cast<std::size_t>(f.count);
  const auto side_count = static_cast<std::size_t>(f.side_count);
  if (sparse) out.indices.reserve(count);
  out.side.reserve(side_count);
  out.values.reserve(v.value_bytes);

  out.indices.resize(sparse ? count : 0u);
  out.side.resize(side_count);
  out.values.resize(v.value_bytes);
  if constexpr (std::endian::native == std::endian::little) {
    if (count != 0 && sparse) std::memcpy(out.indices.data(), v.indices, 4u * count);
    if (side_count != 0) std::memcpy(out.side.data(), v.side, 4u * side_count);
  } else {
    for (std::size_t i = 0; i < out.indices.size(); ++i)
      out.indices[i] = load_le32(v.indices + 4u * i);
    for (std::size_t b = 0; b < side_count; ++b)
      out.side[b] = bits_to_float(load_le32(v.side + 4u * b));
  }
  if (v.value_bytes != 0) std::memcpy(out.values.data(), v.values, v.value_bytes);
  out.dense_size = f.dense_size;
  out.layout = static_cast<index_layout>(f.layout);
  out.quantizer = static_cast<quantizer_id>(f.quantizer);
  out.bits_per_value = static_cast<std::uint8_t>(f.bits);
  out.params = f.params;
  out.count = static_cast<std::uint32_t>(f.count);
}

}  // namespace detail

namespace detail {

inline void validate_payload_at(std::string_view where, const payload& p) {
  check_wire_fields(where, fields_of(p));
  const std::size_t want_indices = p.layout == index_layout::sparse ? p.count : 0u;
  if (p.indices.size() != want_indices) {
    throw_payload_error(
        where, "indices has ", p.indices.size(), " entries; expected ", want_indices,
        p.layout == index_layout::sparse ? " (count, sparse layout)" : " (dense layout)");
  }
  const std::uint64_t want_values = packed_size(p.count, p.bits_per_value);
  if (p.values.size() != want_values) {
    throw_payload_error(where, "values has ", p.values.size(), " bytes; expected ", want_values,
                        " for ", p.count, " values of ", static_cast<unsigned>(p.bits_per_value),
                        " bits");
  }
  if (p.layout == index_layout::sparse) {
    check_indices(where, p.count, p.dense_size,
                       [&p](std::uint64_t i) { return p.indices[i]; });
  }
  check_side_values(where, p.side);
}

// Writes a validated payload; `out` has wire_size(p) bytes.
inline void write_wire(const payload& p, std::byte* out) noexcept {
  std::memcpy(out, wire_magic, 4);
  store_le16(out + 4, wire_version);
  out[6] = static_cast<std::byte>(p.layout);
  out[7] = static_cast<std::byte>(p.quantizer);
  out[8] = static_cast<std::byte>(p.bits_per_value);
  std::memset(out + 9, 0, 7);
  store_le64(out + 16, p.dense_size);
  store_le32(out + 24, p.count);
  store_le32(out + 28, static_cast<std::uint32_t>(p.side.size()));
  const param_words words = to_param_words(p.quantizer, p.params);
  store_le32(out + 32, words.word0);
  store_le32(out + 36, words.word1);
  std::byte* body = out + wire_header_bytes;
  if constexpr (std::endian::native == std::endian::little) {
    if (!p.indices.empty()) std::memcpy(body, p.indices.data(), 4u * p.indices.size());
    body += 4u * p.indices.size();
    if (!p.side.empty()) std::memcpy(body, p.side.data(), 4u * p.side.size());
    body += 4u * p.side.size();
  } else {
    for (const std::uint32_t x : p.indices) {
      store_le32(body, x);
      body += 4;
    }
    for (const float x : p.side) {
      store_le32(body, float_to_bits(x));
      body += 4;
    }
  }
  if (!p.values.empty()) std::memcpy(body, p.values.data(), p.values.size());
}

}  // namespace detail

// Throws payload_error unless p is what decode_wire could return: every rule of the format
// above, plus indices.size() == count (sparse) or 0 (dense) and values.size() exact.
// encode_wire runs it, so whatever it writes decodes.
inline void validate_payload(const payload& p) {
  detail::validate_payload_at("validate_payload", p);
}

// Bytes encode_wire writes for p (p assumed consistent).
inline std::size_t wire_size(const payload& p) noexcept {
  const std::uint64_t count = p.count;
  const std::uint64_t index_bytes = p.layout == index_layout::sparse ? 4u * count : 0u;
  const std::uint64_t side_bytes = 4u * static_cast<std::uint64_t>(p.side.size());
  return static_cast<std::size_t>(wire_header_bytes + index_bytes + side_bytes +
                                  detail::packed_size(count, p.bits_per_value));
}

// The most bytes any valid payload for a tensor of dense_size elements encodes to: the header
// and, per entry, a 4-byte index, at most one 4-byte side value and at most 32 bits of value,
// plus the packing's rounding. What an exchange lets a peer announce before it sizes a buffer.
inline constexpr std::size_t wire_max_size(std::uint64_t dense_size) noexcept {
  const std::uint64_t n = dense_size < wire_max_dense_size ? dense_size : wire_max_dense_size;
  return static_cast<std::size_t>(wire_header_bytes + 8u + 12u * n);
}

// Writes p into out, which must hold at least wire_size(p) bytes; returns the bytes written.
// Throws payload_error if p is inconsistent, invalid_argument if out is too small.
inline std::size_t encode_wire(const payload& p, std::span<std::byte> out) {
  detail::validate_payload_at("encode_wire", p);
  const std::size_t size = wire_size(p);
  if (out.size() < size) {
    detail::throw_invalid_argument("encode_wire", "out.size()", out.size(),
                                   detail::concat(">= wire_size(payload) = ", size));
  }
  detail::write_wire(p, out.data());
  return size;
}

// Appends the encoding of p to out, so that several payloads form one stream. On a throw
// out is unchanged.
inline void encode_wire(const payload& p, std::vector<std::byte>& out) {
  detail::validate_payload_at("encode_wire", p);
  const std::size_t old = out.size();
  out.resize(old + wire_size(p));
  detail::write_wire(p, out.data() + old);
}

// Decodes the payload at the start of bytes (a stream of concatenated payloads may follow)
// into out, reusing its capacity; returns the bytes consumed. Strong guarantee: on
// payload_error (or bad_alloc) out is unchanged.
namespace detail {

// The count field of the payload at the front of `bytes` (0 when they are shorter than a
// header), read without checking anything else: a hint for sizing, never trusted for access.
inline std::size_t wire_count(std::span<const std::byte> bytes) {
  if (bytes.size() < wire_header_bytes) return 0;
  return load_le32(bytes.data() + 24);
}

}  // namespace detail

inline std::size_t decode_wire(std::span<const std::byte> bytes, payload& out) {
  const detail::wire_view v = detail::parse_wire(bytes, /*exact=*/false);
  detail::assign_wire(v, out);
  return v.total;
}

// Decodes bytes that hold exactly one payload.
inline payload decode_wire(std::span<const std::byte> bytes) {
  const detail::wire_view v = detail::parse_wire(bytes, /*exact=*/true);
  payload p;
  detail::assign_wire(v, p);
  return p;
}

}  // namespace gradcomp
