// Bit packing: every width 1..32 round trips through every entry point, takes exactly
// ceil(count*bits/8) bytes, lays codes out LSB first, and never writes past its bytes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include <gradcomp/detail/bitpack.hpp>
#include <gradcomp/error.hpp>

namespace gd = gradcomp::detail;

namespace {

std::vector<std::size_t> test_counts(std::mt19937_64& rng) {
  return {0, 1, 7, 8, 9, 63, 64, 65, 1000, static_cast<std::size_t>(rng() % 5000)};
}

std::vector<std::uint32_t> random_codes(std::mt19937_64& rng, std::size_t n, unsigned bits) {
  std::vector<std::uint32_t> c(n);
  for (auto& x : c) x = static_cast<std::uint32_t>(rng()) & gd::code_mask(bits);
  return c;
}

// Reference layout: bit k of the stream is bit k%8 of byte k/8, code i at bit i*bits.
std::vector<std::byte> reference_pack(const std::vector<std::uint32_t>& codes, unsigned bits) {
  std::vector<std::byte> out(gd::packed_size(codes.size(), bits), std::byte{0});
  for (std::size_t i = 0; i < codes.size(); ++i) {
    for (unsigned b = 0; b < bits; ++b) {
      if ((codes[i] >> b) & 1u) {
        const std::size_t k = i * bits + b;
        out[k / 8] |= static_cast<std::byte>(1u << (k % 8));
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("bitpack: every width round trips with the exact byte count and layout") {
  std::mt19937_64 rng(42);
  for (unsigned bits = 1; bits <= 32; ++bits) {
    for (const std::size_t n : test_counts(rng)) {
      CAPTURE(bits);
      CAPTURE(n);
      const auto codes = random_codes(rng, n, bits);
      const std::size_t bytes = gd::packed_size(n, bits);
      REQUIRE(bytes == (n * bits + 7) / 8);
      // A heap block of exactly `bytes` bytes: ASan reports any write or read past it.
      auto buf = std::make_unique<std::byte[]>(bytes);
      std::span<std::byte> packed(buf.get(), bytes);
      for (auto& b : packed) b = std::byte{0xa5};  // garbage: packing must overwrite all of it
      gd::pack_codes(codes, bits, packed);
      REQUIRE(std::vector<std::byte>(packed.begin(), packed.end()) == reference_pack(codes, bits));

      std::vector<std::uint32_t> back(n, 0xdeadbeefu);
      gd::unpack_codes(packed, bits, back);
      REQUIRE(back == codes);
      for (std::size_t i = 0; i < n; ++i) REQUIRE(gd::code_at(buf.get(), i, bits) == codes[i]);

      // Per-element writer, in random order over a zeroed buffer.
      auto buf2 = std::make_unique<std::byte[]>(bytes);
      std::vector<std::size_t> order(n);
      for (std::size_t i = 0; i < n; ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), rng);
      for (std::size_t i = 0; i < bytes; ++i) buf2[i] = std::byte{0};
      for (const std::size_t i : order) gd::store_code(buf2.get(), i, bits, ~0u);  // then overwrite
      for (const std::size_t i : order) gd::store_code(buf2.get(), i, bits, codes[i]);
      for (std::size_t i = 0; i < n; ++i) REQUIRE(gd::code_at(buf2.get(), i, bits) == codes[i]);

      // Group writer, groups in reverse order: each writes only its own bytes.
      auto buf3 = std::make_unique<std::byte[]>(bytes);
      for (std::size_t i = 0; i < bytes; ++i) buf3[i] = std::byte{0x5a};
      const std::size_t g = gd::codes_per_group(bits);
      REQUIRE((g * bits) % 8 == 0);
      const std::size_t groups = (n + g - 1) / g;
      for (std::size_t k = groups; k-- > 0;) {
        gd::pack_group(buf3.get(), n, bits, k, [&](std::size_t i) { return codes[i]; });
      }
      REQUIRE(std::equal(buf3.get(), buf3.get() + bytes, packed.begin()));
    }
  }
}

TEST_CASE("bitpack: codes wider than `bits` are masked, padding bits stay zero") {
  std::mt19937_64 rng(3);
  for (unsigned bits = 1; bits < 32; ++bits) {
    const std::size_t n = 1 + rng() % 100;
    std::vector<std::uint32_t> codes(n);
    for (auto& c : codes) c = static_cast<std::uint32_t>(rng()) | 0x80000000u;
    std::vector<std::byte> packed(gd::packed_size(n, bits));
    gd::pack_codes(codes, bits, packed);
    std::vector<std::uint32_t> back(n);
    gd::unpack_codes(packed, bits, back);
    for (std::size_t i = 0; i < n; ++i) REQUIRE(back[i] == (codes[i] & gd::code_mask(bits)));
    const unsigned used = static_cast<unsigned>((n * bits) % 8);
    if (used != 0) CHECK((static_cast<unsigned>(packed.back()) >> used) == 0u);
  }
}

TEST_CASE("bitpack: callbacks run once per code in increasing order") {
  for (const unsigned bits : {1u, 2u, 3u, 4u, 8u, 13u, 16u, 32u}) {
    std::vector<std::byte> packed(gd::packed_size(777, bits));
    std::size_t next = 0;
    gd::pack_codes_with(packed.data(), 777, bits, [&](std::size_t i) {
      REQUIRE(i == next++);
      return static_cast<std::uint32_t>(i);
    });
    CHECK(next == 777);
    next = 0;
    gd::unpack_codes_with(packed.data(), 777, bits, [&](std::size_t i, std::uint32_t c) {
      REQUIRE(i == next++);
      REQUIRE(c == (static_cast<std::uint32_t>(i) & gd::code_mask(bits)));
    });
    CHECK(next == 777);
  }
}

TEST_CASE("bitpack: argument checks") {
  std::vector<std::uint32_t> codes(10);
  std::vector<std::byte> bytes(10);
  CHECK_THROWS_AS(gd::pack_codes(codes, 0, bytes), gradcomp::invalid_argument);
  CHECK_THROWS_AS(gd::pack_codes(codes, 33, bytes), gradcomp::invalid_argument);
  CHECK_THROWS_AS(gd::pack_codes(codes, 7, bytes), gradcomp::invalid_argument);    // needs 9
  CHECK_THROWS_AS(gd::unpack_codes(bytes, 9, codes), gradcomp::invalid_argument);  // needs 12
  CHECK_NOTHROW(gd::pack_codes(codes, 8, bytes));
  CHECK(gd::codes_per_group(1) == 8);
  CHECK(gd::codes_per_group(2) == 4);
  CHECK(gd::codes_per_group(12) == 2);
  CHECK(gd::codes_per_group(24) == 1);
}
