// gradcomp/sparse.hpp: the payload one worker sends for one tensor: the dense length n,
// which coordinates (uint32 indices, strictly increasing) and their values as the
// quantizer packed them, plus the quantizer's side data (norms, scales).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <gradcomp/error.hpp>

namespace gradcomp {

// Wire identifiers of the shipped quantizers. Values are part of the byte format: never
// renumber, only append.
enum class quantizer_id : std::uint8_t {
  identity = 1,     // fp32
  fp16 = 2,         // IEEE binary16
  bf16 = 3,         // bfloat16
  qsgd = 4,         // sign + level, norm per bucket
  terngrad = 5,     // {-1, 0, +1} * max|v|
  scaled_sign = 6,  // sign * mean|v|
};

// How the indices of a payload are given.
enum class index_layout : std::uint8_t {
  sparse = 0,  // explicit indices, strictly increasing, each < dense_size
  dense = 1,   // every coordinate 0..n-1 in order; no index array is stored
};

// The quantizer-specific settings a decoder needs and checks: QSGD's levels s and bucket
// size; TernGrad's and scaled sign's bucket size (levels 0); both 0 for the casts (identity,
// fp16, bf16). A bucket size of 0 means one bucket over all values.
struct quantizer_params {
  std::uint32_t levels = 0;
  std::uint32_t bucket_size = 0;
  friend bool operator==(const quantizer_params&, const quantizer_params&) = default;
};

// One coordinate with its decoded value: the unit that gTop-k and TopKA2A move between ranks
// (8 bytes, the unit of their cost models).
struct index_value {
  std::uint32_t index;
  float value;
  friend bool operator==(const index_value&, const index_value&) = default;
};
static_assert(sizeof(index_value) == 8);

struct payload {
  std::uint64_t dense_size = 0;  // n, the length of the dense tensor
  index_layout layout = index_layout::sparse;
  quantizer_id quantizer = quantizer_id::identity;
  std::uint8_t bits_per_value = 32;
  quantizer_params params{};
  std::uint32_t count = 0;              // number of coordinates carried
  std::vector<std::uint32_t> indices;   // `count` entries when layout == sparse, else empty
  std::vector<std::byte> values;        // exactly ceil(count * bits_per_value / 8) bytes
  std::vector<float> side;              // quantizer side data

  // Index of the i-th carried coordinate, whatever the layout.
  [[nodiscard]] std::uint32_t index(std::size_t i) const {
    return layout == index_layout::dense ? static_cast<std::uint32_t>(i) : indices[i];
  }

  // Bytes of packed values for `count` values of `bits` bits: exact, no padding beyond the
  // last byte.
  [[nodiscard]] static constexpr std::size_t packed_bytes(std::uint64_t count,
                                                          unsigned bits) noexcept {
    return static_cast<std::size_t>((count * bits + 7) / 8);
  }

  friend bool operator==(const payload&, const payload&) = default;

  void clear() noexcept {
    count = 0;
    indices.clear();
    values.clear();
    side.clear();
  }
};

namespace detail {

// The two parameter words of the byte formats (the wire header and the exchange header). Word 0
// is QSGD's levels or TernGrad's and scaled sign's bucket size, word 1 QSGD's bucket size (and
// must be 0 for the others); the casts have both 0. The map is its own inverse.
struct param_words {
  std::uint32_t word0 = 0;
  std::uint32_t word1 = 0;
};

constexpr bool bucket_first(quantizer_id id) noexcept {
  return id == quantizer_id::terngrad || id == quantizer_id::scaled_sign;
}

constexpr param_words to_param_words(quantizer_id id, quantizer_params p) noexcept {
  return bucket_first(id) ? param_words{p.bucket_size, p.levels} : param_words{p.levels, p.bucket_size};
}

constexpr quantizer_params from_param_words(quantizer_id id, std::uint32_t word0,
                                            std::uint32_t word1) noexcept {
  return bucket_first(id) ? quantizer_params{word1, word0} : quantizer_params{word0, word1};
}

// The one index rule of the format, for indices in a payload or still in wire bytes:
// every index < dense_size, strictly increasing (sorted, unique).
template <class IndexAt>
void check_indices(std::string_view where, std::uint64_t count, std::uint64_t dense_size,
                   IndexAt index_at) {
  std::uint64_t prev = 0;
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t x = index_at(i);
    if (x >= dense_size) {
      throw_payload_error(where, "indices[", i, "] = ", x, "; expected < dense_size (", dense_size,
                          ")");
    }
    if (i > 0 && x <= prev) {
      throw_payload_error(where, "indices[", i, "] = ", x, " after ", prev,
                          "; expected strictly increasing (sorted, unique)");
    }
    prev = x;
  }
}

}  // namespace detail

// Check that a payload's indices keep the format's promise before anything is scattered by
// them: layout consistent with count, every index < dense_size, strictly increasing.
inline void validate_indices(std::string_view where, const payload& p) {
  if (p.count > p.dense_size) {
    detail::throw_payload_error(where, "count ", p.count, " exceeds dense_size ", p.dense_size);
  }
  if (p.layout == index_layout::dense) {
    if (p.count != p.dense_size || !p.indices.empty()) {
      detail::throw_payload_error(where, "dense layout needs count == dense_size (", p.dense_size,
                                  ") and no index array; got count ", p.count, " and ",
                                  p.indices.size(), " indices");
    }
    return;
  }
  if (p.layout != index_layout::sparse) {
    detail::throw_payload_error(where, "unknown index layout ", static_cast<int>(p.layout));
  }
  if (p.indices.size() != p.count) {
    detail::throw_payload_error(where, "count ", p.count, " but ", p.indices.size(), " indices");
  }
  detail::check_indices(where, p.count, p.dense_size,
                        [&p](std::uint64_t i) { return p.indices[i]; });
}

}  // namespace gradcomp
