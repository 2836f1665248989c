// The quantizer contract, checked the same way for every shipped quantizer and several
// settings: sizes and fields of what encode writes, decode size, determinism per call_id,
// capacity reuse, non-finite inputs, and rejection of every malformed payload without
// touching the output.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/quantize.hpp>

#include "quantize_test_support.hpp"

namespace gq = gradcomp;
using gradcomp_test::blank;
using gradcomp_test::bernstein_bound;
using gradcomp_test::normal_values;

namespace {

template <class Q>
std::vector<Q> configs();
template <>
std::vector<gq::identity> configs() {
  return {gq::identity{}};
}
template <>
std::vector<gq::fp16> configs() {
  return {gq::fp16{}};
}
template <>
std::vector<gq::bf16> configs() {
  return {gq::bf16{}};
}
template <>
std::vector<gq::qsgd> configs() {
  return {gq::qsgd{},       gq::qsgd(1, 3),
          gq::qsgd(2, 100), gq::qsgd::with_bits(8, 1000),
          gq::qsgd(5, 1),   gq::qsgd::with_bits(16, 512)};
}
template <>
std::vector<gq::terngrad> configs() {
  return {gq::terngrad{}, gq::terngrad(512), gq::terngrad(7)};
}
template <>
std::vector<gq::scaled_sign> configs() {
  return {gq::scaled_sign{}, gq::scaled_sign(512), gq::scaled_sign(1), gq::scaled_sign(33)};
}

template <class Q>
constexpr bool is_stochastic =
    Q::id == gq::quantizer_id::qsgd || Q::id == gq::quantizer_id::terngrad;

constexpr float sentinel = -12345.5f;

// decode must throw E and leave every element of the output as it was.
template <class E, class Q>
void require_rejected(const Q& q, const gq::payload& p, std::size_t out_size) {
  std::vector<float> out(out_size, sentinel);
  REQUIRE_THROWS_AS(q.decode(p, out), E);
  for (const float x : out) REQUIRE(x == sentinel);
}

}  // namespace

#define GRADCOMP_ALL_QUANTIZERS \
  gq::identity, gq::fp16, gq::bf16, gq::qsgd, gq::terngrad, gq::scaled_sign

TEST_CASE_TEMPLATE("quantizer: encode fills exactly what the table says; decode sizes match", Q,
                   GRADCOMP_ALL_QUANTIZERS) {
  for (const Q& q : configs<Q>()) {
    for (const std::size_t n : {0, 1, 2, 3, 511, 512, 513, 100000}) {
      CAPTURE(n);
      const auto v = normal_values(n, n + 1);
      gq::payload p = blank(n);
      p.dense_size = n + 5;  // caller's fields must survive
      p.layout = gq::index_layout::sparse;
      for (std::uint32_t i = 0; i < n; ++i) p.indices.push_back(i + 1);
      const auto indices = p.indices;
      q.encode(v, gq::call_id{1, 2, 3}, p);
      CHECK(p.dense_size == n + 5);
      CHECK(p.layout == gq::index_layout::sparse);
      CHECK(p.indices == indices);
      CHECK(p.count == n);
      CHECK(p.quantizer == Q::id);
      CHECK(p.bits_per_value == q.bits_per_value());
      CHECK(p.params == q.params());
      const auto layout = gq::detail::layout_of(Q::id, q.params(), n);
      CHECK(layout.bits_per_value == q.bits_per_value());
      CHECK(p.values.size() == gq::payload::packed_bytes(n, q.bits_per_value()));
      CHECK(p.side.size() == layout.side_count);
      for (const float s : p.side) CHECK((std::isfinite(s) && s >= 0.0f));
      std::vector<float> out(n, sentinel);
      q.decode(p, out);
      for (const float x : out) REQUIRE(std::isfinite(x));
      // Decoding twice gives the same result (decode is a pure function of the payload).
      std::vector<float> again(n);
      q.decode(p, again);
      REQUIRE(std::equal(out.begin(), out.end(), again.begin()));
    }
  }
}

TEST_CASE_TEMPLATE("quantizer: the same call_id gives the same bytes; another step other bytes", Q,
                   GRADCOMP_ALL_QUANTIZERS) {
  for (const Q& q : configs<Q>()) {
    const auto v = normal_values(2000, 9);
    gq::payload a = blank(v.size()), b = blank(v.size()), c = blank(v.size());
    q.encode(v, gq::call_id{7, 100, 2}, a);
    q.encode(v, gq::call_id{7, 100, 2}, b);
    q.encode(v, gq::call_id{7, 101, 2}, c);
    CHECK(a.values == b.values);
    CHECK(a.side == b.side);
    bool stochastic = is_stochastic<Q>;
    if constexpr (Q::id == gq::quantizer_id::qsgd) {
      stochastic = q.bucket_size() > 1;  // a bucket of one value is its own norm: exact
    }
    if (stochastic) {
      CHECK(a.values != c.values);
      gq::payload d = blank(v.size()), e = blank(v.size());
      q.encode(v, gq::call_id{8, 100, 2}, d);
      q.encode(v, gq::call_id{7, 100, 3}, e);
      CHECK(a.values != d.values);
      CHECK(a.values != e.values);
    } else {
      CHECK(a.values == c.values);  // deterministic quantizers ignore the call id
    }
    CHECK(a.side == c.side);  // side data never depends on randomness
  }
}

TEST_CASE_TEMPLATE("quantizer: re-encoding into a payload reuses its capacity", Q,
                   GRADCOMP_ALL_QUANTIZERS) {
  for (const Q& q : configs<Q>()) {
    const auto v = normal_values(5000, 1);
    gq::payload p = blank(v.size());
    q.encode(v, gq::call_id{}, p);
    const auto* values = p.values.data();
    const auto* side = p.side.data();
    p.count = 4000;  // a smaller tensor next time
    q.encode(std::span<const float>(v).first(4000), gq::call_id{0, 1, 0}, p);
    CHECK(p.values.data() == values);
    if (!p.side.empty()) CHECK(p.side.data() == side);
  }
}

TEST_CASE_TEMPLATE("quantizer: encode checks the count the caller set", Q,
                   GRADCOMP_ALL_QUANTIZERS) {
  const Q q{};
  const auto v = normal_values(10, 1);
  gq::payload p = blank(9);
  CHECK_THROWS_AS(q.encode(v, gq::call_id{}, p), gq::invalid_argument);
}

TEST_CASE_TEMPLATE("quantizer: non-finite inputs neither crash nor produce an invalid payload", Q,
                   GRADCOMP_ALL_QUANTIZERS) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  constexpr float big = std::numeric_limits<float>::max();
  for (const Q& q : configs<Q>()) {
    for (const auto& v : {std::vector<float>{nan}, std::vector<float>{inf, -inf, 1.0f},
                          std::vector<float>{1.0f, nan, -2.0f, inf, 0.0f, -0.0f, 3.0f},
                          std::vector<float>{big, big, -big, big}}) {
      gq::payload p = blank(v.size());
      q.encode(v, gq::call_id{1, 1, 1}, p);
      std::vector<float> out(v.size(), sentinel);
      q.decode(p, out);  // a valid payload
      for (std::size_t i = 0; i < v.size(); ++i) {
        if constexpr (Q::summable) {
          // Casts keep NaN and Inf; finite values stay finite (fp16 saturates).
          CHECK(std::isnan(out[i]) == std::isnan(v[i]));
          CHECK(std::isinf(out[i]) == std::isinf(v[i]));
        } else {
          CHECK(std::isfinite(out[i]));  // a bucket holding NaN/Inf decodes to zeros
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("quantizer: decode rejects malformed payloads and leaves the output alone", Q,
                   GRADCOMP_ALL_QUANTIZERS) {
  for (const Q& q : configs<Q>()) {
    for (const std::size_t n : {1, 3, 513, 2000}) {
      CAPTURE(n);
      const auto v = normal_values(n, 5);
      gq::payload good = blank(n);
      q.encode(v, gq::call_id{3, 4, 5}, good);
      {
        std::vector<float> out(n, sentinel);
        REQUIRE_NOTHROW(q.decode(good, out));
      }
      using PE = gq::payload_error;
      // Output of the wrong size: invalid_argument, nothing written.
      require_rejected<gq::invalid_argument>(q, good, n - 1);
      require_rejected<gq::invalid_argument>(q, good, n + 1);
      // Another quantizer id (decode must not guess).
      for (std::uint8_t id = 0; id < 10; ++id) {
        if (id == static_cast<std::uint8_t>(Q::id)) continue;
        auto p = good;
        p.quantizer = static_cast<gq::quantizer_id>(id);
        require_rejected<PE>(q, p, n);
      }
      for (const int d : {-1, 1, 8}) {  // bits
        auto p = good;
        p.bits_per_value = static_cast<std::uint8_t>(p.bits_per_value + d);
        require_rejected<PE>(q, p, n);
      }
      for (const auto params : {gq::quantizer_params{good.params.levels + 1, good.params.bucket_size},
                                gq::quantizer_params{good.params.levels, good.params.bucket_size + 1}}) {
        auto p = good;
        p.params = params;
        require_rejected<PE>(q, p, n);
      }
      {
        auto p = good;
        p.values.pop_back();
        require_rejected<PE>(q, p, n);
        p = good;
        p.values.push_back(std::byte{0});
        require_rejected<PE>(q, p, n);
        p = good;
        p.values.clear();
        require_rejected<PE>(q, p, n);
      }
      {
        auto p = good;
        p.side.push_back(1.0f);
        require_rejected<PE>(q, p, n);
        if (!good.side.empty()) {
          p = good;
          p.side.pop_back();
          require_rejected<PE>(q, p, n);
          for (const float bad :
               {-1.0f, -std::numeric_limits<float>::denorm_min(),
                std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
            p = good;
            p.side[p.side.size() / 2] = bad;
            require_rejected<PE>(q, p, n);
          }
        }
      }
      // Nonzero padding bits above the last code.
      const unsigned used = static_cast<unsigned>((n * q.bits_per_value()) % 8);
      if (used != 0) {
        auto p = good;
        p.values.back() |= static_cast<std::byte>(0x80u);
        require_rejected<PE>(q, p, n);
      }
      // Codes that mean nothing: every code above the largest valid one, at the first, a
      // middle and the last position.
      const std::uint64_t all_ones = gq::detail::code_mask(q.bits_per_value());
      std::uint64_t max_valid = all_ones;
      if constexpr (Q::id == gq::quantizer_id::qsgd) max_valid = 2 * q.levels();
      if constexpr (Q::id == gq::quantizer_id::terngrad) max_valid = 2;
      for (std::uint64_t code = max_valid + 1; code <= all_ones && code <= max_valid + 300;
           ++code) {
        for (const std::size_t at : {std::size_t{0}, n / 2, n - 1}) {
          auto p = good;
          gq::detail::store_code(p.values.data(), at, q.bits_per_value(),
                                 static_cast<std::uint32_t>(code));
          require_rejected<PE>(q, p, n);
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("quantizer: an empty payload round trips", Q, GRADCOMP_ALL_QUANTIZERS) {
  const Q q{};
  gq::payload p = blank(0);
  q.encode({}, gq::call_id{}, p);
  CHECK(p.values.empty());
  CHECK(p.side.empty());
  std::vector<float> out;
  q.decode(p, out);
}

namespace {
struct no_decode {
  static constexpr gq::quantizer_id id = gq::quantizer_id::identity;
  static constexpr bool summable = false;
  unsigned bits_per_value() const { return 32; }
  gq::quantizer_params params() const { return {}; }
  void encode(std::span<const float>, const gq::call_id&, gq::payload&) const {}
};
}  // namespace

TEST_CASE("quantizer concepts: models and non-models") {
  static_assert(gq::quantizer<gq::qsgd> && gq::quantizer<gq::terngrad> &&
                gq::quantizer<gq::scaled_sign>);
  static_assert(!gq::summable_quantizer<gq::qsgd> && !gq::summable_quantizer<gq::terngrad> &&
                !gq::summable_quantizer<gq::scaled_sign>);
  static_assert(gq::summable_quantizer<gq::identity> && gq::summable_quantizer<gq::fp16> &&
                gq::summable_quantizer<gq::bf16>);
  static_assert(!gq::quantizer<no_decode>);
  static_assert(!gq::quantizer<int>);
  CHECK(true);
}

TEST_CASE("contract: the rounding stream depends on call_id::rank; rank 0 is the stream without it") {
  const auto v = normal_values(4099, 31);
  auto encode = [&](const auto& q, std::uint32_t rank) {
    gq::payload p = blank(v.size());
    gq::call_id id{7, 100, 2};
    id.rank = rank;
    q.encode(v, id, p);
    return p.values;
  };
  auto check_quantizer = [&](const auto& q) {
    gq::payload plain = blank(v.size());
    q.encode(v, gq::call_id{7, 100, 2}, plain);
    CHECK(encode(q, 0) == plain.values);   // rank 0: the stream of (seed, step, tensor id)
    CHECK(encode(q, 1) == encode(q, 1));   // a function of the rank
    CHECK(encode(q, 1) != plain.values);   // other ranks round differently
    CHECK(encode(q, 2) != encode(q, 1));
  };
  check_quantizer(gq::qsgd(3, 256));
  check_quantizer(gq::terngrad{});
  // Deterministic quantizers do not draw at all.
  CHECK(encode(gq::fp16{}, 3) == encode(gq::fp16{}, 0));
  CHECK(encode(gq::scaled_sign{}, 3) == encode(gq::scaled_sign{}, 0));
}
