// detail/gtopk_merge.hpp: the per-pick steps of the device's gTop-k merge
// (cuda/kernels/gtopk_kernels.cuh), run here on the host in the device's order of work: every
// pick of both sets placed by gtopk_merge_slot, the union sorted by gtopk_order_key, the first
// min(k, distinct) kept and sorted by index. The result must be the host's merge
// (detail::gtopk_merge) bit for bit, on sets of size 0, 1, small, odd and 2^20 + 1, with ties
// in |value|, signed zeros, values that overflow when added, Inf and NaN.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gradcomp/detail/gtopk_merge.hpp>
#include <gradcomp/exchange/gtopk.hpp>

namespace {

using gradcomp::index_value;
namespace d = gradcomp::detail;

// n distinct indices below `range`, ascending, with values of the given kind: 0 uniform,
// 1 multiples of 1/4 in [-2, 2] (many ties and signed zeros), 2 with large values, Inf and NaN.
std::vector<index_value> random_set(std::mt19937& rng, std::size_t n, std::uint32_t range, int kind) {
  std::vector<std::uint32_t> idx;
  if (n * 2 >= range) {
    std::vector<std::uint32_t> all(range);
    for (std::uint32_t i = 0; i < range; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    idx.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(n, range)));
  } else {
    std::uniform_int_distribution<std::uint32_t> pick(0, range - 1);
    std::vector<bool> used(range, false);
    while (idx.size() < n) {
      const std::uint32_t i = pick(rng);
      if (!used[i]) {
        used[i] = true;
        idx.push_back(i);
      }
    }
  }
  std::sort(idx.begin(), idx.end());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> q(-8, 8), special(0, 9);
  std::vector<index_value> out(idx.size());
  for (std::size_t j = 0; j < idx.size(); ++j) {
    float v = u(rng);
    if (kind == 1) v = static_cast<float>(q(rng)) / 4.0f;
    if (kind == 1 && v == 0.0f && (j % 2) == 1) v = -0.0f;
    if (kind == 2) {
      switch (special(rng)) {
        case 0: v = 3e38f; break;
        case 1: v = -3e38f; break;
        case 2: v = std::numeric_limits<float>::infinity(); break;
        case 3: v = std::nanf(""); break;
        default: break;
      }
    }
    out[j] = index_value{idx[j], v};
  }
  return out;
}

// The device's merge of a and b, step for step, on the host.
std::vector<index_value> device_merge(const std::vector<index_value>& a,
                                      const std::vector<index_value>& b, std::size_t k) {
  const auto split = [](const std::vector<index_value>& x, std::vector<std::uint32_t>& idx,
                        std::vector<std::uint32_t>& val) {
    for (const index_value& e : x) {
      idx.push_back(e.index);
      val.push_back(d::float_to_bits(e.value));
    }
  };
  std::vector<std::uint32_t> ai, av, bi, bv;
  split(a, ai, av);
  split(b, bi, bv);
  const std::size_t len = a.size() + b.size();
  struct slot {
    std::uint64_t key;
    std::uint32_t value;
  };
  std::vector<slot> u(len, slot{0, 0});
  std::vector<int> written(len, 0);
  std::size_t dups = 0;
  const auto place = [&](const std::vector<std::uint32_t>& mi, const std::vector<std::uint32_t>& mv,
                         const std::vector<std::uint32_t>& oi, const std::vector<std::uint32_t>& ov,
                         bool from_b) {
    for (std::uint32_t j = 0; j < mi.size(); ++j) {
      const d::gtopk_union_slot s =
          d::gtopk_merge_slot(j, mi[j], d::bits_to_float(mv[j]), oi.data(), ov.data(),
                              static_cast<std::uint32_t>(oi.size()), from_b);
      REQUIRE(s.at < len);
      u[s.at] = slot{s.key, s.value};
      ++written[s.at];
      if (s.hole) ++dups;
    }
  };
  place(ai, av, bi, bv, false);
  place(bi, bv, ai, av, true);
  // Every slot of the union written once: the placement is a permutation.
  CHECK(std::count(written.begin(), written.end(), 1) == static_cast<std::ptrdiff_t>(len));
  std::stable_sort(u.begin(), u.end(), [](const slot& x, const slot& y) { return x.key < y.key; });
  const std::size_t kept = std::min(k, len - dups);
  std::vector<index_value> out;
  for (std::size_t j = 0; j < kept; ++j) {
    REQUIRE(u[j].key != d::gtopk_hole_key);
    out.push_back(index_value{static_cast<std::uint32_t>(u[j].key), d::bits_to_float(u[j].value)});
  }
  std::sort(out.begin(), out.end(),
            [](const index_value& x, const index_value& y) { return x.index < y.index; });
  return out;
}

void check_same(const std::vector<index_value>& a, const std::vector<index_value>& b, std::size_t k) {
  std::vector<index_value> host;
  d::gtopk_merge(a, b, k, host);
  const std::vector<index_value> dev = device_merge(a, b, k);
  REQUIRE(dev.size() == host.size());
  for (std::size_t j = 0; j < dev.size(); ++j) {
    CAPTURE(j);
    REQUIRE(dev[j].index == host[j].index);
    REQUIRE(d::float_to_bits(dev[j].value) == d::float_to_bits(host[j].value));
  }
}

}  // namespace

TEST_CASE("gtopk device merge steps: the host's merge bit for bit") {
  std::mt19937 rng(20261207);
  const std::size_t sizes[] = {0, 1, 2, 7, 100, 1001};
  for (const int kind : {0, 1, 2}) {
    for (const std::size_t na : sizes) {
      for (const std::size_t nb : sizes) {
        for (const std::uint32_t range : {std::uint32_t{2048}, std::uint32_t{3000000}}) {
          if (na > range || nb > range) continue;
          CAPTURE(kind);
          CAPTURE(na);
          CAPTURE(nb);
          CAPTURE(range);
          const auto a = random_set(rng, na, range, kind);
          const auto b = random_set(rng, nb, range, kind);
          const std::size_t most = std::max(na, nb);
          for (const std::size_t k : {most, most / 2 + 1, na + nb, std::size_t{1}}) {
            CAPTURE(k);
            check_same(a, b, k);
          }
        }
      }
    }
  }
}

TEST_CASE("gtopk device merge steps: 2^20 + 1 picks each, half of them shared") {
  std::mt19937 rng(7);
  const std::size_t n = (std::size_t{1} << 20) + 1;
  const auto a = random_set(rng, n, 3 * static_cast<std::uint32_t>(n) / 2, 1);
  const auto b = random_set(rng, n, 3 * static_cast<std::uint32_t>(n) / 2, 0);
  check_same(a, b, n);
}

TEST_CASE("gtopk device merge steps: the order keys are gtopk_before's") {
  const float values[] = {0.0f, -0.0f, 1.0f, -1.0f, 0.5f, 3e38f, -3e38f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), std::nanf(""), -std::nanf(""),
                          std::numeric_limits<float>::denorm_min()};
  for (std::uint32_t i = 0; i < 4; ++i) {
    for (const float x : values) {
      for (std::uint32_t j = 0; j < 4; ++j) {
        for (const float y : values) {
          if (i == j) continue;
          const index_value a{i, x}, b{j, y};
          CAPTURE(x);
          CAPTURE(y);
          CHECK((d::gtopk_order_key(i, x) < d::gtopk_order_key(j, y)) == d::gtopk_before(a, b));
        }
      }
    }
  }
  // A NaN's payload does not order it: ties between NaNs go to the lower index.
  std::uint32_t other_nan = 0x7fc00123u;
  float payload_nan = 0.0f;
  std::memcpy(&payload_nan, &other_nan, sizeof(float));
  CHECK(d::gtopk_order_key(1, payload_nan) < d::gtopk_order_key(2, std::nanf("")));
}

TEST_CASE("gtopk device merge steps: segments and searches") {
  // Three tensors, the middle one empty: slots 0..2, none, 3..4.
  const std::uint64_t at[] = {0, 3, 3, 5};
  CHECK(d::segment_of(at, 3, 0) == 0);
  CHECK(d::segment_of(at, 3, 2) == 0);
  CHECK(d::segment_of(at, 3, 3) == 2);
  CHECK(d::segment_of(at, 3, 4) == 2);
  const std::uint32_t x[] = {2, 5, 9};
  CHECK(d::find_sorted(x, 3, 5) == 1);
  CHECK(d::find_sorted(x, 3, 6) == 3);
  CHECK(d::find_sorted(x, 0, 5) == 0);
  CHECK(d::count_below(x, 3, 5, false) == 1);
  CHECK(d::count_below(x, 3, 5, true) == 2);
}
