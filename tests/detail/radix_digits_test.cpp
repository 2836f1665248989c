// The per-element math of the device selectors (detail/radix_digits.hpp), checked with the
// host compiler against the host selectors' own loops: digit layout and radix select steps
// against detail::radix_kth_largest, sample positions against for_each_strided, the
// threshold key against key_threshold_above.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <vector>

#include <gradcomp/detail/radix_digits.hpp>
#include <gradcomp/detail/select/keys.hpp>
#include <gradcomp/detail/select/radix_select.hpp>
#include <gradcomp/detail/select/sampling.hpp>
#include <gradcomp/detail/select/scratch.hpp>
#include <gradcomp/detail/select/sources.hpp>

#include "../support/data.hpp"

namespace gd = gradcomp::detail;
using gradcomp_test::dist;

TEST_CASE("radix digit layout: widths add up to the key bits, 11 bits from the top") {
  for (unsigned bits : {8u, 11u, 12u, 22u, 31u, 32u, 63u}) {
    const unsigned passes = gd::radix_passes(bits);
    unsigned total = 0;
    for (unsigned p = 0; p < passes; ++p) {
      const unsigned w = gd::radix_width(bits, p);
      CHECK(w >= 1);
      CHECK(w <= gd::radix_digit_bits);
      CHECK(gd::radix_shift(bits, p) + w + total == bits);
      total += w;
    }
    CHECK(total == bits);
    CHECK(gd::radix_shift(bits, passes - 1) == 0);
  }
  CHECK(gd::radix_passes(31) == 3);
  CHECK(gd::radix_passes(63) == 6);
  CHECK(gd::radix_shift(31, 0) == 20);
  CHECK(gd::radix_width(31, 2) == 9);
  CHECK(gd::radix_width(63, 5) == 8);
  CHECK(gd::radix_fixed_mask<std::uint32_t>(31, 0) == 0x7ff00000u);
  CHECK(gd::radix_fixed_mask<std::uint32_t>(31, 2) == 0x7fffffffu);
  CHECK(gd::radix_fixed_mask<std::uint32_t>(32, 2) == 0xffffffffu);
  CHECK(gd::radix_fixed_mask<std::uint64_t>(63, 5) == 0x7fffffffffffffffull);
  // Digits of all passes reassemble the key.
  for (std::uint32_t key : {0u, 1u, 0x7fffffffu, 0x3f800000u, 0x12345678u}) {
    std::uint32_t back = 0;
    for (unsigned p = 0; p < 3; ++p) {
      back |= gd::radix_pass_digit(key, 31, p) << gd::radix_shift(31, p);
    }
    CHECK(back == key);
  }
}

// The device's radix select, step by step as its kernels do it (histogram of the matching
// keys, pick, narrow), run on the host: must give radix_kth_largest's k-th key and count above.
template <class T>
void check_select_steps(const std::vector<T>& g, std::size_t k) {
  using key = gd::abs_key_t<T>;
  constexpr unsigned bits = gd::abs_key_traits<T>::bits;
  key prefix = 0;
  key mask = 0;
  unsigned long long rank = k;
  unsigned long long above = 0;
  for (unsigned p = 0; p < gd::radix_passes(bits); ++p) {
    std::vector<unsigned long long> hist(std::size_t{1} << gd::radix_digit_bits, 0);
    for (const T x : g) {
      const key kk = gd::abs_key(x);
      if (gd::radix_matches(kk, prefix, mask)) ++hist[gd::radix_pass_digit(kk, bits, p)];
    }
    const unsigned width = gd::radix_width(bits, p);
    const unsigned d = gd::radix_pick_digit(hist.data(), width, rank, above);
    REQUIRE(d < (1u << width));
    prefix = static_cast<key>(prefix | (key{d} << gd::radix_shift(bits, p)));
    mask = gd::radix_fixed_mask<key>(bits, p);
  }
  gd::uninit_vector<key> list;
  const auto ref = gd::radix_kth_largest(std::span<const T>(g), k, list);
  CHECK(prefix == ref.kth);
  CHECK(above == ref.above);
  // rank is now the number of ties at the k-th key that the selection takes.
  CHECK(above + rank == k);
  std::size_t eq = 0;
  for (const T x : g) eq += gd::abs_key(x) == prefix;
  CHECK(rank <= eq);
}

TEST_CASE_TEMPLATE("radix select steps equal radix_kth_largest", T, float, double) {
  for (dist d : gradcomp_test::all_dists) {
    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{4099}}) {
      auto g = gradcomp_test::make_input<T>(d, n, 11);
      if (n > 10) g[n / 2] = std::numeric_limits<T>::quiet_NaN();
      for (std::size_t k : {std::size_t{1}, n / 3 + 1, n}) {
        CAPTURE(n);
        CAPTURE(k);
        check_select_steps(g, std::min(k, n));
      }
    }
  }
}

TEST_CASE("radix_pick_digit reports a rank beyond the counts") {
  std::vector<unsigned> hist(4, 1);
  unsigned long long rank = 5;
  unsigned long long above = 0;
  CHECK(gd::radix_pick_digit(hist.data(), 2, rank, above) == 4u);
}

TEST_CASE("strided_position equals for_each_strided") {
  for (std::size_t n :
       {std::size_t{1}, std::size_t{17}, std::size_t{1000003}, std::size_t{25557032}}) {
    for (std::size_t s : {std::size_t{1}, std::size_t{3}, std::size_t{16}, std::size_t{4096}}) {
      if (s > n) continue;
      std::vector<std::uint64_t> got;
      // A source whose at() reports positions instead of values.
      struct pos_source {
        std::size_t n;
        std::size_t size() const { return n; }
        std::size_t at(std::size_t i) const { return i; }
      };
      gd::for_each_strided(pos_source{n}, s, [&](std::size_t j, std::size_t pos) {
        CHECK(gd::strided_position(j, n, s) == pos);
        got.push_back(pos);
      });
      CHECK(got.size() == s);
    }
  }
  CHECK(gd::strided_position(65535, std::uint64_t{1} << 32, 65536) == (std::uint64_t{65535} << 16));
}

TEST_CASE("classify_bracket and take_class") {
  using C = gd::bracket_class;
  CHECK(gd::classify_bracket(5u, 3u, 7u) == C::candidate);
  CHECK(gd::classify_bracket(3u, 3u, 7u) == C::candidate);
  CHECK(gd::classify_bracket(7u, 3u, 7u) == C::candidate);
  CHECK(gd::classify_bracket(8u, 3u, 7u) == C::sure);
  CHECK(gd::classify_bracket(2u, 3u, 7u) == C::out);
  CHECK(gd::classify_bracket(0u, 0u, 0x7fffffffu) == C::candidate);  // lo = 0: everything
  CHECK(gd::take_class(5u, 4u) == 2u);
  CHECK(gd::take_class(4u, 4u) == 1u);
  CHECK(gd::take_class(3u, 4u) == 0u);
}

template <class T>
void check_threshold_keys() {
  std::vector<double> vs = {-1.0,
                            -0.0,
                            0.0,
                            1e-320,
                            1e-45,
                            1.4e-45,
                            1e-40,
                            1e-30,
                            0.1,
                            1.0 / 3.0,
                            1.0,
                            2.5,
                            1e10,
                            3.4028234663852886e38,
                            3.4028235e38,
                            3.5e38,
                            1e300,
                            std::numeric_limits<double>::max(),
                            std::numeric_limits<double>::infinity()};
  gradcomp_test::splitmix rng{5};
  for (int i = 0; i < 20000; ++i) {
    vs.push_back(std::ldexp(rng.uniform(), static_cast<int>(rng.below(200)) - 100));
  }
  for (int i = 0; i < 2000; ++i) {
    // Exactly representable values and their neighbours.
    const float f = static_cast<float>(rng.normal());
    vs.push_back(static_cast<double>(std::fabs(f)));
    vs.push_back(std::nextafter(static_cast<double>(std::fabs(f)), 0.0));
    vs.push_back(std::nextafter(static_cast<double>(std::fabs(f)), 1.0));
  }
  for (const double v : vs) {
    CAPTURE(v);
    CHECK(gd::key_threshold_above_hd<T>(v) == gd::key_threshold_above<T>(v));
  }
}

TEST_CASE("key_threshold_above_hd equals key_threshold_above") {
  check_threshold_keys<float>();
  check_threshold_keys<double>();
}
