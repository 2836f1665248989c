// gradcomp/detail/quantizer_layout.hpp: the one table of what each quantizer id puts in a
// payload (bits per value, side-data count, valid parameters), read by the quantizers and the
// wire decoder alike so that they cannot disagree, plus the checks every decode runs first.
//
//   id             quantizer_params {levels, bucket_size}  bits           side entries
//   identity  1    {0, 0}                                  32             0
//   fp16      2    {0, 0}                                  16             0
//   bf16      3    {0, 0}                                  16             0
//   qsgd      4    {s in 1..2^15-1, 1..2^24}               bit_width(2s)  one norm per bucket
//   terngrad  5    {0, bucket size; 0 = one bucket}        2              one max|v| per bucket
//   scaled_sign 6  {0, bucket size; 0 = one bucket}        1              one mean|v| per bucket
//
// On the wire the two are the parameter words of detail::to_param_words (sparse.hpp).
//
// Buckets are consecutive runs of `bucket size` values (the last may be shorter); an empty
// payload has no buckets. Side values are finite and >= 0.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/detail/host_simd.hpp>
#include <gradcomp/detail/quantize_math.hpp>  // bucket statistics (sum_of_squares, ...)
#include <gradcomp/error.hpp>
#include <gradcomp/sparse.hpp>

// For the once-per-bucket statistics: kept out of line, the per-element lambda that calls them
// stays small enough to be inlined into the packing loop (about 1.3x on QSGD encode).
#if defined(__GNUC__) || defined(__clang__)
#define GRADCOMP_DETAIL_NOINLINE __attribute__((noinline))
#elif defined(_MSC_VER)
#define GRADCOMP_DETAIL_NOINLINE __declspec(noinline)
#else
#define GRADCOMP_DETAIL_NOINLINE
#endif

namespace gradcomp::detail {

inline constexpr std::uint32_t qsgd_max_levels = (1u << 15) - 1u;
inline constexpr std::uint32_t qsgd_max_bucket = 1u << 24;

constexpr bool is_known_quantizer(std::uint8_t raw) noexcept { return raw >= 1u && raw <= 6u; }

constexpr std::string_view quantizer_name(quantizer_id id) noexcept {
  switch (id) {
    case quantizer_id::identity: return "identity";
    case quantizer_id::fp16: return "fp16";
    case quantizer_id::bf16: return "bf16";
    case quantizer_id::qsgd: return "qsgd";
    case quantizer_id::terngrad: return "terngrad";
    case quantizer_id::scaled_sign: return "scaled_sign";
  }
  return "unknown";
}

// Codes 0..2s carry sign and level jointly.
constexpr unsigned qsgd_bits(std::uint32_t levels) noexcept {
  return static_cast<unsigned>(std::bit_width(2u * levels));
}

constexpr std::uint64_t bucket_count(std::uint64_t count, std::uint32_t bucket_size) noexcept {
  if (count == 0) return 0;
  if (bucket_size == 0) return 1;
  return (count + bucket_size - 1u) / bucket_size;
}

// Empty when (id, params) is valid; otherwise which field is wrong and what is allowed.
inline std::string params_problem(quantizer_id id, quantizer_params p) {
  switch (id) {
    case quantizer_id::identity:
    case quantizer_id::fp16:
    case quantizer_id::bf16:
      if (p.levels != 0 || p.bucket_size != 0) {
        return concat("levels = ", p.levels, ", bucket size = ", p.bucket_size,
                      "; expected 0 and 0 for ", quantizer_name(id));
      }
      return {};
    case quantizer_id::qsgd:
      if (p.levels < 1u || p.levels > qsgd_max_levels) {
        return concat("levels (qsgd) = ", p.levels, "; expected 1..", qsgd_max_levels);
      }
      if (p.bucket_size < 1u || p.bucket_size > qsgd_max_bucket) {
        return concat("bucket size (qsgd) = ", p.bucket_size, "; expected 1..", qsgd_max_bucket);
      }
      return {};
    case quantizer_id::terngrad:
    case quantizer_id::scaled_sign:
      if (p.levels != 0) return concat("levels = ", p.levels, "; expected 0 for ", quantizer_name(id));
      return {};
  }
  return concat("quantizer id = ", static_cast<unsigned>(id), "; expected 1..6");
}

constexpr bool params_valid(quantizer_id id, quantizer_params p) noexcept {
  switch (id) {
    case quantizer_id::identity:
    case quantizer_id::fp16:
    case quantizer_id::bf16: return p.levels == 0 && p.bucket_size == 0;
    case quantizer_id::qsgd:
      return p.levels >= 1u && p.levels <= qsgd_max_levels && p.bucket_size >= 1u &&
             p.bucket_size <= qsgd_max_bucket;
    case quantizer_id::terngrad:
    case quantizer_id::scaled_sign: return p.levels == 0;
  }
  return false;
}

struct value_layout {
  unsigned bits_per_value = 0;
  std::uint64_t side_count = 0;
};

// What `count` values quantized by (id, params) occupy. Precondition: params_valid(id, params).
constexpr value_layout layout_of(quantizer_id id, quantizer_params p,
                                 std::uint64_t count) noexcept {
  switch (id) {
    case quantizer_id::identity: return {32, 0};
    case quantizer_id::fp16:
    case quantizer_id::bf16: return {16, 0};
    case quantizer_id::qsgd: return {qsgd_bits(p.levels), bucket_count(count, p.bucket_size)};
    case quantizer_id::terngrad: return {2, bucket_count(count, p.bucket_size)};
    case quantizer_id::scaled_sign: return {1, bucket_count(count, p.bucket_size)};
  }
  return {0, 0};
}

// The decoder's form: throws payload_error naming the bad field.
inline value_layout checked_layout(std::string_view where, quantizer_id id, quantizer_params p,
                                   std::uint64_t count) {
  if (!params_valid(id, p)) throw_payload_error(where, params_problem(id, p));
  return layout_of(id, p, count);
}

inline void check_side_values(std::string_view where, std::span<const float> side) {
  for (std::size_t b = 0; b < side.size(); ++b) {
    if (!(std::isfinite(side[b]) && side[b] >= 0.0f)) {
      throw_payload_error(where, "side[", b, "] = ", side[b], "; expected finite and >= 0");
    }
  }
}

// Sets what encode owns in `out` and sizes values and side, reusing their capacity.
inline void begin_encode(std::string_view where, payload& out, std::size_t n, quantizer_id id,
                         unsigned bits, quantizer_params params) {
  if (out.count != n) {
    throw_invalid_argument(where, "values.size()", n,
                           concat("== payload count (", out.count, ") set by the caller"));
  }
  out.quantizer = id;
  out.bits_per_value = static_cast<std::uint8_t>(bits);
  out.params = params;
  out.values.resize(static_cast<std::size_t>(packed_size(n, bits)));
  out.side.resize(static_cast<std::size_t>(layout_of(id, params, n).side_count));
}

// Everything a quantizer's decode checks before it writes a single value: the output size,
// that the payload was made by this quantizer with these settings, exact sizes, side values,
// and zero padding bits (so every payload has one byte form). Codes are checked by the
// quantizers that have invalid codes.
inline void check_decode(std::string_view where, const payload& in, std::size_t decoded_size,
                         quantizer_id id, unsigned bits, quantizer_params params) {
  if (decoded_size != in.count) {
    throw_invalid_argument(where, "decoded.size()", decoded_size,
                           concat("== payload count (", in.count, ")"));
  }
  if (in.quantizer != id) {
    throw_payload_error(where, "quantizer = ", static_cast<unsigned>(in.quantizer), " (",
                        quantizer_name(in.quantizer), "); expected ", static_cast<unsigned>(id),
                        " (", quantizer_name(id), ")");
  }
  if (in.bits_per_value != bits) {
    throw_payload_error(where, "bits_per_value = ", static_cast<unsigned>(in.bits_per_value),
                        "; expected ", bits);
  }
  if (in.params != params) {
    throw_payload_error(where, "levels = ", in.params.levels, ", bucket size = ",
                        in.params.bucket_size, "; expected ", params.levels, " and ",
                        params.bucket_size);
  }
  const std::uint64_t need = packed_size(in.count, bits);
  if (in.values.size() != need) {
    throw_payload_error(where, "values has ", in.values.size(), " bytes; expected ", need, " for ",
                        in.count, " values of ", bits, " bits");
  }
  const std::uint64_t side_need = layout_of(id, params, in.count).side_count;
  if (in.side.size() != side_need) {
    throw_payload_error(where, "side has ", in.side.size(), " entries; expected ", side_need);
  }
  check_side_values(where, in.side);
  const unsigned used = static_cast<unsigned>((static_cast<std::uint64_t>(in.count) * bits) % 8u);
  if (used != 0u && (static_cast<unsigned>(in.values.back()) >> used) != 0u) {
    throw_payload_error(where, "padding bits of the last value byte are not zero");
  }
}

// Largest code in a packed stream (0 when empty), to reject invalid codes before decoding.
inline std::uint32_t max_code(const payload& in) {
#if GRADCOMP_VECTOR_EXTENSIONS
  std::uint32_t best = 0;
  if (max_code_vector(in.values.data(), in.count, in.bits_per_value, best)) return best;
#endif
  std::uint32_t m = 0;
  unpack_codes_with(in.values.data(), in.count, in.bits_per_value,
                    [&m](std::size_t, std::uint32_t c) { m = c > m ? c : m; });
  return m;
}

// Position and value of the first code above `limit`, for the error message.
[[noreturn]] inline void throw_invalid_code(std::string_view where, const payload& in,
                                            std::uint32_t limit, std::string_view why) {
  std::size_t at = 0;
  std::uint32_t code = 0;
  for (std::size_t i = 0; i < in.count; ++i) {
    code = code_at(in.values.data(), i, in.bits_per_value);
    if (code > limit) {
      at = i;
      break;
    }
  }
  throw_payload_error(where, "code ", code, " at value ", at, "; expected <= ", limit, " (", why,
                      ")");
}

}  // namespace gradcomp::detail
