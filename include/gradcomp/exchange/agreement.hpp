// gradcomp/exchange/agreement.hpp: the small fixed-size header that ranks allgather before a
// collective whose sizes must agree. A rank with another tensor size, payload format version,
// quantizer or exchange then makes every rank throw the same communicator_error, naming the
// ranks and their values, instead of hanging in the collective or mixing up data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/comm_common.hpp>
#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/sparse.hpp>
#include <gradcomp/wire.hpp>

namespace gradcomp {

// Which algorithm sent a header: ranks running different exchanges for the same tensor are
// caught too. Values are part of the header format: never renumber, only append.
enum class exchange_id : std::uint8_t {
  dense_allreduce = 1,
  sparse_allgather = 2,
  gtopk = 3,
  topk_a2a = 4,
  automatic = 5,
};

// What one rank says about the payload it is about to exchange.
struct exchange_header {
  std::uint16_t format_version = wire_version;  // of the payload format this build speaks
  exchange_id algorithm = exchange_id::dense_allreduce;
  index_layout layout = index_layout::sparse;
  quantizer_id quantizer = quantizer_id::identity;
  std::uint8_t bits_per_value = 0;
  std::uint8_t value_size = 0;  // sizeof the output element (float or double)
  std::uint64_t dense_size = 0;
  std::uint32_t count = 0;
  quantizer_params params{};
  std::uint64_t hash = 0;  // FNV-1a of the indices (or of fused tensor sizes), when asked for
  std::uint8_t failed = 0;  // 1: this rank's own arguments or payload were bad

  friend bool operator==(const exchange_header&, const exchange_header&) = default;
};

// Fields that must be equal on every rank, or-ed together. The format version, the exchange
// and the output element size are always checked.
namespace agree {
inline constexpr unsigned dense_size = 1u;
inline constexpr unsigned quantizer = 2u;  // id, params, bits per value and index layout
inline constexpr unsigned count = 4u;
inline constexpr unsigned indices = 8u;  // the index arrays (by hash)
inline constexpr unsigned tensor_sizes = 16u;  // the sizes of fused tensors (by hash)
}  // namespace agree

inline constexpr std::size_t exchange_header_bytes = 48;

namespace detail {

inline constexpr std::byte header_magic[4] = {std::byte{'G'}, std::byte{'C'}, std::byte{'X'},
                                              std::byte{'H'}};

template <class Int>
std::uint64_t fnv1a(std::span<const Int> values) noexcept {
  std::uint64_t h = 14695981039346656037ull;
  for (const Int v : values) {
    const auto x = static_cast<std::uint64_t>(v);
    for (unsigned b = 0; b < sizeof(Int); ++b) {
      h ^= (x >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return h;
}

inline void write_header(const exchange_header& h, std::byte* out) noexcept {
  std::memcpy(out, header_magic, 4);
  store_le16(out + 4, h.format_version);
  out[6] = static_cast<std::byte>(h.algorithm);
  out[7] = static_cast<std::byte>(h.layout);
  out[8] = static_cast<std::byte>(h.quantizer);
  out[9] = static_cast<std::byte>(h.bits_per_value);
  out[10] = static_cast<std::byte>(h.value_size);
  out[11] = static_cast<std::byte>(h.failed);
  std::memset(out + 12, 0, 4);
  store_le64(out + 16, h.dense_size);
  store_le32(out + 24, h.count);
  const param_words words = to_param_words(h.quantizer, h.params);
  store_le32(out + 28, words.word0);
  store_le32(out + 32, words.word1);
  std::memset(out + 36, 0, 4);
  store_le64(out + 40, h.hash);
}

inline exchange_header read_header(const std::byte* in) noexcept {
  exchange_header h;
  h.format_version = load_le16(in + 4);
  h.algorithm = static_cast<exchange_id>(in[6]);
  h.layout = static_cast<index_layout>(in[7]);
  h.quantizer = static_cast<quantizer_id>(in[8]);
  h.bits_per_value = static_cast<std::uint8_t>(in[9]);
  h.value_size = static_cast<std::uint8_t>(in[10]);
  h.failed = static_cast<std::uint8_t>(in[11]);
  h.dense_size = load_le64(in + 16);
  h.count = load_le32(in + 24);
  h.params = from_param_words(h.quantizer, load_le32(in + 28), load_le32(in + 32));
  h.hash = load_le64(in + 40);
  return h;
}

// "rank 1 has 100, rank 3 has 100, rank 0 has 120": the ranks that differ from rank 0 (at
// most 8 named) and rank 0.
template <class Field>
std::string disagreement(const std::vector<exchange_header>& all, Field field) {
  std::string s;
  int named = 0, more = 0;
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (field(all[r]) == field(all[0])) continue;
    if (named == 8) {
      ++more;
      continue;
    }
    s += concat("rank ", r, " has ", field(all[r]), ", ");
    ++named;
  }
  if (more) s += concat("(", more, " more ranks differ), ");
  return s + concat("rank 0 has ", field(all[0]));
}

}  // namespace detail

// The header of payload p for exchange `x` with output elements of `value_size` bytes.
// with_index_hash costs one pass over the indices; it is what lets shared-index exchanges
// (dense_allreduce of Random-k) notice ranks that drew different indices.
inline exchange_header header_of(const payload& p, exchange_id x, std::size_t value_size,
                                 bool with_index_hash = false) {
  exchange_header h;
  h.algorithm = x;
  h.layout = p.layout;
  h.quantizer = p.quantizer;
  h.bits_per_value = p.bits_per_value;
  h.value_size = static_cast<std::uint8_t>(value_size);
  h.dense_size = p.dense_size;
  h.count = p.count;
  h.params = p.params;
  if (with_index_hash && p.layout == index_layout::sparse) {
    h.hash = detail::fnv1a(std::span<const std::uint32_t>(p.indices));
  }
  return h;
}

// A rank's own checks before agree_on_header: their error message (empty when they passed)
// and whether it was a malformed payload (payload_error) rather than a bad argument.
struct local_check {
  std::string error;
  bool is_payload = false;
};

// Runs a rank's own checks, catching their invalid_argument or payload_error, so that the rank
// still joins agree_on_header (which rethrows it there) instead of leaving the others waiting.
template <class Checks>
local_check check_locally(Checks&& checks) {
  try {
    std::forward<Checks>(checks)();
  } catch (const invalid_argument& e) {
    return {e.what(), false};
  } catch (const payload_error& e) {
    return {e.what(), true};
  }
  return {};
}

// Allgathers every rank's header (exchange_header_bytes each, in rank order) and checks that
// the fields named by `must_agree` are equal everywhere. Every rank sees the same headers, so
// on a disagreement every rank throws the same communicator_error, e.g.
//   "gradcomp::dense_allreduce: ranks disagree on the tensor's dense_size: rank 1 has 100,
//    rank 0 has 120 (every rank must exchange the same tensor, in the same order, ...)".
// A rank whose own arguments are bad passes their error as `local_error`: it still takes part,
// then throws invalid_argument (or payload_error, as `local_is_payload` says) while the others
// throw communicator_error naming it, so that no rank is left waiting in the next collective.
// Returns the headers, which carry every rank's count. `scratch` is reused between calls.
template <communicator Comm>
std::vector<exchange_header> agree_on_header(Comm& comm, std::string_view where,
                                             exchange_header mine, unsigned must_agree,
                                             std::vector<std::byte>& scratch,
                                             std::string_view local_error = {},
                                             bool local_is_payload = false) {
  mine.failed = local_error.empty() ? 0 : 1;
  std::byte bytes[exchange_header_bytes];
  detail::write_header(mine, bytes);
  std::vector<std::size_t> counts;
  // A header is exchange_header_bytes long: a peer that announces more is refused before
  // anything is sized by it.
  detail::allgatherv_within(comm, std::span<const std::byte>(bytes), scratch, counts,
                            receive_limit{exchange_header_bytes}, where);

  // A rank that runs some other collective here sends something else; say so rather than
  // parse it.
  std::vector<exchange_header> all(counts.size());
  std::size_t offset = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    const std::byte* b = scratch.data() + offset;
    if (counts[r] != exchange_header_bytes || std::memcmp(b, detail::header_magic, 4) != 0) {
      throw communicator_error(detail::concat(
          "gradcomp::", where, ": rank ", r, " sent ", counts[r],
          " bytes that are not an exchange header (", exchange_header_bytes,
          " bytes starting \"GCXH\"): the ranks are not running the same exchange or "
          "collective, or run different gradcomp versions"));
    }
    all[r] = detail::read_header(b);
    offset += counts[r];
  }

  if (!local_error.empty()) {
    if (local_is_payload) throw payload_error(std::string(local_error));
    throw invalid_argument(std::string(local_error));
  }
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].failed) {
      throw communicator_error(detail::concat("gradcomp::", where, ": rank ", r,
                                              " passed bad arguments or a malformed payload "
                                              "(its own exception says which); no rank exchanged"));
    }
  }
  // A payload has at most one entry per element of its tensor (fused tensors: of all of them):
  // a count beyond that is a peer that lies, refused before any exchange sizes a buffer by it
  // (gtopk's k is the largest count any rank announces).
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].count > all[r].dense_size) {
      throw communicator_error(detail::concat(
          "gradcomp::", where, ": rank ", r, " announced a payload of ", all[r].count,
          " entries for a tensor of ", all[r].dense_size,
          " elements; allowed: count <= dense_size. No rank exchanged"));
    }
  }

  auto fail = [&](std::string_view what, std::string detail_text) {
    throw communicator_error(detail::concat(
        "gradcomp::", where, ": ranks disagree on ", what, ": ", detail_text,
        " (every rank must exchange the same tensor, in the same order, with the same "
        "policies)"));
  };
  auto differs = [&](auto field) {
    for (const auto& h : all) {
      if (!(field(h) == field(all[0]))) return true;
    }
    return false;
  };
  auto check = [&](std::string_view what, auto field) {
    if (differs(field)) fail(what, detail::disagreement(all, field));
  };
  check("the payload format version", [](const exchange_header& h) { return h.format_version; });
  check("the exchange (1 dense_allreduce, 2 sparse_allgather, 3 gtopk, 4 topk_a2a, 5 auto)",
        [](const exchange_header& h) { return static_cast<unsigned>(h.algorithm); });
  check("the size of an output element in bytes",
        [](const exchange_header& h) { return static_cast<unsigned>(h.value_size); });
  if (must_agree & agree::dense_size) {
    check("the tensor's dense_size", [](const exchange_header& h) { return h.dense_size; });
  }
  if (must_agree & agree::quantizer) {
    check("the quantizer id", [](const exchange_header& h) { return static_cast<unsigned>(h.quantizer); });
    check("the quantizer's levels", [](const exchange_header& h) { return h.params.levels; });
    check("the quantizer's bucket size", [](const exchange_header& h) { return h.params.bucket_size; });
    check("the bits per value", [](const exchange_header& h) { return static_cast<unsigned>(h.bits_per_value); });
    check("the index layout (0 sparse, 1 dense)",
          [](const exchange_header& h) { return static_cast<unsigned>(h.layout); });
  }
  if (must_agree & agree::count) {
    check("the payload's count", [](const exchange_header& h) { return h.count; });
  }
  if (must_agree & agree::indices) {
    check("the selected indices (FNV-1a hash; a shared-index selector such as randomk needs "
          "the same seed on every rank)",
          [](const exchange_header& h) { return h.hash; });
  }
  if (must_agree & agree::tensor_sizes) {
    check("the sizes of the fused tensors (FNV-1a hash)",
          [](const exchange_header& h) { return h.hash; });
  }
  return all;
}

}  // namespace gradcomp
