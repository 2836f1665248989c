// libFuzzer target for one quantizer's decode, chosen at compile time by
// GRADCOMP_FUZZ_QUANTIZER (identity, fp16, bf16, qsgd, terngrad or scaled_sign). The payload
// object is built straight from the input, bypassing the wire decoder's checks, so that the
// decoder's own checks are what stands between the bytes and the output. Properties:
// - decode throws nothing but payload_error or invalid_argument, and then leaves its output
//   (filled with a sentinel) untouched;
// - on success it wrote every output value (decoding again into another fill gives the same
//   bytes); those of qsgd, terngrad and scaled_sign are finite and within their bucket's
//   scale; those of fp16, bf16 and identity re-encode to their codes.
//
// Input layout (fuzz/make_corpus.cpp writes seeds in it):
//   0      flags: bit 0 take quantizer id, bits and params from the decoder
//                 bit 1 exact side count for the count; bit 2 exact values size;
//                 bit 3 output size == count; a clear bit takes the raw field below
//   1      quantizer id            2      bits per value
//   3..10  parameter words (u32)   11..14 decoder settings s0, s1 (u16), mapped into range
//   15..16 count (u16, low 12 bits) 17    side count     18  output size - count (i8)
//   19..   side values (f32, as many as the side count, missing ones 1.0), then value bytes
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "fuzz_common.hpp"

#ifndef GRADCOMP_FUZZ_QUANTIZER
#error "define GRADCOMP_FUZZ_QUANTIZER as the quantizer to fuzz, e.g. qsgd"
#endif

namespace {

using namespace gradcomp;
using Q = gradcomp::GRADCOMP_FUZZ_QUANTIZER;
using fuzz::require;

// Templates, so that `if constexpr` discards the branches of the other quantizers.
template <class D>
D make_decoder(std::uint16_t s0, std::uint16_t s1) {
  if constexpr (std::is_same_v<D, qsgd>) {
    return qsgd(1u + s0 % detail::qsgd_max_levels, 1u + s1);
  } else if constexpr (std::is_same_v<D, terngrad> || std::is_same_v<D, scaled_sign>) {
    return D(s0);  // 0: one bucket
  } else {
    (void)s0;
    (void)s1;
    return D{};
  }
}

// The bucket scale that bounds output i (qsgd, terngrad, scaled_sign).
template <class D>
float scale_of(const D& q, const payload& p, std::size_t i) {
  std::size_t bucket = 1;
  if constexpr (std::is_same_v<D, qsgd>) {
    bucket = q.bucket_size();
  } else if constexpr (std::is_same_v<D, terngrad> || std::is_same_v<D, scaled_sign>) {
    bucket = q.bucket_size() == 0 ? p.count : q.bucket_size();
  }
  return p.side[i / bucket];
}

template <class D>
void check_success(const D& q, const payload& p, std::span<const float> out) {
  require(out.size() == p.count, "decode succeeded with an output of another size");
  if constexpr (std::is_same_v<D, qsgd> || std::is_same_v<D, terngrad> ||
                std::is_same_v<D, scaled_sign>) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      require(std::isfinite(out[i]), "decoded value not finite");
      require(std::fabs(out[i]) <= scale_of(q, p, i), "decoded value beyond its bucket's scale");
    }
  } else {
    // Deterministic casts: every non-NaN value re-encodes to the code it came from.
    payload again;
    again.count = p.count;
    q.encode(out, call_id{}, again);
    const unsigned bits = q.bits_per_value();
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (std::isnan(out[i])) continue;
      require(detail::code_at(again.values.data(), i, bits) == detail::code_at(p.values.data(), i, bits),
              "a decoded value does not re-encode to its code");
    }
  }
  // Into another fill: a value decode did not write would show as a difference.
  std::vector<float> twice(out.size(), 7777.125f);
  q.decode(p, twice);
  require(fuzz::same_bytes<float>(twice, out),
          "decoding twice gave different bytes (or left a value unwritten)");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 19) return 0;
  fuzz::reader in{data, size};
  const unsigned flags = in.u8();
  const std::uint8_t raw_id = in.u8();
  const std::uint8_t raw_bits = in.u8();
  const std::uint32_t word0 = in.u32();  // the parameter words, as on the wire
  const std::uint32_t word1 = in.u32();
  const std::uint16_t s0 = in.u16();
  const std::uint16_t s1 = in.u16();
  // 12 bits: outputs of up to 4095 values reach every path; larger ones only cost time.
  const auto count = static_cast<std::uint16_t>(in.u16() & 0x0fffu);
  const std::uint8_t raw_side = in.u8();
  const auto delta = static_cast<std::int8_t>(in.u8());

  const Q q = make_decoder<Q>(s0, s1);
  payload p;
  p.count = count;
  p.dense_size = count;
  p.layout = index_layout::dense;  // indices are the scatter's business, not the decoder's
  if (flags & 1u) {
    p.quantizer = Q::id;
    p.bits_per_value = static_cast<std::uint8_t>(q.bits_per_value());
    p.params = q.params();
  } else {
    p.quantizer = static_cast<quantizer_id>(raw_id);
    p.bits_per_value = raw_bits;
    p.params = detail::from_param_words(p.quantizer, word0, word1);
  }
  const std::size_t side_count =
      (flags & 2u) ? static_cast<std::size_t>(detail::layout_of(Q::id, q.params(), count).side_count)
                   : raw_side;
  p.side.assign(side_count, 1.0f);
  for (float& x : p.side) {
    if (in.left() < 4) break;
    const std::uint32_t u = in.u32();
    x = detail::bits_to_float(u);
  }
  if (flags & 4u) {
    p.values.assign(static_cast<std::size_t>(detail::packed_size(count, q.bits_per_value())),
                    std::byte{0});
    for (auto& b : p.values) {
      if (in.left() == 0) break;
      b = static_cast<std::byte>(in.u8());
    }
  } else {
    p.values.assign(reinterpret_cast<const std::byte*>(data) + in.at,
                    reinterpret_cast<const std::byte*>(data) + size);
  }
  const long out_size = (flags & 8u) ? static_cast<long>(count) : static_cast<long>(count) + delta;
  std::vector<float> out(static_cast<std::size_t>(out_size < 0 ? 0 : out_size), fuzz::sentinel);
  const std::vector<float> before = out;

  try {
    q.decode(p, out);
  } catch (const payload_error&) {
    require(fuzz::same_bytes<float>(out, before), "decode wrote before throwing payload_error");
    return 0;
  } catch (const gradcomp::invalid_argument&) {
    require(fuzz::same_bytes<float>(out, before), "decode wrote before throwing invalid_argument");
    return 0;
  } catch (...) {
    fuzz::fail("decode threw something other than payload_error or invalid_argument");
  }
  check_success(q, p, out);
  return 0;
}
