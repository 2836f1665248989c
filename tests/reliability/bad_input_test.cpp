// The bad-input matrix: every public entry point against the inputs it must refuse (empty
// tensors, k out of range, bad densities, mismatched spans, non-finite gradients, malformed
// payloads and bytes, broken checkpoints, bad collective arguments). Each case checks the
// documented exception type and that feedback state, outputs and parameters are byte for
// byte what they were before the call.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/gradcomp.hpp>

#include "support.hpp"
#include "../support/solo_comm.hpp"

namespace {

using namespace gradcomp;
using reliability::bytes_of;
using reliability::state_bytes;
using reliability::gradient;
namespace test = reliability;

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_f = std::numeric_limits<float>::infinity();
constexpr double nan_d = std::numeric_limits<double>::quiet_NaN();
constexpr double inf_d = std::numeric_limits<double>::infinity();

// The densities k_for_density, compress and density_schedule must refuse.
const double bad_densities[] = {0.0, -0.0, -1.0, 1.5, 1.0 + 1e-12, nan_d, inf_d, -inf_d};

// A recognisable fill for outputs that must stay untouched.
template <class T>
std::vector<T> sentinel(std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(-1000.25) - static_cast<T>(i);
  return v;
}

// A payload mutation and the exception decoding it must raise.
enum class expect { payload, argument };

struct mutation {
  std::string name;
  expect error;
  // Returns false when the mutation does not apply to this payload.
  std::function<bool(payload&)> apply;
};

// Every way a received payload object can break the format; each applies where it makes
// sense for the payload at hand.
std::vector<mutation> payload_mutations() {
  std::vector<mutation> m;
  auto sparse = [](const payload& p) { return p.layout == index_layout::sparse; };
  m.push_back({"index == dense_size", expect::payload, [=](payload& p) {
                 if (!sparse(p) || p.count == 0) return false;
                 p.indices.back() = static_cast<std::uint32_t>(p.dense_size);
                 return true;
               }});
  m.push_back({"index 2^32 - 1", expect::payload, [=](payload& p) {
                 if (!sparse(p) || p.count == 0) return false;
                 p.indices.front() = 0xffffffffu;
                 return true;
               }});
  m.push_back({"duplicate index", expect::payload, [=](payload& p) {
                 if (!sparse(p) || p.count < 2) return false;
                 p.indices[1] = p.indices[0];
                 return true;
               }});
  m.push_back({"unsorted indices", expect::payload, [=](payload& p) {
                 if (!sparse(p) || p.count < 2) return false;
                 std::swap(p.indices[0], p.indices[1]);
                 return true;
               }});
  m.push_back({"fewer indices than count", expect::payload, [=](payload& p) {
                 if (!sparse(p) || p.count == 0) return false;
                 p.indices.pop_back();
                 return true;
               }});
  m.push_back({"more indices than count", expect::payload, [=](payload& p) {
                 if (!sparse(p) || p.count == p.dense_size) return false;
                 p.indices.push_back(static_cast<std::uint32_t>(p.dense_size - 1));
                 return true;
               }});
  m.push_back({"count > dense_size", expect::payload, [](payload& p) {
                 p.count = static_cast<std::uint32_t>(p.dense_size + 1);
                 return true;
               }});
  m.push_back({"dense layout with count != dense_size", expect::payload, [=](payload& p) {
                 if (!sparse(p) || p.count == p.dense_size) return false;
                 p.layout = index_layout::dense;
                 return true;
               }});
  m.push_back({"dense layout with an index array", expect::payload, [](payload& p) {
                 if (p.layout != index_layout::dense || p.count == 0) return false;
                 p.indices.assign(p.count, 0);
                 for (std::uint32_t i = 0; i < p.count; ++i) p.indices[i] = i;
                 return true;
               }});
  m.push_back({"unknown layout", expect::payload, [](payload& p) {
                 p.layout = static_cast<index_layout>(7);
                 return true;
               }});
  m.push_back({"truncated values", expect::payload, [](payload& p) {
                 if (p.values.empty()) return false;
                 p.values.pop_back();
                 return true;
               }});
  m.push_back({"one value byte too many", expect::payload, [](payload& p) {
                 p.values.push_back(std::byte{0});
                 return true;
               }});
  m.push_back({"side entry missing", expect::payload, [](payload& p) {
                 if (p.side.empty()) return false;
                 p.side.pop_back();
                 return true;
               }});
  m.push_back({"side entry extra", expect::payload, [](payload& p) {
                 p.side.push_back(1.0f);
                 return true;
               }});
  for (float bad : {nan_f, inf_f, -1.0f}) {
    m.push_back({"side value NaN, Inf or negative", expect::payload, [bad](payload& p) {
                   if (p.side.empty()) return false;
                   p.side.back() = bad;
                   return true;
                 }});
  }
  for (int id : {0, 1, 2, 4, 5, 6, 7, 255}) {
    m.push_back({"another or unknown quantizer id", expect::payload, [id](payload& p) {
                   if (static_cast<int>(p.quantizer) == id) return false;
                   p.quantizer = static_cast<quantizer_id>(id);
                   return true;
                 }});
  }
  m.push_back({"bits_per_value off by one", expect::payload, [](payload& p) {
                 ++p.bits_per_value;
                 return true;
               }});
  m.push_back({"quantizer levels changed", expect::payload, [](payload& p) {
                 ++p.params.levels;
                 return true;
               }});
  m.push_back({"quantizer bucket size changed", expect::payload, [](payload& p) {
                 ++p.params.bucket_size;
                 return true;
               }});
  m.push_back({"nonzero padding bits", expect::payload, [](payload& p) {
                 const unsigned used = static_cast<unsigned>(
                     (static_cast<std::uint64_t>(p.count) * p.bits_per_value) % 8u);
                 if (used == 0 || p.values.empty()) return false;
                 p.values.back() |= std::byte{0x80};
                 return true;
               }});
  m.push_back({"codes above the largest valid one", expect::payload, [](payload& p) {
                 // Every code all ones: invalid for qsgd (> 2s) and terngrad (3); the other
                 // quantizers have no invalid codes.
                 if (p.quantizer != quantizer_id::qsgd && p.quantizer != quantizer_id::terngrad)
                   return false;
                 if (p.values.empty()) return false;
                 std::fill(p.values.begin(), p.values.end(), std::byte{0xff});
                 const unsigned used = static_cast<unsigned>(
                     (static_cast<std::uint64_t>(p.count) * p.bits_per_value) % 8u);
                 if (used != 0) p.values.back() &= static_cast<std::byte>((1u << used) - 1u);
                 return true;
               }});
  return m;
}

// ---------------------------------------------------------------------------------------
// The compressors the matrix runs: every selector, quantizer and feedback appears at least
// once, float and double gradients.

using c_topk = compressor<topk, identity, residual>;
using c_gaussiank = compressor<gaussiank, qsgd, dgc_momentum>;
using c_randomk = compressor<randomk, fp16, residual>;
using c_dgc = compressor<dgc_sampling, terngrad, residual>;
using c_redsync = compressor<redsync, scaled_sign, no_feedback>;
using c_threshold = compressor<threshold, bf16, residual>;
using c_dense = compressor<dense, qsgd, residual>;
using c_topk_double = compressor<topk, terngrad, dgc_momentum, double>;

#define GRADCOMP_COMPRESSORS \
  c_topk, c_gaussiank, c_randomk, c_dgc, c_redsync, c_threshold, c_dense, c_topk_double

template <class C>
C make_compressor() {
  if constexpr (std::is_same_v<typename C::quantizer_type, terngrad>) {
    return C(typename C::selector_type{}, terngrad(16));
  } else if constexpr (std::is_same_v<typename C::quantizer_type, scaled_sign>) {
    return C(typename C::selector_type{}, scaled_sign(16));
  } else if constexpr (std::is_same_v<typename C::quantizer_type, qsgd>) {
    return C(typename C::selector_type{}, qsgd(7, 16));
  } else {
    return C{};
  }
}

constexpr std::size_t matrix_n = 97;  // odd, so that packed values leave padding bits

template <class C>
std::vector<typename C::value_type> grad_for(std::uint64_t seed, std::size_t n = matrix_n) {
  return gradient<typename C::value_type>(n, seed, test::dist::normal);
}

// A compressor with a state that already holds something, and its last payload.
template <class C>
struct primed {
  C c = make_compressor<C>();
  typename C::state_type st = c.make_state(matrix_n);
  payload p;
  primed() {
    for (std::uint64_t s = 0; s < 2; ++s) {
      c.compress(grad_for<C>(s), st, {0.2, call_id{5, s, 3}}, p);
    }
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Densities, k, and the selectors called directly

TEST_CASE("bad input: k_for_density, check_k and density_schedule refuse out-of-range values") {
  for (double d : bad_densities) {
    CAPTURE(d);
    CHECK_THROWS_AS((void)k_for_density(10, d), gradcomp::invalid_argument);
    CHECK_THROWS_AS((void)k_for_density(0, d), gradcomp::invalid_argument);
    CHECK_THROWS_AS((void)density_schedule::constant(d), gradcomp::invalid_argument);
    CHECK_THROWS_AS((void)density_schedule::warmup(d, 2, 10), gradcomp::invalid_argument);
  }
  CHECK_THROWS_AS((void)density_schedule::warmup(0.1, 2, 0), gradcomp::invalid_argument);
  CHECK(k_for_density(0, 0.5) == 0);  // an empty tensor is not an error
  CHECK(k_for_density(1, 1e-9) == 1);
  CHECK_THROWS_AS(check_k("test", 11, 10), gradcomp::invalid_argument);
  CHECK_THROWS_AS(check_k("test", 1, 0), gradcomp::invalid_argument);
  CHECK_NOTHROW(check_k("test", 10, 10));
  CHECK_NOTHROW(check_k("test", 0, 0));
}

TEST_CASE_TEMPLATE("bad input: selectors refuse k > n and leave the index vector alone", S, topk,
                   gaussiank, randomk, dgc_sampling, redsync) {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{50}}) {
    CAPTURE(n);
    const auto g = gradient<float>(n, 7, test::dist::normal);
    const auto gd = gradient<double>(n, 7, test::dist::normal);
    S s{};
    std::vector<std::uint32_t> idx{3, 1, 4, 1, 5};
    const auto before = bytes_of(idx);
    for (std::size_t k : {n + 1, n + 1000, std::numeric_limits<std::size_t>::max()}) {
      CAPTURE(k);
      const select_context ctx{k, 0.5, call_id{1, 2, 3}};
      CHECK_THROWS_AS((void)s.select(std::span<const float>(g), ctx, idx), gradcomp::invalid_argument);
      CHECK(bytes_of(idx) == before);
      CHECK_THROWS_AS((void)s.select(std::span<const double>(gd), ctx, idx), gradcomp::invalid_argument);
      CHECK(bytes_of(idx) == before);
    }
    // k = 0 selects nothing, whatever n.
    const selection_stats st =
        s.select(std::span<const float>(g), select_context{0, 0.5, call_id{}}, idx);
    CHECK(st.count == 0);
    CHECK(idx.empty());
  }
}

TEST_CASE("bad input: dense and threshold ignore k, as documented") {
  const auto g = gradient<float>(20, 8, test::dist::normal);
  std::vector<std::uint32_t> idx;
  dense d;
  CHECK(d.select(std::span<const float>(g), select_context{1000, 0.5, {}}, idx).count == 20);
  threshold t{0.0};
  CHECK(t.select(std::span<const float>(g), select_context{1000, 0.5, {}}, idx).count == 20);
}

TEST_CASE("bad input: threshold tau < 0 or NaN and redsync min_interval <= 0 are refused") {
  const auto g = gradient<float>(30, 9, test::dist::normal);
  std::vector<std::uint32_t> idx{9, 9};
  const auto before = bytes_of(idx);
  for (double tau : {-1.0, -1e-300, -inf_d, nan_d}) {
    CAPTURE(tau);
    threshold t{tau};
    CHECK_THROWS_AS((void)t.select(std::span<const float>(g), select_context{3, 0.1, {}}, idx),
                    gradcomp::invalid_argument);
    CHECK_THROWS_AS(t.check(), gradcomp::invalid_argument);
    CHECK(bytes_of(idx) == before);
  }
  for (double mi : {0.0, -0.1, nan_d}) {
    CAPTURE(mi);
    redsync r;
    r.min_interval = mi;
    CHECK_THROWS_AS((void)r.select(std::span<const float>(g), select_context{3, 0.1, {}}, idx),
                    gradcomp::invalid_argument);
    CHECK(bytes_of(idx) == before);
  }
}

// ---------------------------------------------------------------------------------------
// compressor::compress and decompress

TEST_CASE_TEMPLATE("bad input: compress refuses bad densities, sizes and non-finite gradients, "
                   "state and payload unchanged",
                   C, GRADCOMP_COMPRESSORS) {
  using T = typename C::value_type;
  primed<C> x;
  const auto st_before = state_bytes(x.st);
  const auto p_before = bytes_of(x.p);
  auto unchanged = [&] {
    CHECK(state_bytes(x.st) == st_before);
    CHECK(bytes_of(x.p) == p_before);
  };
  const auto g = grad_for<C>(11);

  for (double d : bad_densities) {
    CAPTURE(d);
    CHECK_THROWS_AS(x.c.compress(g, x.st, {d, call_id{5, 9, 3}}, x.p), gradcomp::invalid_argument);
    unchanged();
  }
  for (std::size_t n : {std::size_t{0}, matrix_n - 1, matrix_n + 1}) {
    CAPTURE(n);
    const auto other = grad_for<C>(12, n);
    CHECK_THROWS_AS(x.c.compress(other, x.st, {0.2, call_id{5, 9, 3}}, x.p),
                    gradcomp::invalid_argument);
    unchanged();
  }
  for (T bad : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                -std::numeric_limits<T>::infinity()}) {
    for (std::size_t at : {std::size_t{0}, matrix_n / 2, matrix_n - 1}) {
      CAPTURE(bad);
      CAPTURE(at);
      auto g2 = g;
      g2[at] = bad;
      CHECK_THROWS_AS(x.c.compress(g2, x.st, {0.2, call_id{5, 9, 3}}, x.p), nonfinite_error);
      unchanged();
    }
  }
  // After all that, the compressor still works and the state moves on.
  CHECK_NOTHROW(x.c.compress(g, x.st, {0.2, call_id{5, 9, 3}}, x.p));
  CHECK_NOTHROW(validate_payload(x.p));
}

TEST_CASE("bad input: a selector setting rejected by check() leaves the feedback state unchanged") {
  // Regression: compress used to accumulate g into the residual before the selector rejected
  // its tau, so a failed call changed the state.
  compressor<threshold, identity, residual> c(threshold{-1.0});
  auto st = c.make_state(16);
  st.e.assign(16, 0.5f);
  const auto before = state_bytes(st);
  payload p;
  const auto pb = bytes_of(p);
  const auto g = gradient<float>(16, 1, test::dist::normal);
  CHECK_THROWS_AS(c.compress(g, st, {0.5, {}}, p), gradcomp::invalid_argument);
  CHECK(state_bytes(st) == before);
  CHECK(bytes_of(p) == pb);

  redsync r;
  r.min_interval = 0.0;
  compressor<redsync, identity, dgc_momentum> c2(r);
  auto st2 = c2.make_state(16);
  const auto before2 = state_bytes(st2);
  CHECK_THROWS_AS(c2.compress(g, st2, {0.5, {}}, p), gradcomp::invalid_argument);
  CHECK(state_bytes(st2) == before2);
}

TEST_CASE_TEMPLATE("bad input: empty tensors compress to empty payloads and round trip", C,
                   GRADCOMP_COMPRESSORS) {
  using T = typename C::value_type;
  C c = make_compressor<C>();
  auto st = c.make_state(0);
  payload p;
  const std::vector<T> g;
  for (std::uint64_t step = 0; step < 2; ++step) {
    const compress_stats cs = c.compress(g, st, {0.5, call_id{1, step, 0}}, p);
    CHECK(cs.n == 0);
    CHECK(cs.selection.count == 0);
    CHECK(p.count == 0);
    CHECK(p.dense_size == 0);
    CHECK(p.indices.empty());
    CHECK(p.values.empty());
    CHECK(p.side.empty());
  }
  CHECK_NOTHROW(validate_payload(p));
  std::vector<std::byte> wire;
  encode_wire(p, wire);
  CHECK(wire.size() == wire_header_bytes);
  const payload q = decode_wire(wire);
  CHECK(q == p);
  std::vector<T> out;
  CHECK_NOTHROW(c.decompress(q, out));
  CHECK_NOTHROW(c.decompress(q, out, decompress_mode::accumulate));
}

TEST_CASE_TEMPLATE("bad input: decompress refuses malformed payloads and writes nothing", C,
                   GRADCOMP_COMPRESSORS) {
  using T = typename C::value_type;
  primed<C> x;
  const auto st_before = state_bytes(x.st);
  REQUIRE_NOTHROW(validate_payload(x.p));
  for (decompress_mode mode : {decompress_mode::overwrite, decompress_mode::accumulate}) {
    auto dense = sentinel<T>(matrix_n);
    const auto before = bytes_of(dense);
    std::size_t applied = 0;
    for (const mutation& m : payload_mutations()) {
      payload bad = x.p;
      if (!m.apply(bad)) continue;
      ++applied;
      CAPTURE(m.name);
      CHECK_THROWS_AS(x.c.decompress(bad, dense, mode), payload_error);
      CHECK(bytes_of(dense) == before);
    }
    CHECK(applied >= 15);
    // A dense buffer of another size than the payload's dense_size.
    for (std::size_t n : {std::size_t{0}, matrix_n - 1, matrix_n + 1}) {
      auto other = sentinel<T>(n);
      const auto other_before = bytes_of(other);
      CHECK_THROWS_AS(x.c.decompress(x.p, other, mode), gradcomp::invalid_argument);
      CHECK(bytes_of(other) == other_before);
    }
  }
  CHECK(state_bytes(x.st) == st_before);
}

// ---------------------------------------------------------------------------------------
// Quantizers called directly

namespace {

template <class Q>
Q quantizer_for_matrix() {
  if constexpr (std::is_same_v<Q, qsgd>) {
    return qsgd(7, 16);
  } else if constexpr (std::is_same_v<Q, terngrad> || std::is_same_v<Q, scaled_sign>) {
    return Q(16);
  } else {
    return Q{};
  }
}

}  // namespace

TEST_CASE_TEMPLATE("bad input: quantizer encode and decode refuse what does not fit", Q, identity,
                   fp16, bf16, qsgd, terngrad, scaled_sign) {
  const Q q = quantizer_for_matrix<Q>();
  const auto values = gradient<float>(45, 3, test::dist::laplace);
  payload good;
  good.dense_size = 100;
  good.count = static_cast<std::uint32_t>(values.size());
  for (std::uint32_t i = 0; i < good.count; ++i) good.indices.push_back(2 * i + 1);
  q.encode(values, call_id{1, 2, 3}, good);
  REQUIRE_NOTHROW(validate_payload(good));

  // encode: the caller's count must match the values.
  payload wrong_count = good;
  wrong_count.count = good.count - 1;
  const auto wc_before = bytes_of(wrong_count);
  CHECK_THROWS_AS(q.encode(values, call_id{}, wrong_count), gradcomp::invalid_argument);
  CHECK(bytes_of(wrong_count) == wc_before);

  // decode: an output of another size.
  for (std::size_t n : {std::size_t{0}, values.size() - 1, values.size() + 1}) {
    auto out = sentinel<float>(n);
    const auto before = bytes_of(out);
    CHECK_THROWS_AS(q.decode(good, out), gradcomp::invalid_argument);
    CHECK(bytes_of(out) == before);
  }
  // decode: every malformed field a decoder checks (index mutations are the scatter's job).
  std::size_t applied = 0;
  for (const mutation& m : payload_mutations()) {
    payload bad = good;
    if (!m.apply(bad)) continue;
    const bool decoder_checks = bad.quantizer != good.quantizer ||
                                bad.bits_per_value != good.bits_per_value ||
                                bad.params != good.params || bad.values != good.values ||
                                bad.side.size() != good.side.size() ||
                                !std::equal(bad.side.begin(), bad.side.end(), good.side.begin());
    if (!decoder_checks || bad.count != good.count) continue;
    ++applied;
    CAPTURE(m.name);
    auto out = sentinel<float>(bad.count);
    const auto before = bytes_of(out);
    CHECK_THROWS_AS(q.decode(bad, out), payload_error);
    CHECK(bytes_of(out) == before);
  }
  CHECK(applied >= 10);
}

TEST_CASE("bad input: quantizer settings out of range are refused at construction") {
  CHECK_THROWS_AS(qsgd(0), gradcomp::invalid_argument);
  CHECK_THROWS_AS(qsgd(32768), gradcomp::invalid_argument);
  CHECK_THROWS_AS(qsgd(7, 0), gradcomp::invalid_argument);
  CHECK_THROWS_AS(qsgd(7, (1u << 24) + 1u), gradcomp::invalid_argument);
  CHECK_THROWS_AS(qsgd::with_bits(1), gradcomp::invalid_argument);
  CHECK_THROWS_AS(qsgd::with_bits(17), gradcomp::invalid_argument);
  CHECK_NOTHROW(qsgd(32767, 1u << 24));
  // A qsgd decoder refuses a payload of other levels or bucket size.
  const auto v = gradient<float>(10, 1, test::dist::normal);
  payload p;
  p.dense_size = 10;
  p.count = 10;
  p.layout = index_layout::dense;
  qsgd(7, 4).encode(v, {}, p);
  auto out = sentinel<float>(10);
  const auto before = bytes_of(out);
  CHECK_THROWS_AS(qsgd(3, 4).decode(p, out), payload_error);
  CHECK_THROWS_AS(qsgd(7, 5).decode(p, out), payload_error);
  CHECK_THROWS_AS(terngrad(4).decode(p, out), payload_error);
  CHECK(bytes_of(out) == before);
}

// ---------------------------------------------------------------------------------------
// Wire format

namespace {

// Encodings of one payload per quantizer, sparse and dense.
std::vector<std::vector<std::byte>> sample_encodings() {
  std::vector<std::vector<std::byte>> out;
  auto add = [&](auto q, index_layout layout) {
    const auto values = gradient<float>(13, 4, test::dist::normal);
    payload p;
    p.layout = layout;
    p.count = 13;
    if (layout == index_layout::sparse) {
      p.dense_size = 40;
      for (std::uint32_t i = 0; i < 13; ++i) p.indices.push_back(3 * i);
    } else {
      p.dense_size = 13;
    }
    q.encode(values, call_id{1, 1, 1}, p);
    std::vector<std::byte> w;
    encode_wire(p, w);
    out.push_back(std::move(w));
  };
  for (index_layout l : {index_layout::sparse, index_layout::dense}) {
    add(identity{}, l);
    add(fp16{}, l);
    add(bf16{}, l);
    add(qsgd(3, 5), l);
    add(terngrad(4), l);
    add(scaled_sign(0), l);
  }
  return out;
}

// decode_wire must throw payload_error and leave `out` as it was, in both forms.
void check_refused(std::span<const std::byte> bytes, const char* what) {
  CAPTURE(what);
  payload out;
  out.dense_size = 77;
  out.count = 1;
  out.indices = {42};
  out.values = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  const auto before = bytes_of(out);
  CHECK_THROWS_AS((void)decode_wire(bytes, out), payload_error);
  CHECK(bytes_of(out) == before);
  CHECK_THROWS_AS((void)decode_wire(bytes), payload_error);
}

}  // namespace

TEST_CASE("bad input: decode_wire refuses every truncation, in both forms") {
  for (const auto& w : sample_encodings()) {
    for (std::size_t len = 0; len < w.size(); ++len) {
      CAPTURE(len);
      check_refused(std::span<const std::byte>(w.data(), len), "truncated");
    }
    CHECK_NOTHROW((void)decode_wire(w));
  }
}

TEST_CASE("bad input: decode_wire refuses unknown versions, quantizers and broken header fields") {
  const auto encodings = sample_encodings();
  for (const auto& good : encodings) {
    auto edit = [&](auto change) {
      auto w = good;
      change(w);
      return w;
    };
    for (std::uint16_t version : {0, 2, 0x100, 0xffff}) {
      CAPTURE(version);
      check_refused(edit([&](auto& w) {
                      w[4] = std::byte(version & 0xff);
                      w[5] = std::byte(version >> 8);
                    }),
                    "unknown version");
    }
    for (unsigned id : {0u, 7u, 200u, 255u}) {
      CAPTURE(id);
      check_refused(edit([&](auto& w) { w[7] = std::byte(id); }), "unknown quantizer");
    }
    check_refused(edit([](auto& w) { w[0] = std::byte{'X'}; }), "bad magic");
    check_refused(edit([](auto& w) { w[6] = std::byte{2}; }), "unknown layout");
    check_refused(edit([](auto& w) { w[8] = std::byte(static_cast<unsigned>(w[8]) + 1u); }),
                  "bits_per_value");
    for (std::size_t k = 9; k < 16; ++k) {
      check_refused(edit([k](auto& w) { w[k] = std::byte{1}; }), "reserved byte");
    }
    check_refused(edit([](auto& w) { w[16 + 4] = std::byte{2}; }), "dense_size > 2^32");
    check_refused(edit([](auto& w) { w[24] = std::byte(static_cast<unsigned>(w[24]) + 1u); }),
                  "count");
    check_refused(edit([](auto& w) { w[28] = std::byte(static_cast<unsigned>(w[28]) + 1u); }),
                  "side_count");
    check_refused(edit([](auto& w) { w[32] = std::byte(static_cast<unsigned>(w[32]) + 1u); }),
                  "params");
    check_refused(std::span<const std::byte>(good.data(), wire_header_bytes - 1), "short header");
    // Trailing bytes: the exact form refuses them; the prefix form stops before them.
    auto longer = good;
    longer.push_back(std::byte{0});
    CHECK_THROWS_AS((void)decode_wire(longer), payload_error);
    payload p;
    CHECK(decode_wire(longer, p) == good.size());
  }
}

TEST_CASE("bad input: decode_wire refuses bad indices and side values in the bytes") {
  // The first sample is a sparse identity payload: indices 0, 3, 6, ... of dense_size 40.
  const auto good = sample_encodings().front();
  auto index_at = [](std::vector<std::byte>& w, std::size_t i, std::uint32_t v) {
    for (unsigned b = 0; b < 4; ++b) w[40 + 4 * i + b] = std::byte((v >> (8 * b)) & 0xffu);
  };
  auto w = good;
  index_at(w, 12, 40);
  check_refused(w, "index == dense_size");
  w = good;
  index_at(w, 1, 0);
  check_refused(w, "duplicate index");
  w = good;
  index_at(w, 1, 9);
  check_refused(w, "unsorted indices");
  w = good;
  index_at(w, 0, 0xffffffffu);
  check_refused(w, "index 2^32 - 1");

  // A qsgd sample (sparse, index 3): side values must be finite and >= 0.
  const auto q = sample_encodings()[3];
  const std::size_t side_at = 40 + 4 * 13;
  for (float bad : {nan_f, inf_f, -1.0f, -inf_f}) {
    auto wq = q;
    std::memcpy(wq.data() + side_at, &bad, 4);
    check_refused(wq, "side value");
  }
}

TEST_CASE("bad input: encode_wire refuses inconsistent payloads and small buffers, output unchanged") {
  primed<c_gaussiank> x;
  for (const mutation& m : payload_mutations()) {
    payload bad = x.p;
    if (!m.apply(bad)) continue;
    // Padding and codes are the decoder's business; the wire carries them as they are. So is
    // another QSGD bucket size that gives the same number of buckets: the payload is still
    // consistent, only a decoder with other settings refuses it.
    if (m.name == "nonzero padding bits" || m.name == "codes above the largest valid one" ||
        m.name == "quantizer bucket size changed")
      continue;
    CAPTURE(m.name);
    std::vector<std::byte> stream{std::byte{9}, std::byte{8}};
    CHECK_THROWS_AS(encode_wire(bad, stream), payload_error);
    CHECK(stream == std::vector<std::byte>{std::byte{9}, std::byte{8}});
    std::vector<std::byte> buf(4096, std::byte{0x5a});
    CHECK_THROWS_AS((void)encode_wire(bad, std::span<std::byte>(buf)), payload_error);
    CHECK(std::all_of(buf.begin(), buf.end(), [](std::byte b) { return b == std::byte{0x5a}; }));
  }
  std::vector<std::byte> small(wire_size(x.p) - 1, std::byte{0x5a});
  CHECK_THROWS_AS((void)encode_wire(x.p, std::span<std::byte>(small)), gradcomp::invalid_argument);
  CHECK(std::all_of(small.begin(), small.end(), [](std::byte b) { return b == std::byte{0x5a}; }));
}

// ---------------------------------------------------------------------------------------
// Feedback policies called directly

TEST_CASE_TEMPLATE("bad input: feedback update, restore and accumulate refuse bad indices and sizes",
                   F, residual, dgc_momentum, no_feedback) {
  const F f{};
  auto st = f.template make_state<float>(20);
  const auto g = gradient<float>(20, 2, test::dist::normal);
  (void)f.accumulate(st, std::span<const float>(g));
  const auto before = state_bytes(st);

  const auto short_g = gradient<float>(19, 2, test::dist::normal);
  CHECK_THROWS_AS((void)f.accumulate(st, std::span<const float>(short_g)), gradcomp::invalid_argument);
  CHECK(state_bytes(st) == before);

  if constexpr (!std::is_same_v<F, no_feedback>) {
    const std::vector<std::uint32_t> out_of_range{1, 5, 20};
    const std::vector<std::uint32_t> ok{1, 5, 19};
    const std::vector<float> three{1.0f, 2.0f, 3.0f};
    const std::vector<float> two{1.0f, 2.0f};
    CHECK_THROWS_AS(f.update(st, out_of_range, three), gradcomp::invalid_argument);
    CHECK_THROWS_AS(f.update(st, ok, two), gradcomp::invalid_argument);
    CHECK_THROWS_AS(f.restore(st, out_of_range, three), gradcomp::invalid_argument);
    CHECK_THROWS_AS(f.restore(st, ok, two), gradcomp::invalid_argument);
    const std::vector<std::uint32_t> huge{0xffffffffu};
    CHECK_THROWS_AS(f.update(st, huge, std::vector<float>{1.0f}), gradcomp::invalid_argument);
    CHECK(state_bytes(st) == before);
  }
}

TEST_CASE("bad input: dgc_momentum settings out of range are refused") {
  for (double m : {-0.1, 1.0, 2.0, nan_d}) {
    CAPTURE(m);
    dgc_momentum f{m, 0.0};
    CHECK_THROWS_AS((void)f.make_state<float>(4), gradcomp::invalid_argument);
  }
  for (double c : {-1.0, nan_d}) {
    CAPTURE(c);
    dgc_momentum f{0.9, c};
    CHECK_THROWS_AS((void)f.make_state<float>(4), gradcomp::invalid_argument);
    // A state made with good settings and then used with bad ones is not touched.
    auto st = dgc_momentum{}.make_state<float>(4);
    const auto before = state_bytes(st);
    const std::vector<float> g{1, 2, 3, 4};
    CHECK_THROWS_AS((void)f.accumulate(st, std::span<const float>(g)), gradcomp::invalid_argument);
    CHECK(state_bytes(st) == before);
  }
}

// ---------------------------------------------------------------------------------------
// sparsified_sgd

namespace {

using gradcomp_test::solo_comm;

using sgd_momentum =
    sparsified_sgd<compressor<topk, qsgd, residual>, sparse_allgather, solo_comm>;

sgd_options momentum_options() {
  sgd_options o;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.seed = 3;
  return o;
}

const std::vector<std::size_t> sgd_layers{30, 0, 45, 1};
constexpr std::size_t sgd_total = 76;

template <class S>
std::string checkpoint_of(const S& s) {
  std::ostringstream os;
  s.save_state(os);
  return os.str();
}

// After three good steps, sgd.step refuses parameters or gradients of the wrong size and
// gradients holding NaN or Inf (in the first tensor, the last one, and the last of the first:
// the check covers all tensors before the first one is compressed); afterwards the step
// counter, feedback, velocity and parameters are byte for byte what they were, and a good
// step still works.
template <class Sgd>
void check_sgd_refuses_bad_steps(Sgd& sgd) {
  std::vector<float> params = gradient<float>(sgd_total, 1, test::dist::normal);
  for (std::uint64_t s = 0; s < 3; ++s) {
    sgd.step(params, gradient<float>(sgd_total, 10 + s, test::dist::normal));
  }
  const std::string state_before = checkpoint_of(sgd);
  const auto params_before = bytes_of(params);
  auto unchanged = [&] {
    CHECK(checkpoint_of(sgd) == state_before);  // step counter, feedback, velocity
    CHECK(bytes_of(params) == params_before);
    CHECK(sgd.steps_done() == 3);
  };
  const auto g = gradient<float>(sgd_total, 20, test::dist::normal);

  for (std::size_t n : {std::size_t{0}, sgd_total - 1, sgd_total + 1}) {
    CAPTURE(n);
    std::vector<float> p2(n, 1.0f);
    const auto p2_before = bytes_of(p2);
    CHECK_THROWS_AS(sgd.step(p2, g), gradcomp::invalid_argument);
    CHECK(bytes_of(p2) == p2_before);
    const auto g2 = gradient<float>(n, 21, test::dist::normal);
    CHECK_THROWS_AS(sgd.step(params, g2), gradcomp::invalid_argument);
    unchanged();
  }
  for (float bad : {nan_f, inf_f, -inf_f}) {
    for (std::size_t at : {std::size_t{0}, std::size_t{29}, std::size_t{75}}) {
      CAPTURE(bad);
      CAPTURE(at);
      auto g2 = g;
      g2[at] = bad;
      CHECK_THROWS_AS(sgd.step(params, g2), nonfinite_error);
      unchanged();
    }
  }
  CHECK_NOTHROW(sgd.step(params, g));
  CHECK(sgd.steps_done() == 4);
}

}  // namespace

TEST_CASE("bad input: sparsified_sgd::step refuses wrong sizes and NaN/Inf, nothing changes") {
  solo_comm comm;
  sgd_momentum sgd(comm, sgd_layers, {}, {}, momentum_options(), density_schedule::constant(0.1));
  check_sgd_refuses_bad_steps(sgd);
}

TEST_CASE("bad input: load_state refuses truncated and mismatched checkpoints, nothing changes") {
  solo_comm comm;
  auto make = [&] {
    return sgd_momentum(comm, sgd_layers, {}, {}, momentum_options(), density_schedule::constant(0.1));
  };
  sgd_momentum source = make();
  std::vector<float> theta(sgd_total, 0.0f);
  for (std::uint64_t s = 0; s < 4; ++s) {
    source.step(theta, gradient<float>(sgd_total, s, test::dist::laplace));
  }
  const std::string good = checkpoint_of(source);

  // The optimizer that must not change: it has a history of its own.
  sgd_momentum target = make();
  std::vector<float> theta2(sgd_total, 1.0f);
  target.step(theta2, gradient<float>(sgd_total, 99, test::dist::normal));
  const std::string before = checkpoint_of(target);
  REQUIRE(before != good);
  auto refused = [&](const std::string& bytes, const char* what) {
    CAPTURE(what);
    std::istringstream is(bytes);
    CHECK_THROWS_AS(target.load_state(is), gradcomp::invalid_argument);
    CHECK(checkpoint_of(target) == before);
  };

  for (std::size_t len = 0; len < good.size(); ++len) {
    CAPTURE(len);
    refused(good.substr(0, len), "truncated");
  }
  auto edit = [&](std::size_t at, std::uint32_t v) {
    std::string b = good;
    std::memcpy(b.data() + at, &v, 4);
    return b;
  };
  refused(edit(0, 0x12345678u), "bad magic");
  refused(edit(4, 2u), "unknown version");
  refused(edit(8, 8u), "element size of double");
  refused(edit(20, 3u), "tensor count");
  refused(edit(24, 17u), "unknown tensor id");
  // Header 24 bytes, then per tensor: id, n (u64), buffer count, buffers.
  const std::size_t second = 24 + 16 + 4 * 30;
  refused(edit(second, 0u), "tensor id twice");
  refused(edit(28, 31u), "tensor size");
  refused(edit(36, 2u), "buffer count");

  // Checkpoints of optimizers set up differently.
  using sgd_plain = sparsified_sgd<compressor<topk, qsgd, residual>, sparse_allgather, solo_comm>;
  sgd_plain no_momentum(comm, sgd_layers, {}, {}, sgd_options{}, density_schedule::constant(0.1));
  refused(std::string(), "empty");
  {
    std::ostringstream os;
    no_momentum.save_state(os);
    refused(os.str(), "no velocity");
  }
  {
    using sgd_double =
        sparsified_sgd<compressor<topk, qsgd, residual, double>, sparse_allgather, solo_comm>;
    sgd_double d(comm, sgd_layers, {}, {}, momentum_options(), density_schedule::constant(0.1));
    std::ostringstream os;
    d.save_state(os);
    refused(os.str(), "double values");
  }
  {
    using sgd_dgc = sparsified_sgd<compressor<topk, qsgd, dgc_momentum>, sparse_allgather, solo_comm>;
    sgd_dgc d(comm, sgd_layers, {}, {}, sgd_options{}, density_schedule::constant(0.1));
    std::ostringstream os;
    d.save_state(os);
    refused(os.str(), "another feedback");
  }
  {
    sgd_momentum other_layers(comm, std::vector<std::size_t>{30, 0, 46, 1}, {}, {},
                              momentum_options(), density_schedule::constant(0.1));
    refused(checkpoint_of(other_layers), "other layer sizes");
  }
  // And the good checkpoint still loads.
  std::istringstream is(good);
  CHECK_NOTHROW(target.load_state(is));
  CHECK(checkpoint_of(target) == good);
}

TEST_CASE("bad input: exchanges refuse a payload that does not fit") {
  // An exchange's output is scratch for the step (sparsified_sgd applies it to the parameters
  // only after every exchange succeeded), so only the exception is checked here.
  using C = compressor<randomk, identity, residual>;
  C c;
  auto st = c.make_state(10);
  payload p;
  c.compress(gradient<float>(10, 1, test::dist::normal), st, {0.5, {}}, p);
  solo_comm comm;
  std::vector<float> out11(11), out10(10);
  CHECK_THROWS_AS((void)dense_allreduce{}.exchange(comm, c, p, std::span<float>(out11)),
                  gradcomp::invalid_argument);
  CHECK_THROWS_AS((void)sparse_allgather{}.exchange(comm, c, p, std::span<float>(out11)),
                  communicator_error);
  for (const mutation& m : payload_mutations()) {
    payload bad = p;
    if (!m.apply(bad)) continue;
    CAPTURE(m.name);
    CHECK_THROWS_AS((void)sparse_allgather{}.exchange(comm, c, bad, std::span<float>(out10)),
                    payload_error);
  }
}

// ---------------------------------------------------------------------------------------
// In-process collectives

TEST_CASE("bad input: in-process worlds of fewer than one rank are refused") {
  for (int ranks : {0, -1, std::numeric_limits<int>::min()}) {
    CAPTURE(ranks);
    CHECK_THROWS_AS(in_process_world{ranks}, gradcomp::invalid_argument);
    bool called = false;
    CHECK_THROWS_AS(run_in_process(ranks, [&](in_process_comm&) { called = true; }),
                    gradcomp::invalid_argument);
    CHECK_FALSE(called);
  }
}

TEST_CASE("bad input: a bad collective argument on one rank: invalid_argument there, "
          "communicator_error elsewhere, no buffer written") {
  constexpr int ranks = 3;
  // What each rank saw: "invalid_argument", "communicator_error", "none" or "other"; a
  // buffer changed before the throw is marked "written" in `marks`.
  auto run = [&](auto call) {
    std::vector<std::string> seen(ranks, "not run");
    try {
      run_in_process(ranks, [&](in_process_comm& c) {
        auto& mine = seen[static_cast<std::size_t>(c.rank())];
        try {
          call(c);
          mine = "none";
        } catch (const gradcomp::invalid_argument&) {
          mine = "invalid_argument";
          throw;
        } catch (const communicator_error&) {
          mine = "communicator_error";
          throw;
        } catch (...) {
          mine = "other";
          throw;
        }
      });
    } catch (const gradcomp::error&) {
    }
    return seen;
  };
  // Runs `collective`; if it throws, checks first that `buf` is byte for byte as before.
  auto guarded = [](std::string& mark, const auto& buf, auto collective) {
    const auto before = bytes_of(buf);
    try {
      collective();
    } catch (...) {
      if (bytes_of(buf) != before) mark = "written";
      throw;
    }
  };
  auto expect_rank1_bad = [](const std::vector<std::string>& seen) {
    CHECK(seen[1] == "invalid_argument");
    CHECK(seen[0] == "communicator_error");
    CHECK(seen[2] == "communicator_error");
  };
  std::vector<std::string> marks(ranks);
  auto mark = [&](in_process_comm& c) -> std::string& { return marks[static_cast<std::size_t>(c.rank())]; };

  SUBCASE("broadcast root out of range") {
    for (int bad_root : {-1, ranks, 1000}) {
      CAPTURE(bad_root);
      std::fill(marks.begin(), marks.end(), std::string());
      auto seen = run([&](in_process_comm& c) {
        std::vector<float> v(8, static_cast<float>(c.rank()));
        guarded(mark(c), v, [&] { c.broadcast(std::span<float>(v), c.rank() == 1 ? bad_root : 0); });
      });
      expect_rank1_bad(seen);
      for (const auto& m : marks) CHECK(m.empty());
    }
  }
  SUBCASE("alltoallv send_counts of the wrong size or sum") {
    for (bool wrong_size : {true, false}) {
      CAPTURE(wrong_size);
      std::fill(marks.begin(), marks.end(), std::string());
      auto seen = run([&](in_process_comm& c) {
        std::vector<float> send(6, 1.0f), recv{7.0f};
        std::vector<std::size_t> counts(3, 2), recv_counts{5};
        if (c.rank() == 1) {
          if (wrong_size) {
            counts.pop_back();
          } else {
            counts[2] = 3;
          }
        }
        guarded(mark(c), recv, [&] {
          c.alltoallv(std::span<const float>(send), std::span<const std::size_t>(counts), recv,
                      recv_counts);
        });
      });
      expect_rank1_bad(seen);
      for (const auto& m : marks) CHECK(m.empty());
    }
  }
  SUBCASE("allgather recv of the wrong size") {
    auto seen = run([&](in_process_comm& c) {
      std::vector<float> send(2, 1.0f), recv(c.rank() == 1 ? 5 : 6, -3.0f);
      guarded(mark(c), recv,
              [&] { c.allgather(std::span<const float>(send), std::span<float>(recv)); });
    });
    expect_rank1_bad(seen);
    for (const auto& m : marks) CHECK(m.empty());
  }
  SUBCASE("allreduce of mismatched sizes, ops or types: communicator_error everywhere") {
    auto sizes = run([&](in_process_comm& c) {
      std::vector<float> v(c.rank() == 2 ? 5 : 4, 1.0f);
      guarded(mark(c), v, [&] { c.allreduce(std::span<float>(v), reduce_op::sum); });
    });
    auto ops = run([&](in_process_comm& c) {
      std::vector<float> v(4, 1.0f);
      guarded(mark(c), v, [&] {
        c.allreduce(std::span<float>(v), c.rank() == 2 ? reduce_op::max : reduce_op::sum);
      });
    });
    auto types = run([&](in_process_comm& c) {
      std::vector<float> f(4, 1.0f);
      std::vector<std::int32_t> i(4, 1);
      if (c.rank() == 2) {
        guarded(mark(c), i, [&] { c.allreduce(std::span<std::int32_t>(i), reduce_op::sum); });
      } else {
        guarded(mark(c), f, [&] { c.allreduce(std::span<float>(f), reduce_op::sum); });
      }
    });
    for (const auto& seen : {sizes, ops, types}) {
      for (const auto& s : seen) CHECK(s == "communicator_error");
    }
    for (const auto& m : marks) CHECK(m.empty());
  }
}

// ---------------------------------------------------------------------------------------
// Selector tunables: refused before anything is written, also through compress()

namespace {

bool contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

// One out-of-range setting of a selector's tunable and the field its message must name.
template <class S>
struct tunable {
  std::string field;
  std::function<void(S&)> set;
};

template <class S, class V>
tunable<S> bad_setting(std::string field, V S::*member, V value) {
  return {std::move(field), [member, value](S& s) { s.*member = value; }};
}

std::vector<tunable<topk>> bad_topk_settings() {
  std::vector<tunable<topk>> v;
  for (double x : {0.0, -1.0, nan_d, inf_d, -inf_d}) {
    v.push_back(bad_setting("sample_scale", &topk::sample_scale, x));
  }
  v.push_back(bad_setting("min_sample", &topk::min_sample, std::size_t{0}));
  v.push_back(bad_setting("min_sample", &topk::min_sample, std::size_t{65537}));  // > max_sample
  v.push_back(bad_setting("min_sample, max_sample", &topk::max_sample, std::size_t{4095}));
  for (double x : {-0.5, nan_d, inf_d}) {
    v.push_back(bad_setting("bracket_sigmas", &topk::bracket_sigmas, x));
  }
  for (double x : {0.0, -2.0, nan_d, inf_d}) {
    v.push_back(bad_setting("candidate_budget_factor", &topk::candidate_budget_factor, x));
  }
  v.push_back(bad_setting("method", &topk::method, static_cast<topk_method>(2)));
  return v;
}

// The exact Top-k inside another selector is checked with it.
template <class S>
std::vector<tunable<S>> bad_exact_settings() {
  std::vector<tunable<S>> v;
  for (const auto& t : bad_topk_settings()) {
    v.push_back({t.field, [set = t.set](S& s) { set(s.exact); }});
  }
  return v;
}

std::vector<tunable<dgc_sampling>> bad_dgc_settings() {
  using S = dgc_sampling;
  std::vector<tunable<S>> v;
  for (double x : {-0.1, 1.5, nan_d, inf_d}) v.push_back(bad_setting("sample_fraction", &S::sample_fraction, x));
  for (double x : {-1.0, nan_d, inf_d}) v.push_back(bad_setting("samples_per_rho", &S::samples_per_rho, x));
  for (double x : {0.5, 0.0, -1.0, nan_d, inf_d}) v.push_back(bad_setting("upper", &S::upper, x));
  for (double x : {-0.1, 1.01, nan_d, inf_d}) v.push_back(bad_setting("lower", &S::lower, x));
  for (double x : {0.0, 1.0, 1.5, -0.5, nan_d}) v.push_back(bad_setting("decay", &S::decay, x));
  v.push_back(bad_setting("max_rounds", &S::max_rounds, 0u));
  for (auto& t : bad_exact_settings<S>()) v.push_back(std::move(t));
  return v;
}

std::vector<tunable<gaussiank>> bad_gaussiank_settings() {
  std::vector<tunable<gaussiank>> v;
  for (double x : {nan_d, inf_d, -inf_d}) {
    v.push_back(bad_setting("collect_margin", &gaussiank::collect_margin, x));
  }
  for (auto& t : bad_exact_settings<gaussiank>()) v.push_back(std::move(t));
  return v;
}

std::vector<tunable<redsync>> bad_redsync_settings() {
  std::vector<tunable<redsync>> v;
  for (double x : {0.0, -1.0, nan_d}) v.push_back(bad_setting("min_interval", &redsync::min_interval, x));
  for (auto& t : bad_exact_settings<redsync>()) v.push_back(std::move(t));
  return v;
}

// compress() with the bad selector: refused before the feedback state or the payload change,
// whether the feedback accumulates inside the selector's scan (residual with topk and
// gaussiank) or before it (dgc_momentum).
template <class C>
void check_compress_refuses(const typename C::selector_type& bad) {
  C good = make_compressor<C>();
  auto st = good.make_state(matrix_n);
  payload p;
  for (std::uint64_t s = 0; s < 2; ++s) good.compress(grad_for<C>(s), st, {0.2, call_id{1, s, 0}}, p);
  const auto st_before = state_bytes(st);
  const auto p_before = bytes_of(p);
  C c(bad, good.quantizer());
  CHECK_THROWS_AS(c.compress(grad_for<C>(9), st, {0.2, call_id{1, 9, 0}}, p), gradcomp::invalid_argument);
  CHECK(state_bytes(st) == st_before);
  CHECK(bytes_of(p) == p_before);
}

template <class S>
void check_refused_settings(const std::vector<tunable<S>>& settings) {
  for (const auto& t : settings) {
    S bad{};
    t.set(bad);
    CAPTURE(t.field);
    std::string what;
    try {
      bad.check();
    } catch (const gradcomp::invalid_argument& e) {
      what = e.what();
    }
    CAPTURE(what);
    CHECK(contains(what, "'" + t.field));
    CHECK(contains(what, "allowed: "));
    for (std::size_t n : {std::size_t{0}, std::size_t{50}, std::size_t{5000}}) {
      CAPTURE(n);
      const auto g = gradient<float>(n, 3, test::dist::normal);
      const auto gd = gradient<double>(n, 3, test::dist::normal);
      const select_context ctx{n / 10, 0.1, call_id{1, 2, 3}};
      std::vector<std::uint32_t> idx{3, 1, 4};
      const auto before = bytes_of(idx);
      CHECK_THROWS_AS((void)bad.select(std::span<const float>(g), ctx, idx), gradcomp::invalid_argument);
      CHECK_THROWS_AS((void)bad.select(std::span<const double>(gd), ctx, idx), gradcomp::invalid_argument);
      CHECK(bytes_of(idx) == before);
      if constexpr (requires(std::span<float> e) { bad.select_accumulate(e, std::span<const float>(g), ctx, idx); }) {
        std::vector<float> e = gradient<float>(n, 4, test::dist::normal);
        const auto e_before = bytes_of(e);
        CHECK_THROWS_AS((void)bad.select_accumulate(std::span<float>(e), std::span<const float>(g), ctx, idx),
                        gradcomp::invalid_argument);
        CHECK(bytes_of(e) == e_before);
        CHECK(bytes_of(idx) == before);
      }
    }
    check_compress_refuses<compressor<S, identity, residual>>(bad);
    check_compress_refuses<compressor<S, qsgd, dgc_momentum>>(bad);
    check_compress_refuses<compressor<S, identity, residual, double>>(bad);
  }
}

// Settings at the edges of the ranges still select, as before.
template <class S>
void check_accepted(const S& s, std::size_t n, std::size_t k) {
  S sel = s;
  CHECK_NOTHROW(sel.check());
  const auto g = gradient<float>(n, 5, test::dist::laplace);
  std::vector<std::uint32_t> idx;
  const selection_stats st = sel.select(std::span<const float>(g), select_context{k, 0.1, call_id{}}, idx);
  CHECK(st.count == idx.size());
  CHECK(std::is_sorted(idx.begin(), idx.end()));
  CHECK(std::adjacent_find(idx.begin(), idx.end()) == idx.end());
  CHECK((idx.empty() || idx.back() < n));
  if constexpr (std::is_same_v<S, topk>) {
    topk plain;
    std::vector<std::uint32_t> want;
    (void)plain.select(std::span<const float>(g), select_context{k, 0.1, call_id{}}, want);
    CHECK(idx == want);  // exact whatever the tunables
  }
}

}  // namespace

TEST_CASE("bad input: topk tunables out of range are refused before anything is written") {
  check_refused_settings(bad_topk_settings());
  const std::size_t n = 1u << 16;
  for (std::size_t k : {std::size_t{10}, std::size_t{100}, std::size_t{5000}}) {
    CAPTURE(k);
    check_accepted(topk{.min_sample = 1, .max_sample = 1}, n, k);
    check_accepted(topk{.method = topk_method::radix}, n, k);
    check_accepted(topk{.sample_scale = 1e-9, .bracket_sigmas = 0.0, .bracket_margin = 0,
                        .candidate_budget_factor = 1e-9, .min_candidate_budget = 0, .heap_max_k = 0},
                   n, k);
    check_accepted(topk{.bracket_margin = std::numeric_limits<std::size_t>::max(),
                        .min_candidate_budget = std::numeric_limits<std::size_t>::max(),
                        .heap_max_k = std::numeric_limits<std::size_t>::max()},
                   n, k);
  }
}

TEST_CASE("bad input: dgc_sampling tunables out of range are refused before anything is written") {
  check_refused_settings(bad_dgc_settings());
  for (std::size_t k : {std::size_t{10}, std::size_t{500}}) {
    CAPTURE(k);
    check_accepted(dgc_sampling{.sample_fraction = 0.0, .samples_per_rho = 0.0, .upper = 1.0,
                                .lower = 0.0, .decay = 1e-9, .max_rounds = 1},
                   50000, k);
    // A huge upper: the survivor buffer is capped at n instead of overflowing size_t.
    check_accepted(dgc_sampling{.sample_fraction = 1.0, .samples_per_rho = 1e300, .upper = 1e300,
                                .lower = 1.0, .decay = 0.999999},
                   50000, k);
  }
}

TEST_CASE("bad input: gaussiank and redsync tunables out of range are refused before anything is "
          "written") {
  check_refused_settings(bad_gaussiank_settings());
  check_refused_settings(bad_redsync_settings());
  for (double m : {-1.0, 0.0, 0.99, 5.0}) {
    CAPTURE(m);
    check_accepted(gaussiank{.collect_margin = m}, 1u << 17, 200);
  }
  check_accepted(redsync{.min_interval = inf_d}, 5000, 50);
}

// ---------------------------------------------------------------------------------------
// gtopk, topk_a2a and auto_exchange, run on in-process ranks

namespace {

// A hang is a failure here too: a run that does not end in time stops the test binary.
template <class Fn>
void within_deadline(Fn&& fn) {
  auto done = std::async(std::launch::async, std::forward<Fn>(fn));
  if (done.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "bad_input_test: an in-process run did not finish within 60 s (deadlock)\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  done.get();
}

std::string kind_of(const std::exception& e) {
  if (dynamic_cast<const communicator_error*>(&e)) return "communicator_error";
  if (dynamic_cast<const nonfinite_error*>(&e)) return "nonfinite_error";
  if (dynamic_cast<const payload_error*>(&e)) return "payload_error";
  if (dynamic_cast<const gradcomp::invalid_argument*>(&e)) return "invalid_argument";
  return "other";
}

// What one rank saw: the exception it ended with ("none" if it returned), its message, and
// whether its output buffer (or its payload) changed before the throw. Ranks record; the test
// thread checks.
struct rank_result {
  std::string kind = "not run";
  std::string what;
  bool written = false;
};

// Runs body(comm, result) on `ranks` in-process ranks, each rank's outcome recorded.
template <class Body>
std::vector<rank_result> run_ranks(int ranks, Body body) {
  std::vector<rank_result> res(static_cast<std::size_t>(ranks));
  within_deadline([&] {
    try {
      run_in_process(ranks, [&](in_process_comm& comm) {
        rank_result& mine = res[static_cast<std::size_t>(comm.rank())];
        try {
          body(comm, mine);
          mine.kind = "none";
        } catch (const std::exception& e) {
          mine.kind = kind_of(e);
          mine.what = e.what();
          throw;
        }
      });
    } catch (const std::exception&) {
    }
  });
  return res;
}

std::vector<std::string> kinds(const std::vector<rank_result>& res) {
  std::vector<std::string> k;
  for (const auto& r : res) k.push_back(r.kind);
  return k;
}

bool any_written(const std::vector<rank_result>& res) {
  return std::any_of(res.begin(), res.end(), [](const rank_result& r) { return r.written; });
}

// An in-process rank's communicator that can corrupt what this rank sends: the byte blocks of
// its allgatherv calls (exchange headers, wire payloads; `call` counts them from 0) and the
// (index, value) pairs of its alltoallv calls (with the count per destination) and of the
// broadcasts it roots. It stands for a rank whose message was corrupted, or that runs another
// gradcomp version. on_received_broadcast edits this rank's copy of a broadcast of pairs it
// did not root: a copy corrupted on its way to this rank only.
struct tamper_comm {
  in_process_comm inner;
  std::function<void(int call, std::vector<std::byte>&)> on_bytes;
  std::function<void(std::vector<index_value>&, std::vector<std::size_t>&)> on_pairs;
  std::function<void(std::span<index_value>)> on_broadcast;
  std::function<void(std::span<index_value>)> on_received_broadcast;
  int byte_calls = 0;

  explicit tamper_comm(in_process_comm c) : inner(c) {}
  int rank() const { return inner.rank(); }
  int size() const { return inner.size(); }
  template <class T>
  void allreduce(std::span<T> v, reduce_op op) {
    inner.allreduce(v, op);
  }
  template <class T>
  void allgatherv(std::span<const T> send, std::vector<T>& recv, std::vector<std::size_t>& counts) {
    if constexpr (std::is_same_v<T, std::byte>) {
      const int call = byte_calls++;
      if (on_bytes) {
        std::vector<std::byte> copy(send.begin(), send.end());
        on_bytes(call, copy);
        inner.allgatherv(std::span<const std::byte>(copy), recv, counts);
        return;
      }
    }
    inner.allgatherv(send, recv, counts);
  }
  template <class T>
  void alltoallv(std::span<const T> send, std::span<const std::size_t> send_counts,
                 std::vector<T>& recv, std::vector<std::size_t>& counts) {
    if constexpr (std::is_same_v<T, index_value>) {
      if (on_pairs) {
        std::vector<index_value> copy(send.begin(), send.end());
        std::vector<std::size_t> c(send_counts.begin(), send_counts.end());
        on_pairs(copy, c);
        inner.alltoallv(std::span<const index_value>(copy), std::span<const std::size_t>(c), recv,
                        counts);
        return;
      }
    }
    inner.alltoallv(send, send_counts, recv, counts);
  }
  template <class T>
  void broadcast(std::span<T> v, int root) {
    if constexpr (std::is_same_v<T, index_value>) {
      if (on_broadcast && root == rank()) on_broadcast(v);
    }
    inner.broadcast(v, root);
    if constexpr (std::is_same_v<T, index_value>) {
      if (on_received_broadcast && root != rank()) on_received_broadcast(v);
    }
  }
  void barrier() { inner.barrier(); }
};
static_assert(communicator<tamper_comm>);

// The exchanges under test; auto_exchange once per forced choice, and once free to choose.
auto_exchange forced(unsigned candidates) {
  auto_options o;
  o.link = link_model{1e-6, 1e-9, 1e-10};
  o.candidates = candidates;
  return auto_exchange(o);
}
struct x_gtopk_tree {
  static gtopk make() { return gtopk(gtopk_values::tree); }
};
struct x_gtopk_exact {
  static gtopk make() { return gtopk(gtopk_values::exact); }
};
struct x_topk_a2a {
  static topk_a2a make() { return topk_a2a{}; }
};
struct x_auto_dense {
  static auto_exchange make() { return forced(exchange_bit(exchange_kind::dense_allreduce)); }
};
struct x_auto_sparse {
  static auto_exchange make() { return forced(exchange_bit(exchange_kind::sparse_allgather)); }
};
struct x_auto_a2a {
  static auto_exchange make() { return forced(exchange_bit(exchange_kind::topk_a2a)); }
};
struct x_auto_gtopk {
  static auto_exchange make() { return forced(exchange_bit(exchange_kind::gtopk)); }
};
struct x_auto_any {
  static auto_exchange make() { return forced(all_exchanges); }
};

#define GRADCOMP_EXCHANGES                                                                   \
  x_gtopk_tree, x_gtopk_exact, x_topk_a2a, x_auto_dense, x_auto_sparse, x_auto_a2a, x_auto_gtopk, \
      x_auto_any

constexpr int x_ranks = 3;
constexpr double x_density = 0.3;

// The exchange as sparsified_sgd calls it (with the picks left out, where it has them).
template <class X, class C, class Comm>
void exchange_once(X& x, Comm& comm, const C& c, const payload& p,
                   std::span<typename C::value_type> out) {
  if constexpr (exchange_with_unused<X, C, Comm>) {
    unused_picks unused;
    (void)x.exchange(comm, c, p, out, unused);
  } else {
    (void)x.exchange(comm, c, p, out);
  }
}

// Every rank compresses a gradient of its own (n elements) and exchanges it into a sentinel-
// filled output; `spoil(rank, payload, out)` may change the payload or output first and
// `setup(comm)` the communicator. Records whether the output changed before a throw.
template <class Xw, class C = c_topk, class Spoil, class Setup>
std::vector<rank_result> exchange_run(std::size_t n, Spoil spoil, Setup setup) {
  using T = typename C::value_type;
  return run_ranks(x_ranks, [&](in_process_comm& ic, rank_result& mine) {
    tamper_comm comm(ic);
    const int r = comm.rank();
    C c = make_compressor<C>();
    auto st = c.make_state(n);
    payload p;
    c.compress(grad_for<C>(100 + static_cast<std::uint64_t>(r), n), st,
               {x_density, call_id{5, 0, 3}}, p);
    std::vector<T> out = sentinel<T>(n);
    spoil(r, p, out);
    setup(comm);
    auto x = Xw::make();
    const auto before = bytes_of(out);
    const payload p_before = p;
    try {
      exchange_once(x, comm, c, p, std::span<T>(out));
    } catch (...) {
      mine.written = bytes_of(out) != before || !(p == p_before);
      throw;
    }
  });
}

const auto no_spoil = [](int, payload&, auto&) {};
const auto no_setup = [](tamper_comm&) {};

const std::vector<std::string> rank1_bad_arg{"communicator_error", "invalid_argument", "communicator_error"};
const std::vector<std::string> rank1_bad_payload{"communicator_error", "payload_error", "communicator_error"};
const std::vector<std::string> rank0_bad_receipt{"payload_error", "communicator_error", "communicator_error"};
const std::vector<std::string> all_comm_error(x_ranks, "communicator_error");
const std::vector<std::string> all_payload_error(x_ranks, "payload_error");
const std::vector<std::string> all_none(x_ranks, "none");

}  // namespace

TEST_CASE_TEMPLATE("bad input: exchanges refuse one rank's bad output size or payload: its own "
                   "error there, communicator_error elsewhere, no output written",
                   X, GRADCOMP_EXCHANGES) {
  // The run itself works: the baseline for every case below.
  CHECK(kinds(exchange_run<X>(matrix_n, no_spoil, no_setup)) == all_none);

  for (std::size_t m : {std::size_t{0}, matrix_n - 1, matrix_n + 1}) {
    CAPTURE(m);
    const auto res = exchange_run<X>(
        matrix_n, [m](int r, payload&, std::vector<float>& out) { if (r == 1) out = sentinel<float>(m); },
        no_setup);
    CHECK(kinds(res) == rank1_bad_arg);
    CHECK(contains(res[1].what, "size()"));  // out.size(), or outs[0].size() for topk_a2a
    CHECK(contains(res[0].what, "rank 1"));
    CHECK_FALSE(any_written(res));
  }
  std::size_t applied = 0;
  for (const mutation& m : payload_mutations()) {
    CAPTURE(m.name);
    bool used = false;
    const auto res = exchange_run<X>(
        matrix_n,
        [&](int r, payload& p, std::vector<float>&) {
          if (r == 1) used = m.apply(p);
        },
        no_setup);
    if (!used) continue;
    ++applied;
    CHECK(kinds(res) == rank1_bad_payload);
    CHECK_FALSE(any_written(res));
  }
  CHECK(applied >= 15);
}

TEST_CASE_TEMPLATE("bad input: exchanges: ranks that disagree on the tensor or the format version "
                   "all throw communicator_error, no output written",
                   X, GRADCOMP_EXCHANGES) {
  SUBCASE("another tensor size on one rank") {
    const auto res = run_ranks(x_ranks, [&](in_process_comm& ic, rank_result& mine) {
      tamper_comm comm(ic);
      const std::size_t n = comm.rank() == 2 ? matrix_n + 1 : matrix_n;
      c_topk c;
      auto st = c.make_state(n);
      payload p;
      c.compress(grad_for<c_topk>(7, n), st, {x_density, {}}, p);
      auto out = sentinel<float>(n);
      const auto before = bytes_of(out);
      auto x = X::make();
      try {
        exchange_once(x, comm, c, p, std::span<float>(out));
      } catch (...) {
        mine.written = bytes_of(out) != before;
        throw;
      }
    });
    CHECK(kinds(res) == all_comm_error);
    CHECK(contains(res[0].what, "dense_size"));
    CHECK_FALSE(any_written(res));
  }
  SUBCASE("an exchange header of another format version, or not a header") {
    struct edit {
      const char* name;
      std::function<void(std::vector<std::byte>&)> apply;
      const char* message;
    };
    const std::vector<edit> edits = {
        {"format version 2", [](auto& h) { h[4] = std::byte{2}; h[5] = std::byte{0}; }, "format version"},
        {"format version 0xffff", [](auto& h) { h[4] = std::byte{0xff}; h[5] = std::byte{0xff}; }, "format version"},
        {"bad magic", [](auto& h) { h[0] = std::byte{'X'}; }, "not an exchange header"},
        {"truncated header", [](auto& h) { h.pop_back(); }, "not an exchange header"},
        {"another exchange id", [](auto& h) { h[6] = std::byte{9}; }, "the exchange"},
        {"another element size", [](auto& h) { h[10] = std::byte{8}; }, "output element"},
    };
    for (const edit& e : edits) {
      CAPTURE(e.name);
      const auto res = exchange_run<X>(matrix_n, no_spoil, [&](tamper_comm& comm) {
        if (comm.rank() == 1) {
          comm.on_bytes = [&](int call, std::vector<std::byte>& b) {
            if (call == 0) e.apply(b);
          };
        }
      });
      CHECK(kinds(res) == all_comm_error);
      CHECK(contains(res[2].what, e.message));
      CHECK_FALSE(any_written(res));
    }
  }
  SUBCASE("k = 0 and empty tensors on every rank are not errors") {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, matrix_n}) {
      CAPTURE(n);
      std::vector<std::vector<float>> outs(x_ranks);
      const auto res = run_ranks(x_ranks, [&](in_process_comm& comm, rank_result&) {
        c_topk c;
        payload p;  // k = 0: no coordinate selected
        p.dense_size = n;
        p.count = 0;
        c.quantizer().encode(std::span<const float>(), call_id{}, p);
        auto out = sentinel<float>(n);
        auto x = X::make();
        exchange_once(x, comm, c, p, std::span<float>(out));
        outs[static_cast<std::size_t>(comm.rank())] = out;
      });
      CHECK(kinds(res) == all_none);
      for (const auto& o : outs) {
        CHECK(o.size() == n);
        CHECK(std::all_of(o.begin(), o.end(), [](float v) { return v == 0.0f; }));
      }
    }
  }
}

TEST_CASE_TEMPLATE("bad input: gtopk refuses corrupt pairs in the tree and in the broadcast, before "
                   "writing its output",
                   X, x_gtopk_tree, x_gtopk_exact, x_auto_gtopk) {
  // Rank 1 sends its picks to rank 0 in the first round of the tree, after a status pair
  // (index 0: fine, 1: a rank below failed). The edits apply to the picks; the last one to the
  // status pair itself.
  struct edit {
    const char* name;
    std::function<void(std::vector<index_value>&)> apply;
    bool status = false;
  };
  const std::vector<edit> pair_edits = {
      {"index == n", [](auto& v) { v.back().index = static_cast<std::uint32_t>(matrix_n); }},
      {"index 2^32 - 1", [](auto& v) { v.front().index = 0xffffffffu; }},
      {"duplicate index", [](auto& v) { v[1].index = v[0].index; }},
      {"unsorted indices", [](auto& v) { std::swap(v[0], v[1]); }},
      {"more than k pairs", [](auto& v) { v.push_back(index_value{v.back().index + 1, 1.0f}); }},
      {"a status pair that is neither 0 nor 1", [](auto& v) { v[0].index = 7; }, true},
  };
  for (const edit& e : pair_edits) {
    CAPTURE(e.name);
    bool applied = false;
    const auto res = exchange_run<X>(matrix_n, no_spoil, [&](tamper_comm& comm) {
      if (comm.rank() != 1) return;
      comm.on_pairs = [&](std::vector<index_value>& v, std::vector<std::size_t>& counts) {
        if (applied || v.size() < 3) return;
        applied = true;
        if (e.status) {
          e.apply(v);
        } else {
          std::vector<index_value> picks(v.begin() + 1, v.end());
          e.apply(picks);
          v.resize(1);
          v.insert(v.end(), picks.begin(), picks.end());
        }
        counts[0] = v.size();
      };
    });
    REQUIRE(applied);
    CHECK(kinds(res) == rank0_bad_receipt);
    CHECK(contains(res[0].what, "rank 1 sent"));
    CHECK_FALSE(any_written(res));
  }
  // Rank 0 broadcasts the global set (the count first): every rank checks it.
  const std::vector<edit> broadcast_edits = {
      {"count > k", [](auto& v) { v[0].index = static_cast<std::uint32_t>(v.size()); }},
      {"index == n", [](auto& v) { v[1].index = static_cast<std::uint32_t>(matrix_n); }},
      {"duplicate index", [](auto& v) { v[2].index = v[1].index; }},
  };
  for (const edit& e : broadcast_edits) {
    CAPTURE(e.name);
    std::vector<index_value> copy;
    const auto res = exchange_run<X>(matrix_n, no_spoil, [&](tamper_comm& comm) {
      if (comm.rank() != 0) return;
      comm.on_broadcast = [&](std::span<index_value> v) {
        copy.assign(v.begin(), v.end());
        e.apply(copy);
        std::copy(copy.begin(), copy.end(), v.begin());
      };
    });
    REQUIRE(copy.size() >= 3);
    CHECK(kinds(res) == all_payload_error);
    CHECK_FALSE(any_written(res));
  }
}

TEST_CASE("bad input: gtopk's exact sums: a broadcast copy corrupted on its way to one rank "
          "fails the exchange on every rank, none left waiting") {
  // Rank 1's own copy of the global set is edited after the broadcast: rank 1 refuses it, and
  // still joins the allreduce of the exact sums (its length k + 1 known to every rank), its
  // refusal counted there, so that ranks 0 and 2 fail with it instead of waiting for it.
  struct edit {
    const char* name;
    std::function<void(std::span<index_value>)> apply;
  };
  const std::vector<edit> edits = {
      {"count > k", [](auto v) { v[0].index = static_cast<std::uint32_t>(v.size()); }},
      {"a failed status", [](auto v) { v[0].value = 1.0f; }},
      {"index == n", [](auto v) { v[1].index = static_cast<std::uint32_t>(matrix_n); }},
      {"duplicate index", [](auto v) { v[2].index = v[1].index; }},
  };
  for (const edit& e : edits) {
    CAPTURE(e.name);
    bool applied = false;
    const auto res = exchange_run<x_gtopk_exact>(matrix_n, no_spoil, [&](tamper_comm& comm) {
      if (comm.rank() != 1) return;
      comm.on_received_broadcast = [&](std::span<index_value> v) {
        REQUIRE(v.size() >= 3);
        e.apply(v);
        applied = true;
      };
    });
    REQUIRE(applied);
    CHECK(kinds(res) == (std::string(e.name) == "a failed status" ? all_comm_error : rank1_bad_payload));
    CHECK(contains(res[0].what, "could not use the broadcast"));
    CHECK(contains(res[2].what, "could not use the broadcast"));
    CHECK_FALSE(any_written(res));
  }
}

TEST_CASE_TEMPLATE("bad input: topk_a2a refuses corrupt pairs at the shard owner, before writing "
                   "its output",
                   X, x_topk_a2a, x_auto_a2a) {
  // Rank 1's pairs for rank 0's shard [0, 32) are the first counts[0] of what it sends.
  struct edit {
    const char* name;
    std::function<void(std::vector<index_value>&)> apply;
  };
  const std::vector<edit> edits = {
      {"index in another shard", [](auto& v) { v[0].index = static_cast<std::uint32_t>(matrix_n - 1); }},
      {"index 2^32 - 1", [](auto& v) { v[1].index = 0xffffffffu; }},
      {"duplicate index", [](auto& v) { v[1].index = v[0].index; }},
      {"unsorted indices", [](auto& v) { std::swap(v[0], v[1]); }},
  };
  for (const edit& e : edits) {
    CAPTURE(e.name);
    bool applied = false;
    const auto res = exchange_run<X>(matrix_n, no_spoil, [&](tamper_comm& comm) {
      if (comm.rank() != 1) return;
      comm.on_pairs = [&](std::vector<index_value>& v, std::vector<std::size_t>& counts) {
        if (counts.at(0) < 2) return;
        applied = true;
        e.apply(v);
      };
    });
    REQUIRE(applied);
    CHECK(kinds(res) == rank0_bad_receipt);
    CHECK(contains(res[0].what, "rank 1 sent index"));
    CHECK_FALSE(any_written(res));
  }
}

TEST_CASE("bad input: auto_exchange over sparse_allgather refuses a corrupt wire payload on every "
          "rank") {
  // The second allgatherv carries the wire payloads (the first, the exchange headers).
  struct edit {
    const char* name;
    std::function<void(std::vector<std::byte>&)> apply;
  };
  auto put_index = [](std::vector<std::byte>& w, std::size_t i, std::uint32_t v) {
    for (unsigned b = 0; b < 4; ++b) w[wire_header_bytes + 4 * i + b] = std::byte((v >> (8 * b)) & 0xffu);
  };
  const std::vector<edit> edits = {
      {"format version 2", [](auto& w) { w[4] = std::byte{2}; }},
      {"truncated", [](auto& w) { w.pop_back(); }},
      {"header only", [](auto& w) { w.resize(wire_header_bytes); }},
      {"one byte too many", [](auto& w) { w.push_back(std::byte{0}); }},
      {"index == dense_size", [&](auto& w) { put_index(w, 0, static_cast<std::uint32_t>(matrix_n)); }},
      {"duplicate index", [&](auto& w) {
         std::uint32_t first = 0;
         std::memcpy(&first, w.data() + wire_header_bytes, 4);
         put_index(w, 1, first);
       }},
  };
  for (const edit& e : edits) {
    CAPTURE(e.name);
    const auto res = exchange_run<x_auto_sparse>(matrix_n, no_spoil, [&](tamper_comm& comm) {
      if (comm.rank() != 1) return;
      comm.on_bytes = [&](int call, std::vector<std::byte>& b) {
        if (call == 1) e.apply(b);
      };
    });
    CHECK(kinds(res) == all_payload_error);
    CHECK(contains(res[0].what, "rank 1"));
  }
}

TEST_CASE("bad input: gtopk, topk_a2a and auto_exchange settings out of range are refused") {
  for (int v : {2, -1, 255}) {
    CAPTURE(v);
    CHECK_THROWS_AS(gtopk(static_cast<gtopk_values>(v)), gradcomp::invalid_argument);
    auto_options o;
    o.gtopk_mode = static_cast<gtopk_values>(v);
    CHECK_THROWS_AS(auto_exchange{o}, gradcomp::invalid_argument);
  }
  for (unsigned mask : {0u, 0x10u, 0xf0u}) {
    CAPTURE(mask);
    auto_options o;
    o.candidates = mask;
    CHECK_THROWS_AS(auto_exchange{o}, gradcomp::invalid_argument);
  }
  for (double bad : {-1.0, nan_d, inf_d}) {
    CAPTURE(bad);
    for (int field = 0; field < 12; ++field) {
      CAPTURE(field);
      link_model l{1e-6, 1e-9, 1e-10, 1e-9, 1e-8, 1e-9, 3e-10, 4e-9, 1 << 20, 1 << 25, 5e-7, 8e-10, 2e-9, 3028.0};
      double* const fields[] = {&l.alpha,       &l.beta,          &l.gamma,      &l.scatter,
                                &l.merge,       &l.merge_log,     &l.gamma_large, &l.scatter_large,
                                &l.pair_alpha,  &l.pair_beta,     &l.dense_beta,  &l.burst_bytes};
      const char* const names[] = {"link.alpha",       "link.beta",          "link.gamma",
                                   "link.scatter",     "link.merge",         "link.merge_log",
                                   "link.gamma_large", "link.scatter_large", "link.pair_alpha",
                                   "link.pair_beta",   "link.dense_beta",    "link.burst_bytes"};
      *fields[field] = bad;
      auto_options o;
      o.link = l;
      std::string what;
      try {
        auto_exchange x(o);
      } catch (const gradcomp::invalid_argument& e) {
        what = e.what();
      }
      std::string quoted(1, '\'');  // link.merge is not link.merge_log
      quoted.append(names[field]).push_back('\'');
      CHECK(contains(what, quoted));
      CHECK(contains(what, "allowed: "));
    }
  }
  {
    auto_options o;
    o.measure.large_bytes = o.measure.small_bytes;
    CHECK_THROWS_AS(auto_exchange{o}, gradcomp::invalid_argument);
    o = auto_options{};
    o.measure.small_repeats = 0;
    CHECK_THROWS_AS(auto_exchange{o}, gradcomp::invalid_argument);
    o = auto_options{};
    o.measure.large_repeats = 0;
    CHECK_THROWS_AS(auto_exchange{o}, gradcomp::invalid_argument);
    // The burst's ping-pongs: at least one each, a pause of 0 to 60 s, the largest above
    // small_bytes and at most ring_max_bytes (which bounds the pause); anything goes when they
    // are off (burst_max_bytes = 0). Each refusal names the option, by auto_exchange and by
    // measure_link.
    for (int which = 0; which < 7; ++which) {
      CAPTURE(which);
      o = auto_options{};
      if (which == 0) o.measure.burst_repeats = 0;
      if (which == 1) o.measure.burst_pause_s = -1e-3;
      if (which == 2) o.measure.burst_pause_s = nan_d;
      if (which == 3) o.measure.burst_pause_s = 61.0;
      if (which == 4) o.measure.burst_max_bytes = 1;
      if (which == 5) o.measure.burst_max_bytes = 8;
      if (which == 6) o.measure.burst_max_bytes = (std::size_t{16} << 20) + 1;
      std::string what;
      try {
        auto_exchange x(o);
      } catch (const gradcomp::invalid_argument& e) {
        what = e.what();
      }
      CHECK(contains(what, which < 4 ? "measure.burst_repeats, measure.burst_pause_s" : "measure.burst_max_bytes"));
      CHECK(contains(what, "allowed: "));
      gradcomp_test::solo_comm comm;
      CHECK_THROWS_AS(measure_link(comm, o.measure), gradcomp::invalid_argument);
      o.measure.burst_max_bytes = 0;
      CHECK_NOTHROW(auto_exchange{o});
    }
    o = auto_options{};
    o.measure.burst_max_bytes = 9;  // just above small_bytes
    CHECK_NOTHROW(auto_exchange{o});
    // The large vector's size must be above the small one's (or 0: one size), in the link
    // and in the measurement's options.
    for (std::size_t large : {std::size_t{1} << 20, std::size_t{1000}}) {
      CAPTURE(large);
      o = auto_options{};
      o.link = link_model{};
      o.link->small_elements = std::size_t{1} << 20;
      o.link->large_elements = large;
      std::string what;
      try {
        auto_exchange x(o);
      } catch (const gradcomp::invalid_argument& e) {
        what = e.what();
      }
      CHECK(contains(what, "link.large_elements"));
      o = auto_options{};
      o.measure.local_elements = std::size_t{1} << 20;
      o.measure.local_large_elements = large;
      what.clear();
      try {
        auto_exchange x(o);
      } catch (const gradcomp::invalid_argument& e) {
        what = e.what();
      }
      CHECK(contains(what, "measure.local_large_elements"));
      gradcomp_test::solo_comm comm;
      CHECK_THROWS_AS(measure_link(comm, o.measure), gradcomp::invalid_argument);
    }
    o = auto_options{};
    o.measure.local_large_elements = 0;  // one size
    CHECK_NOTHROW(auto_exchange{o});
    o = auto_options{};
    o.link = link_model{};  // zeros: a valid (free) link
    CHECK_NOTHROW(auto_exchange{o});
  }
  {
    gradcomp_test::solo_comm comm;
    bool measured = false;
    auto f = [&](std::size_t) {
      measured = true;
      return 1.0;
    };
    CHECK_THROWS_AS(tune_bucket_elements(comm, 0, 10, f), gradcomp::invalid_argument);
    CHECK_THROWS_AS(tune_bucket_elements(comm, 10, 5, f), gradcomp::invalid_argument);
    CHECK_THROWS_AS(tune_bucket_elements(comm, 1, 10, f, 0), gradcomp::invalid_argument);
    CHECK_FALSE(measured);
  }
}

TEST_CASE("bad input: topk_a2a's fused entries refuse lists of mismatched sizes on one rank") {
  // exchange_tensors indexes payloads[t] and stats[t] for every output t, exchange_fused
  // payloads[t]: a short list on rank 1 is its invalid_argument, communicator_error elsewhere.
  for (int which = 0; which < 3; ++which) {
    CAPTURE(which);
    const auto res = run_ranks(x_ranks, [&](in_process_comm& comm, rank_result& mine) {
      c_topk c;
      std::vector<payload> ps(2);
      std::vector<std::vector<float>> bufs;
      for (std::size_t t = 0; t < 2; ++t) {
        auto st = c.make_state(matrix_n);
        c.compress(grad_for<c_topk>(t, matrix_n), st, {x_density, call_id{1, 0, static_cast<std::uint32_t>(t)}}, ps[t]);
        bufs.push_back(sentinel<float>(matrix_n));
      }
      std::vector<std::span<float>> outs{std::span<float>(bufs[0]), std::span<float>(bufs[1])};
      std::vector<exchange_stats> stats(2);
      const bool bad = comm.rank() == 1;
      const auto before0 = bytes_of(bufs[0]);
      const auto before1 = bytes_of(bufs[1]);
      topk_a2a x;
      try {
        if (which == 0) {
          x.exchange_tensors(comm, c, std::span<const payload>(ps).first(bad ? 1 : 2),
                             std::span<const std::span<float>>(outs), std::span<exchange_stats>(stats));
        } else if (which == 1) {
          x.exchange_tensors(comm, c, std::span<const payload>(ps), std::span<const std::span<float>>(outs),
                             std::span<exchange_stats>(stats).first(bad ? 1 : 2));
        } else {
          const payload* pp[] = {&ps[0], &ps[1]};
          (void)x.exchange_fused(comm, c, std::span<const payload* const>(pp, bad ? 1 : 2),
                                 std::span<const std::span<float>>(outs));
        }
      } catch (...) {
        mine.written = bytes_of(bufs[0]) != before0 || bytes_of(bufs[1]) != before1;
        throw;
      }
    });
    CHECK(kinds(res) == rank1_bad_arg);
    CHECK_FALSE(any_written(res));
  }
}

// ---------------------------------------------------------------------------------------
// sparsified_sgd over gtopk, topk_a2a and auto_exchange

namespace {

template <class X, class Comm>
using sgd_over = sparsified_sgd<compressor<topk, qsgd, residual>, decltype(X::make()), Comm>;

// Three ranks take one good step, then a second in which rank 1 fails: a NaN in its gradient
// (nan = true), or the pairs it sends corrupted on the way (nan = false). No rank's parameters
// or step counter change; the failing rank's feedback and velocity do not either.
template <class X>
void check_sgd_step_failure(bool nan) {
  using S = sgd_over<X, tamper_comm>;
  std::vector<reliability::byte_snapshot> params_before(x_ranks), params_after(x_ranks);
  std::vector<std::string> state_before(x_ranks), state_after(x_ranks);
  std::vector<std::uint64_t> steps(x_ranks, 99);
  const auto res = run_ranks(x_ranks, [&](in_process_comm& ic, rank_result&) {
    tamper_comm comm(ic);
    const auto r = static_cast<std::size_t>(comm.rank());
    S sgd(comm, sgd_layers, {}, X::make(), momentum_options(), density_schedule::constant(0.1));
    std::vector<float> params = gradient<float>(sgd_total, 1, test::dist::normal);
    sgd.step(params, gradient<float>(sgd_total, 10 + r, test::dist::normal));
    params_before[r] = bytes_of(params);
    state_before[r] = checkpoint_of(sgd);
    auto g = gradient<float>(sgd_total, 20 + r, test::dist::normal);
    if (r == 1) {
      if (nan) {
        g[40] = nan_f;
      } else {
        comm.on_pairs = [](std::vector<index_value>& v, std::vector<std::size_t>&) {
          for (auto& e : v) e.index = 0xffffffffu;
        };
      }
    }
    auto record = [&] {
      params_after[r] = bytes_of(params);
      state_after[r] = checkpoint_of(sgd);
      steps[r] = sgd.steps_done();
    };
    try {
      sgd.step(params, g);
    } catch (...) {
      record();
      throw;
    }
    record();
  });
  const auto k = kinds(res);
  CAPTURE(k[0]);
  CAPTURE(k[1]);
  CAPTURE(k[2]);
  if (nan) {
    CHECK(k == std::vector<std::string>{"communicator_error", "nonfinite_error", "communicator_error"});
    CHECK(state_after[1] == state_before[1]);
  } else {
    CHECK(std::count(k.begin(), k.end(), "payload_error") >= 1);
    CHECK(std::count(k.begin(), k.end(), "payload_error") +
              std::count(k.begin(), k.end(), "communicator_error") ==
          x_ranks);
  }
  for (std::size_t r = 0; r < x_ranks; ++r) {
    CAPTURE(r);
    CHECK(params_after[r] == params_before[r]);
    CHECK(steps[r] == 1);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("bad input: sparsified_sgd over gtopk, topk_a2a and auto_exchange refuses wrong "
                   "sizes and NaN/Inf, nothing changes",
                   X, GRADCOMP_EXCHANGES) {
  using gradcomp_test::solo_comm;
  solo_comm comm;
  sgd_over<X, solo_comm> sgd(comm, sgd_layers, {}, X::make(), momentum_options(),
                             density_schedule::constant(0.1));
  check_sgd_refuses_bad_steps(sgd);
}

TEST_CASE_TEMPLATE("bad input: sparsified_sgd over gtopk, topk_a2a and auto_exchange: a NaN on one "
                   "rank fails every rank, no parameters change",
                   X, GRADCOMP_EXCHANGES) {
  check_sgd_step_failure<X>(true);
}

TEST_CASE_TEMPLATE("bad input: sparsified_sgd over gtopk and topk_a2a: corrupt pairs from one rank "
                   "fail every rank, no parameters change",
                   X, x_gtopk_tree, x_gtopk_exact, x_topk_a2a, x_auto_a2a, x_auto_gtopk) {
  check_sgd_step_failure<X>(false);
}
