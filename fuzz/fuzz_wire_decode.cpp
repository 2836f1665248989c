// libFuzzer target: bytes from the network through the wire decoder. The input is a stream of
// payloads; properties checked:
// - decode_wire (both forms) throws nothing but payload_error, and leaves `out` unchanged
//   when it throws;
// - the exact form succeeds exactly when the first payload fills the input, and agrees with
//   the prefix form;
// - a decoded payload passes validate_payload, and re-encodes to the very bytes it came from;
// - decompressing it into a buffer of exactly dense_size (through a compressor of the
//   quantizer it names) either succeeds, writing the decoded values at its indices and zero
//   elsewhere, or throws payload_error and writes nothing. ASan checks every write.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "fuzz_common.hpp"

namespace {

using namespace gradcomp;
using fuzz::require;

// Larger tensors cost time without reaching new code.
constexpr std::uint64_t max_decompress_size = 1u << 16;

template <class Q>
void check_decompress(const payload& p, const Q& q) {
  const compressor<fuzz::no_selection, Q, no_feedback> c(fuzz::no_selection{}, q);
  const auto n = static_cast<std::size_t>(p.dense_size);
  std::vector<float> decoded(p.count, fuzz::sentinel);
  bool decodes = true;
  try {
    c.decode_values(p, decoded);
  } catch (const payload_error&) {
    decodes = false;
    require(fuzz::same_bytes<float>(decoded, std::vector<float>(p.count, fuzz::sentinel)),
            "decode_values wrote before throwing");
  }

  for (const decompress_mode mode : {decompress_mode::overwrite, decompress_mode::accumulate}) {
    std::vector<float> dense(n, fuzz::sentinel);
    const std::vector<float> before = dense;
    try {
      c.decompress(p, dense, mode);
    } catch (const payload_error&) {
      require(!decodes, "decompress refused a payload that decode_values accepted");
      require(fuzz::same_bytes<float>(dense, before), "decompress wrote before throwing");
      continue;
    }
    require(decodes, "decompress accepted a payload that decode_values refused");
    // Expected: decoded values at the payload's indices, zero (or the old value) elsewhere.
    std::vector<float> want(n, mode == decompress_mode::overwrite ? 0.0f : fuzz::sentinel);
    for (std::size_t j = 0; j < p.count; ++j) want[p.index(j)] += decoded[j];
    require(fuzz::same_bytes<float>(dense, want), "decompress wrote other values than decoded");
  }
}

void check_decoded(const payload& p, std::span<const std::byte> encoding) {
  try {
    validate_payload(p);
  } catch (const payload_error&) {
    fuzz::fail("decode_wire returned a payload that validate_payload refuses");
  }
  require(wire_size(p) == encoding.size(), "wire_size differs from the bytes consumed");
  std::vector<std::byte> again;
  encode_wire(p, again);
  require(again.size() == encoding.size() &&
              std::equal(again.begin(), again.end(), encoding.begin()),
          "re-encoding differs from the decoded bytes");
  if (p.dense_size <= max_decompress_size) {
    fuzz::with_quantizer(p.quantizer, p.params, [&](const auto& q) { check_decompress(p, q); });
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);

  std::optional<payload> exact;
  try {
    exact = decode_wire(bytes);
  } catch (const payload_error&) {
  }

  // A payload that already holds something, to see that a failed decode keeps it.
  payload p;
  p.dense_size = 3;
  p.count = 1;
  p.indices = {2};
  p.values = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  std::size_t offset = 0;
  for (int k = 0; k < 16 && offset < size; ++k) {
    const payload before = p;
    std::size_t used = 0;
    try {
      used = decode_wire(bytes.subspan(offset), p);
    } catch (const payload_error&) {
      require(p == before, "decode_wire changed its output before throwing");
      require(k != 0 || !exact, "the exact form decoded what the prefix form refused");
      break;
    }
    require(used >= wire_header_bytes && used <= size - offset, "decode_wire consumed a bad length");
    if (k == 0) {
      require(exact.has_value() == (used == size), "exact and prefix forms disagree on the length");
      require(!exact || *exact == p, "exact and prefix forms decoded different payloads");
    }
    check_decoded(p, bytes.subspan(offset, used));
    offset += used;
  }
  return 0;
}
