// The host quantizers' bytes are part of their contract: a payload encoded by one build must
// decode, and re-encode, to the same bits in another (ranks of one job may run different
// builds or machines). Two checks:
//  - golden: the FNV-1a hash of every encoder's values and side values, on inputs defined by
//    integer arithmetic alone (portable), equals the hash recorded when the scalar encoders
//    were the only ones (git bfe9e58);
//  - paths: every instruction-set path the host offers (detail::limit_host_isa) gives the
//    same payload bytes and decoded bits as the portable per-element loop, over sizes 0, 1,
//    small, odd and 2^20 + 3, buckets that do and do not divide the vector width, and inputs
//    with zeros, subnormals, NaN, Inf and values near the 16-bit formats' limits.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <gradcomp/detail/host_simd.hpp>
#include <gradcomp/detail/random.hpp>
#include <gradcomp/quantize.hpp>

#include "quantize_test_support.hpp"

namespace {

using gradcomp::payload;
using gradcomp_test::blank;

std::uint64_t fnv1a(std::uint64_t h, const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}

// memcmp of n bytes; empty ranges (whose data() may be null) are equal.
bool same_bytes(const void* a, const void* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

std::uint64_t hash_of(const payload& p) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  h = fnv1a(h, p.values.data(), p.values.size());
  return fnv1a(h, p.side.data(), p.side.size() * sizeof(float));
}

// Values from integer arithmetic only: random sign, exponent and mantissa (magnitudes from
// about 1e-9 to 1e4, heavy-tailed in that sense), and with `special`, one value in 61 taken
// from a list of edge cases.
std::vector<float> test_values(std::size_t n, std::uint64_t seed, bool special) {
  static const std::uint32_t edges[] = {
      0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu,  // zeros, float subnormals
      0x33000000u, 0x33000001u, 0x337fffffu, 0x387fe000u,  // half-subnormal range and ties
      0x38800000u, 0xb8800000u, 0x477fefffu, 0x477ff000u,  // 2^-14, around 65520
      0x7f7fffffu, 0xff7f8000u, 0x7f800000u, 0xff800000u,  // float max, bf16 tie, Inf
      0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fa00000u,  // NaNs, signalling included
      0x3f800000u, 0xbf800000u, 0x38000000u, 0x33800000u,  // 1, -1, 2^-15, 2^-24
  };
  const gradcomp::detail::counter_rng rng{seed};
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t r = rng.bits(i);
    std::uint32_t bits = 0;
    if (special && r % 61 == 0) {
      bits = edges[(r >> 8) % std::size(edges)];
    } else {
      const auto exponent = static_cast<std::uint32_t>(97 + (r >> 8) % 44);  // 2^-30 .. 2^13
      bits = static_cast<std::uint32_t>((r >> 63) << 31) | exponent << 23 |
             static_cast<std::uint32_t>((r >> 20) & 0x7fffffu);
    }
    std::memcpy(&v[i], &bits, 4);
  }
  return v;
}

template <class Q>
payload encoded(const Q& q, const std::vector<float>& v, std::uint64_t step = 3) {
  payload p = blank(v.size());
  q.encode(v, {.seed = 7, .step = step}, p);
  return p;
}

struct golden_case {
  const char* name;
  std::size_t n;
  bool special;
  std::uint64_t hash;
};

template <class Q>
void check_golden(const Q& q, const golden_case& c) {
  CAPTURE(c.name);
  CAPTURE(c.n);
  CAPTURE(c.special);
  const std::uint64_t h = hash_of(encoded(q, test_values(c.n, 11 + c.n, c.special)));
  if (c.hash == 0) MESSAGE(c.name << " n=" << c.n << " special=" << c.special << " 0x" << std::hex << h);
  CHECK(h == c.hash);
}

template <class Q>
void check_paths(const Q& q, std::size_t n, bool special) {
  namespace d = gradcomp::detail;
  CAPTURE(n);
  CAPTURE(special);
  const std::vector<float> v = test_values(n, 101 + n, special);
  const d::host_isa before = d::limit_host_isa(d::host_isa::portable);
  const payload ref = encoded(q, v);
  std::vector<float> ref_out(n, 1.0f);
  q.decode(ref, ref_out);
  for (const d::host_isa isa : {d::host_isa::baseline, d::host_isa::avx2, d::host_isa::avx512}) {
    d::limit_host_isa(isa);
    CAPTURE(static_cast<int>(d::active_host_isa()));
    const payload p = encoded(q, v);
    CHECK(p.values == ref.values);
    REQUIRE(p.side.size() == ref.side.size());
    CHECK(same_bytes(p.side.data(), ref.side.data(), p.side.size() * sizeof(float)));
    std::vector<float> out(n, 2.0f);
    q.decode(p, out);
    CHECK(same_bytes(out.data(), ref_out.data(), n * sizeof(float)));
  }
  d::limit_host_isa(before);
}

// Sets the ISA limit to portable and, on x86, remembers MXCSR; puts both back when it goes
// out of scope (also when a REQUIRE throws). `csr` is the caller's MXCSR, for setting FTZ and
// DAZ on top of it (set_flush).
struct isa_and_mxcsr {
  gradcomp::detail::host_isa isa = gradcomp::detail::limit_host_isa(gradcomp::detail::host_isa::portable);
#if defined(__x86_64__) || defined(__i386__)
  unsigned csr = _mm_getcsr();
  ~isa_and_mxcsr() {
    _mm_setcsr(csr);
    gradcomp::detail::limit_host_isa(isa);
  }
#else
  ~isa_and_mxcsr() { gradcomp::detail::limit_host_isa(isa); }
#endif
  // MXCSR as the caller had it, with FTZ and DAZ set when `flush`; false (nothing set) where
  // there is no MXCSR to set them in and `flush` is asked for.
  bool set_flush(bool flush) const {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(flush ? csr | 0x8040u : csr);
    return true;
#else
    return !flush;
#endif
  }
  isa_and_mxcsr() = default;
  isa_and_mxcsr(const isa_and_mxcsr&) = delete;
  isa_and_mxcsr& operator=(const isa_and_mxcsr&) = delete;
};

template <class Q>
void check_all_paths(const Q& q) {
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16},
                              std::size_t{17}, std::size_t{100}, std::size_t{1000},
                              std::size_t{4099}, (std::size_t{1} << 20) + 3}) {
    check_paths(q, n, false);
    check_paths(q, n, true);
  }
}

}  // namespace

TEST_CASE("same bits: every encoder's bytes equal those recorded before the vector paths") {
  using namespace gradcomp;
  // Hashes recorded with the scalar encoders (every path must reproduce them).
  const golden_case cases[] = {
#include "same_bits_golden.inc"
  };
  for (const golden_case& c : cases) {
    const std::string name = c.name;
    if (name == "fp16") check_golden(fp16{}, c);
    else if (name == "bf16") check_golden(bf16{}, c);
    else if (name == "identity") check_golden(identity{}, c);
    else if (name == "qsgd4") check_golden(qsgd::with_bits(4), c);
    else if (name == "qsgd2") check_golden(qsgd::with_bits(2), c);
    else if (name == "qsgd8_b64") check_golden(qsgd::with_bits(8, 64), c);
    else if (name == "qsgd3_b100") check_golden(qsgd(3, 100), c);
    else if (name == "terngrad") check_golden(terngrad{}, c);
    else if (name == "terngrad_b512") check_golden(terngrad{512}, c);
    else if (name == "terngrad_b100") check_golden(terngrad{100}, c);
    else if (name == "scaled_sign") check_golden(scaled_sign{}, c);
    else if (name == "scaled_sign_b512") check_golden(scaled_sign{512}, c);
    else if (name == "scaled_sign_b100") check_golden(scaled_sign{100}, c);
    else FAIL("unknown case ", name);
  }
}

TEST_CASE("same bits: every instruction-set path equals the portable loop") {
  using namespace gradcomp;
  SUBCASE("fp16") { check_all_paths(fp16{}); }
  SUBCASE("bf16") { check_all_paths(bf16{}); }
  SUBCASE("qsgd 4 bits") { check_all_paths(qsgd::with_bits(4)); }
  SUBCASE("qsgd 2 bits, bucket 48") { check_all_paths(qsgd::with_bits(2, 48)); }
  SUBCASE("qsgd 8 bits, bucket 100") { check_all_paths(qsgd::with_bits(8, 100)); }
  SUBCASE("qsgd 3 levels (3 bits)") { check_all_paths(qsgd(3, 512)); }
  SUBCASE("terngrad") { check_all_paths(terngrad{}); }
  SUBCASE("terngrad, bucket 64") { check_all_paths(terngrad{64}); }
  SUBCASE("terngrad, bucket 100") { check_all_paths(terngrad{100}); }
  SUBCASE("scaled_sign") { check_all_paths(scaled_sign{}); }
  SUBCASE("scaled_sign, bucket 512") { check_all_paths(scaled_sign{512}); }
  SUBCASE("scaled_sign, bucket 100") { check_all_paths(scaled_sign{100}); }
  // Buckets of several summation leaves (2048 values each), whose signs the vector paths
  // write group by group as the sum goes: 10 leaves, a group of 8 and 2 alone.
  SUBCASE("scaled_sign, bucket 20480") { check_all_paths(scaled_sign{20480}); }
}

// fp16's AVX2 and AVX-512 encoders use the CPU's conversion (detail::half_encode_hardware);
// float_to_half_bits is the reference for every 1021st float bit pattern (Inf, NaNs,
// subnormals, values beyond 65504 included), with MXCSR's flush-to-zero and
// denormals-are-zero clear and set. (All 2^32 patterns were compared once, by hand: equal.)
TEST_CASE("same bits: fp16's encoder on every path over the float bit patterns, FTZ and DAZ too") {
  namespace d = gradcomp::detail;
  const std::size_t stride = 1021;
  std::vector<float> v;
  v.reserve(static_cast<std::size_t>((std::uint64_t{1} << 32) / stride + 8));
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += stride) {
    const auto bits = static_cast<std::uint32_t>(u);
    float f = 0.0f;
    std::memcpy(&f, &bits, 4);
    v.push_back(f);
  }
  for (const std::uint32_t bits : {0x477fefffu, 0x477ff000u, 0xc77ff000u, 0x7f7fffffu, 0x33000000u,
                                   0x33000001u, 0x387fe000u, 0x7fa00001u}) {
    float f = 0.0f;
    std::memcpy(&f, &bits, 4);
    v.push_back(f);
  }
  std::vector<std::uint16_t> ref(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) ref[i] = d::float_to_half_bits(v[i]);
  const isa_and_mxcsr saved;  // restored also when a REQUIRE below throws
  for (const bool flush : {false, true}) {
    if (!saved.set_flush(flush)) continue;
    for (const d::host_isa isa : {d::host_isa::portable, d::host_isa::baseline, d::host_isa::avx2,
                                  d::host_isa::avx512}) {
      d::limit_host_isa(isa);
      CAPTURE(flush);
      CAPTURE(static_cast<int>(d::active_host_isa()));
      payload p = blank(v.size());
      gradcomp::fp16{}.encode(v, {}, p);
      REQUIRE(p.values.size() == 2 * v.size());
      std::size_t mismatches = 0;
      for (std::size_t i = 0; i < v.size(); ++i) {
        std::uint16_t h = 0;
        std::memcpy(&h, p.values.data() + 2 * i, 2);
        mismatches += h != ref[i] ? 1 : 0;
      }
      CHECK(mismatches == 0);
    }
  }
}

// TernGrad's encoder has a loop of its own on AVX-512 with BMI2 (detail::terngrad_encode_hardware),
// which the avx512 limit above runs in place of the generic AVX-512 clone, and one on AVX2 with
// BMI2 (detail::avx2::terngrad_chunks). Here the portable loop, those loops and the generic
// clone (called directly) are compared with MXCSR's
// flush-to-zero and denormals-are-zero clear and set, on inputs that include a bucket whose
// max is a subnormal (a zero max under DAZ) and buckets of subnormals among normal values.
TEST_CASE("same bits: TernGrad's AVX-512 and AVX2 loops, the generic clone and the portable loop, FTZ and DAZ too") {
  namespace d = gradcomp::detail;
#if GRADCOMP_HOST_DISPATCH
  const bool own_loop = d::detected_host_isa() == d::host_isa::avx512 && d::cpu_has_bmi2();
#else
  const bool own_loop = false;
#endif
  if (!own_loop) MESSAGE("this CPU or build has no AVX-512 with BMI2: TernGrad's own loop is not run here");
  const isa_and_mxcsr saved;
  const gradcomp::call_id call{.seed = 7, .step = 3};
  for (const std::size_t n : {std::size_t{0}, std::size_t{5}, std::size_t{1000}, std::size_t{4099},
                              (std::size_t{1} << 16) + 5}) {
    std::vector<float> v = test_values(n, 303 + n, true);
    // Bucket 1 (of 64 values) all subnormal, and every 7th value of bucket 3 subnormal.
    for (std::size_t i = 64; i < 128 && i < n; ++i) {
      const auto bits = static_cast<std::uint32_t>(((i & 1u) << 31) | (1u + 4099u * i) % 0x7fffffu);
      std::memcpy(&v[i], &bits, 4);
    }
    for (std::size_t i = 192; i < 256 && i < n; i += 7) {
      const std::uint32_t bits = 0x00012345u + static_cast<std::uint32_t>(i);
      std::memcpy(&v[i], &bits, 4);
    }
    for (const unsigned bucket : {0u, 64u}) {
      const gradcomp::terngrad q(bucket);
      for (const bool flush : {false, true}) {
        if (!saved.set_flush(flush)) continue;
        CAPTURE(n);
        CAPTURE(bucket);
        CAPTURE(flush);
        d::limit_host_isa(d::host_isa::portable);
        payload ref = blank(n);
        q.encode(v, call, ref);
        // The AVX-512 loop, then the AVX2 one (detail/host_simd/draws_avx2.hpp).
        payload p = blank(n);
        for (const d::host_isa isa : {d::host_isa::avx2, d::host_isa::avx512}) {
          d::limit_host_isa(isa);
          CAPTURE(static_cast<int>(d::active_host_isa()));
          p = blank(n);
          q.encode(v, call, p);
          CHECK(p.values == ref.values);
          REQUIRE(p.side.size() == ref.side.size());
          CHECK(same_bytes(p.side.data(), ref.side.data(), p.side.size() * sizeof(float)));
        }
#if GRADCOMP_VECTOR_EXTENSIONS
        // The generic clone of the active path, as encode() ran it before the loop of its own.
        std::fill(p.values.begin(), p.values.end(), std::byte{0xff});
        std::fill(p.side.begin(), p.side.end(), -1.0f);
        const std::size_t b = bucket == 0 ? n + 1 : bucket;
        const d::counter_rng rng{d::stream_key(call, d::stream_tag::quantize)};
        if (d::encode_vector(v.data(), n, b, 2, p.values.data(), p.side.data(),
                             d::simd16::terngrad_codec{rng})) {
          CHECK(p.values == ref.values);
          CHECK(same_bytes(p.side.data(), ref.side.data(), p.side.size() * sizeof(float)));
        }
#endif
      }
    }
  }
}

TEST_CASE("same bits: the ISA limit is a limit, and reports what runs") {
  namespace d = gradcomp::detail;
  const d::host_isa before = d::limit_host_isa(d::host_isa::portable);
  CHECK(d::active_host_isa() == d::host_isa::portable);
  d::limit_host_isa(d::host_isa::avx512);
  CHECK(d::active_host_isa() == d::detected_host_isa());
  CHECK(d::host_isa_name(d::host_isa::avx2) == std::string("avx2"));
  d::limit_host_isa(before);
}
