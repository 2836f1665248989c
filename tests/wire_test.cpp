// Wire format: round trips for every quantizer and both layouts (empty ones included), the
// documented byte layout, concatenated streams, rejection of every malformed header and body
// with the strong guarantee, and a mutation loop: a decoder fed corrupted bytes either
// returns a self-consistent payload or throws payload_error.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include <gradcomp/quantize.hpp>
#include <gradcomp/wire.hpp>

namespace gq = gradcomp;

namespace {

using bytes_t = std::vector<std::byte>;

bool same_payload(const gq::payload& a, const gq::payload& b) {
  return a.dense_size == b.dense_size && a.layout == b.layout && a.quantizer == b.quantizer &&
         a.bits_per_value == b.bits_per_value && a.params == b.params && a.count == b.count &&
         a.indices == b.indices && a.values == b.values && a.side.size() == b.side.size() &&
         (a.side.empty() || std::memcmp(a.side.data(), b.side.data(), 4 * a.side.size()) == 0);
}

using encoder = std::function<void(std::span<const float>, const gq::call_id&, gq::payload&)>;

template <class Q>
encoder enc(Q q) {
  return
      [q](std::span<const float> v, const gq::call_id& id, gq::payload& p) { q.encode(v, id, p); };
}

std::vector<encoder> all_encoders() {
  return {enc(gq::identity{}),    enc(gq::fp16{}),      enc(gq::bf16{}),
          enc(gq::qsgd{}),        enc(gq::qsgd(1, 3)),  enc(gq::qsgd::with_bits(8, 100)),
          enc(gq::terngrad{}),    enc(gq::terngrad(5)), enc(gq::scaled_sign{}),
          enc(gq::scaled_sign(7))};
}

// A valid payload: n coordinates, `count` of them (all for the dense layout), quantized.
gq::payload make_payload(std::mt19937_64& rng, const encoder& e, gq::index_layout layout,
                         std::uint64_t n, std::size_t count) {
  gq::payload p;
  p.dense_size = n;
  p.layout = layout;
  if (layout == gq::index_layout::dense) {
    count = static_cast<std::size_t>(n);
  } else {
    // count distinct sorted indices out of n (n small in these tests or count small).
    std::vector<std::uint32_t> idx;
    while (idx.size() < count) {
      for (std::size_t k = idx.size(); k < count; ++k)
        idx.push_back(static_cast<std::uint32_t>(rng() % n));
      std::sort(idx.begin(), idx.end());
      idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
    }
    p.indices = idx;
  }
  p.count = static_cast<std::uint32_t>(count);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> v(count);
  for (auto& x : v) x = nd(rng);
  e(v, gq::call_id{rng(), rng(), 0}, p);
  return p;
}

std::vector<gq::payload> sample_payloads(std::mt19937_64& rng) {
  std::vector<gq::payload> out;
  for (const auto& e : all_encoders()) {
    for (const auto layout : {gq::index_layout::sparse, gq::index_layout::dense}) {
      out.push_back(make_payload(rng, e, layout, 0, 0));  // dense_size 0
      out.push_back(make_payload(rng, e, layout, 1, 1));
      out.push_back(make_payload(rng, e, layout, 17, 5));
      out.push_back(make_payload(rng, e, layout, 1000, 513));
    }
    out.push_back(make_payload(rng, e, gq::index_layout::sparse, 50, 0));  // count 0 of 50
    out.push_back(make_payload(rng, e, gq::index_layout::sparse, std::uint64_t{1} << 32, 3));
  }
  return out;
}

bytes_t encode(const gq::payload& p) {
  bytes_t b;
  gq::encode_wire(p, b);
  return b;
}

void put_u32(bytes_t& b, std::size_t at, std::uint32_t v) {
  for (int k = 0; k < 4; ++k) b[at + k] = static_cast<std::byte>(v >> (8 * k));
}
void put_u64(bytes_t& b, std::size_t at, std::uint64_t v) {
  for (int k = 0; k < 8; ++k) b[at + k] = static_cast<std::byte>(v >> (8 * k));
}
std::uint64_t get(const bytes_t& b, std::size_t at, int n) {
  std::uint64_t v = 0;
  for (int k = 0; k < n; ++k) v |= static_cast<std::uint64_t>(b[at + k]) << (8 * k);
  return v;
}

// Both decode forms must throw payload_error; the prefix form must leave `out` as it was.
void require_rejected(const bytes_t& b) {
  REQUIRE_THROWS_AS(gq::decode_wire(std::span<const std::byte>(b)), gq::payload_error);
  std::mt19937_64 rng(b.size());
  gq::payload out = make_payload(rng, enc(gq::qsgd{}), gq::index_layout::sparse, 100, 20);
  const gq::payload before = out;
  REQUIRE_THROWS_AS(gq::decode_wire(std::span<const std::byte>(b), out), gq::payload_error);
  REQUIRE(same_payload(out, before));
}

}  // namespace

TEST_CASE("wire: random payloads of every quantizer and layout round trip") {
  std::mt19937_64 rng(1);
  for (const auto& p : sample_payloads(rng)) {
    CAPTURE(static_cast<int>(p.quantizer));
    CAPTURE(p.count);
    const bytes_t b = encode(p);
    REQUIRE(b.size() == gq::wire_size(p));
    REQUIRE(b.size() == 40 + (p.layout == gq::index_layout::sparse ? 4 * p.count : 0) +
                            4 * p.side.size() + p.values.size());
    REQUIRE(same_payload(gq::decode_wire(b), p));
    // The span form writes the same bytes, and refuses a buffer one byte short.
    bytes_t c(b.size() + 3, std::byte{0x77});
    REQUIRE(gq::encode_wire(p, std::span<std::byte>(c)) == b.size());
    REQUIRE(std::equal(b.begin(), b.end(), c.begin()));
    REQUIRE(c.back() == std::byte{0x77});
    bytes_t small(b.size() - 1);
    REQUIRE_THROWS_AS(gq::encode_wire(p, std::span<std::byte>(small)), gq::invalid_argument);
    // Decoding into a used payload reuses it and gives the same result.
    gq::payload out = make_payload(rng, enc(gq::identity{}), gq::index_layout::sparse, 3000, 2000);
    REQUIRE(gq::decode_wire(b, out) == b.size());
    REQUIRE(same_payload(out, p));
    gq::validate_payload(out);
  }
}

TEST_CASE("wire: decoded payloads decode to the same values as the originals") {
  std::mt19937_64 rng(2);
  const gq::qsgd q(7, 64);
  const gq::payload p = make_payload(rng, enc(q), gq::index_layout::sparse, 5000, 700);
  const gq::payload r = gq::decode_wire(encode(p));
  std::vector<float> a(p.count), b(p.count);
  q.decode(p, a);
  q.decode(r, b);
  CHECK(a == b);
}

TEST_CASE("wire: the header layout is the documented one") {
  gq::payload p;
  p.dense_size = std::uint64_t{1} << 32;  // the largest allowed
  p.layout = gq::index_layout::sparse;
  p.count = 3;
  p.indices = {7, 9, 0x01020304};
  gq::qsgd(5, 2).encode(std::vector<float>{1.0f, -2.0f, 0.5f}, gq::call_id{}, p);
  const bytes_t b = encode(p);
  CHECK(b[0] == std::byte{'G'});
  CHECK(b[1] == std::byte{'C'});
  CHECK(b[2] == std::byte{'M'});
  CHECK(b[3] == std::byte{'P'});
  CHECK(get(b, 4, 2) == 1);  // version
  CHECK(get(b, 6, 1) == 0);  // sparse
  CHECK(get(b, 7, 1) == 4);  // qsgd
  CHECK(get(b, 8, 1) == 4);  // bit_width(2 * 5)
  CHECK(get(b, 9, 7) == 0);  // reserved
  CHECK(get(b, 16, 8) == std::uint64_t{1} << 32);
  CHECK(get(b, 24, 4) == 3);  // count
  CHECK(get(b, 28, 4) == 2);  // side_count: buckets of 2
  CHECK(get(b, 32, 4) == 5);  // word 0 = levels
  CHECK(get(b, 36, 4) == 2);  // word 1 = bucket size
  CHECK(get(b, 40, 4) == 7);  // indices
  CHECK(get(b, 44, 4) == 9);
  CHECK(get(b, 48, 4) == 0x01020304);
  float side0 = 0;
  std::memcpy(&side0, b.data() + 52, 4);
  CHECK(side0 == p.side[0]);
  CHECK(b.size() == 40 + 12 + 8 + 2);  // 3 codes of 4 bits: 2 bytes
  CHECK(std::equal(p.values.begin(), p.values.end(), b.begin() + 60));
}

TEST_CASE("wire: concatenated payloads decode one after another with the prefix form") {
  std::mt19937_64 rng(3);
  const auto ps = sample_payloads(rng);
  bytes_t stream;
  for (const auto& p : ps) gq::encode_wire(p, stream);  // appends
  std::span<const std::byte> rest(stream);
  gq::payload out;
  for (const auto& p : ps) {
    const std::size_t used = gq::decode_wire(rest, out);
    REQUIRE(used == gq::wire_size(p));
    REQUIRE(same_payload(out, p));
    rest = rest.subspan(used);
  }
  CHECK(rest.empty());
  // The exact form refuses a stream of two.
  CHECK_THROWS_AS(gq::decode_wire(stream), gq::payload_error);
}

TEST_CASE("wire: malformed headers are rejected") {
  std::mt19937_64 rng(4);
  const gq::payload p = make_payload(rng, enc(gq::qsgd(7, 4)), gq::index_layout::sparse, 100, 10);
  const gq::payload d = make_payload(rng, enc(gq::terngrad{}), gq::index_layout::dense, 9, 9);
  const bytes_t good = encode(p);
  const bytes_t good_dense = encode(d);
  REQUIRE_NOTHROW(gq::decode_wire(good));
  REQUIRE_NOTHROW(gq::decode_wire(good_dense));

  SUBCASE("bad magic") {
    for (std::size_t k = 0; k < 4; ++k) {
      bytes_t b = good;
      b[k] ^= std::byte{0x20};
      require_rejected(b);
    }
  }
  SUBCASE("every unknown version") {
    for (std::uint32_t v = 0; v < 0x10000u; ++v) {
      if (v == 1) continue;
      bytes_t b = good;
      b[4] = static_cast<std::byte>(v & 0xffu);
      b[5] = static_cast<std::byte>(v >> 8);
      REQUIRE_THROWS_AS(gq::decode_wire(b), gq::payload_error);
    }
    bytes_t b = good;
    b[4] = std::byte{2};
    try {
      (void)gq::decode_wire(b);
    } catch (const gq::payload_error& e) {
      CHECK(std::string(e.what()).find("version 1") != std::string::npos);
    }
    require_rejected(b);
  }
  SUBCASE("reserved bytes non-zero") {
    for (std::size_t k = 9; k < 16; ++k) {
      for (const unsigned x : {1u, 0x80u, 0xffu}) {
        bytes_t b = good;
        b[k] = static_cast<std::byte>(x);
        require_rejected(b);
      }
    }
  }
  SUBCASE("unknown layout and quantizer") {
    for (unsigned x = 2; x < 256; ++x) {
      bytes_t b = good;
      b[6] = static_cast<std::byte>(x);
      require_rejected(b);
    }
    for (unsigned x = 0; x < 256; ++x) {
      if (x >= 1 && x <= 6) continue;
      bytes_t b = good;
      b[7] = static_cast<std::byte>(x);
      require_rejected(b);
    }
  }
  SUBCASE("another known quantizer with the same sizes is still rejected by the table") {
    for (const unsigned x : {1u, 2u, 3u, 5u, 6u}) {
      bytes_t b = good;
      b[7] = static_cast<std::byte>(x);
      require_rejected(b);
    }
  }
  SUBCASE("bits_per_value other than the table's") {
    for (unsigned x = 0; x < 256; ++x) {
      if (x == 4) continue;
      bytes_t b = good;
      b[8] = static_cast<std::byte>(x);
      require_rejected(b);
    }
  }
  SUBCASE("invalid params, side_count mismatch") {
    // (Params that are valid and give the same sizes, such as 6 levels for 7, pass the wire
    // check; the quantizer's decode rejects them.)
    for (const auto& [word0, word1] :
         {std::pair{0u, 4u}, std::pair{32768u, 4u}, std::pair{7u, 0u},
          std::pair{7u, (1u << 24) + 1}, std::pair{7u, 5u}, std::pair{8u, 4u}}) {
      bytes_t b = good;
      put_u32(b, 32, word0);
      put_u32(b, 36, word1);
      require_rejected(b);
    }
    for (const std::uint32_t sc :
         {0u, 2u, 4u, 0xffffffffu}) {  // 3 is right: 10 values, buckets of 4
      bytes_t b = good;
      put_u32(b, 28, sc);
      require_rejected(b);
    }
    bytes_t b = good_dense;
    put_u32(b, 36, 1);  // terngrad's parameter word 1 (levels) must be 0
    require_rejected(b);
  }
  SUBCASE("count and dense_size") {
    bytes_t b = good;
    put_u64(b, 16, 9);  // count 10 > n 9 (and indices beyond)
    require_rejected(b);
    b = good;
    put_u64(b, 16, (std::uint64_t{1} << 32) + 1);
    require_rejected(b);
    b = good_dense;
    put_u64(b, 16, 10);  // dense: count 9 != n 10
    require_rejected(b);
    b = good_dense;
    put_u32(b, 24, 8);
    require_rejected(b);
    // A header that claims 2^32 - 1 values in a bare 40-byte buffer: rejected on length,
    // before anything is sized from the claim.
    b.assign(good.begin(), good.begin() + 40);
    put_u64(b, 16, std::uint64_t{1} << 32);
    put_u32(b, 24, 0xffffffffu);
    put_u32(b, 28, 0x40000000u);  // ceil((2^32 - 1) / 4)
    require_rejected(b);
  }
  SUBCASE("truncated at every length, and one byte too long") {
    for (const bytes_t& g : {good, good_dense}) {
      for (std::size_t len = 0; len < g.size(); ++len) {
        const bytes_t b(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(len));
        require_rejected(b);
      }
      bytes_t b = g;
      b.push_back(std::byte{0});
      REQUIRE_THROWS_AS(gq::decode_wire(b), gq::payload_error);
      gq::payload out;
      REQUIRE(gq::decode_wire(b, out) == g.size());  // the prefix form stops at the payload
    }
  }
}

TEST_CASE("wire: malformed bodies are rejected") {
  std::mt19937_64 rng(5);
  const gq::payload p = make_payload(rng, enc(gq::qsgd(7, 4)), gq::index_layout::sparse, 100, 10);
  const bytes_t good = encode(p);
  const std::size_t idx = 40, side = 40 + 4 * 10;
  SUBCASE("index >= dense_size") {
    for (const std::uint32_t x : {100u, 101u, 0xffffffffu}) {
      bytes_t b = good;
      put_u32(b, idx + 4 * 9, x);
      require_rejected(b);
    }
  }
  SUBCASE("unsorted and duplicate indices") {
    bytes_t b = good;
    put_u32(b, idx + 4 * 3, static_cast<std::uint32_t>(get(b, idx + 4 * 2, 4)));  // duplicate
    require_rejected(b);
    b = good;
    const auto i4 = get(b, idx + 16, 4), i5 = get(b, idx + 20, 4);
    put_u32(b, idx + 16, static_cast<std::uint32_t>(i5));  // swapped
    put_u32(b, idx + 20, static_cast<std::uint32_t>(i4));
    require_rejected(b);
  }
  SUBCASE("NaN, Inf and negative side values") {
    for (const float x :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -1.0f,
          -std::numeric_limits<float>::denorm_min()}) {
      for (std::size_t k = 0; k < 3; ++k) {
        bytes_t b = good;
        std::memcpy(b.data() + side + 4 * k, &x, 4);
        require_rejected(b);
      }
    }
  }
}

TEST_CASE("wire: encode_wire refuses inconsistent payloads and leaves the stream alone") {
  std::mt19937_64 rng(6);
  const gq::payload good = make_payload(rng, enc(gq::terngrad(4)), gq::index_layout::sparse, 50, 9);
  const std::vector<std::function<void(gq::payload&)>> breakers = {
      [](gq::payload& p) { p.indices.pop_back(); },
      [](gq::payload& p) { p.indices.push_back(49); },
      [](gq::payload& p) { p.layout = gq::index_layout::dense; },
      [](gq::payload& p) { p.values.pop_back(); },
      [](gq::payload& p) { p.values.push_back(std::byte{0}); },
      [](gq::payload& p) { p.side.pop_back(); },
      [](gq::payload& p) { p.side.push_back(1.0f); },
      [](gq::payload& p) { p.side[1] = std::numeric_limits<float>::quiet_NaN(); },
      [](gq::payload& p) { p.side[0] = -2.0f; },
      [](gq::payload& p) { std::swap(p.indices[2], p.indices[3]); },
      [](gq::payload& p) { p.indices[4] = p.indices[3]; },
      [](gq::payload& p) { p.indices.back() = 50; },
      [](gq::payload& p) { p.dense_size = 5; },
      [](gq::payload& p) { p.dense_size = (std::uint64_t{1} << 32) + 1; },
      [](gq::payload& p) { p.quantizer = static_cast<gq::quantizer_id>(9); },
      [](gq::payload& p) { p.layout = static_cast<gq::index_layout>(2); },
      [](gq::payload& p) { p.bits_per_value = 3; },
      [](gq::payload& p) { p.params.levels = 1; },  // TernGrad has no levels
      [](gq::payload& p) { p.count = 8; },
  };
  for (std::size_t k = 0; k < breakers.size(); ++k) {
    CAPTURE(k);
    gq::payload p = good;
    breakers[k](p);
    bytes_t stream = {std::byte{1}, std::byte{2}};
    REQUIRE_THROWS_AS(gq::encode_wire(p, stream), gq::payload_error);
    REQUIRE(stream == bytes_t{std::byte{1}, std::byte{2}});
    bytes_t buf(4096);
    REQUIRE_THROWS_AS(gq::encode_wire(p, std::span<std::byte>(buf)), gq::payload_error);
    REQUIRE_THROWS_AS(gq::validate_payload(p), gq::payload_error);
  }
  // A dense payload must not carry indices.
  gq::payload d = make_payload(rng, enc(gq::identity{}), gq::index_layout::dense, 4, 4);
  d.indices = {0, 1, 2, 3};
  bytes_t s;
  CHECK_THROWS_AS(gq::encode_wire(d, s), gq::payload_error);
}

TEST_CASE("wire: randomly corrupted bytes decode to a consistent payload or throw payload_error") {
  std::mt19937_64 rng(7);
  std::vector<bytes_t> encodings;
  for (const auto& p : sample_payloads(rng)) {
    if (p.count < 600) encodings.push_back(encode(p));
  }
  gq::payload out;
  std::size_t accepted = 0, rejected = 0;
  for (int iter = 0; iter < 30000; ++iter) {
    bytes_t b = encodings[rng() % encodings.size()];
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      // Half the flips land in the header, where most of the structure is.
      const std::size_t at = (rng() & 1u) != 0u ? rng() % 40 : rng() % b.size();
      b[at] ^= static_cast<std::byte>(1u + rng() % 255);
    }
    if ((rng() & 7u) == 0u) b.resize(rng() % (b.size() + 1));
    const gq::payload before = out;
    try {
      const std::size_t used = gq::decode_wire(b, out);
      ++accepted;
      REQUIRE(used <= b.size());
      REQUIRE_NOTHROW(gq::validate_payload(out));
      // The format has one byte form per payload: re-encoding gives the same bytes.
      const bytes_t again = encode(out);
      REQUIRE(again.size() == used);
      REQUIRE(std::equal(again.begin(), again.end(), b.begin()));
    } catch (const gq::payload_error&) {
      ++rejected;
      REQUIRE(same_payload(out, before));
    }
    try {
      const gq::payload q = gq::decode_wire(b);
      REQUIRE_NOTHROW(gq::validate_payload(q));
    } catch (const gq::payload_error&) {
    }
  }
  CHECK(accepted > 100);  // flips in values and side bytes are often still valid
  CHECK(rejected > 1000);
}
