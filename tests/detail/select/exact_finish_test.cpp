// detail::kth_largest_key (radix select over a key array) against std::nth_element, and the two
// finishes built on it (keep_top_by_keys, keep_top_of_list) against a stable sort: the same
// k-th key, the same count above it, and the same kept indices (ties to the lower index).
// Sizes 1, 2, around the point where the radix passes stop (1024), odd, and 2^20 + 3; keys
// uniform, all equal, few distinct values (ties across buckets), sharing their top bits (every
// digit needed), and from float and double magnitudes of a heavy-tailed gradient; need at 1,
// the middle and m.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include <gradcomp/detail/select/exact_finish.hpp>

namespace {

namespace gd = gradcomp::detail;

template <class Key>
std::vector<Key> keys_of(int kind, std::size_t m, std::mt19937_64& rng) {
  std::vector<Key> k(m);
  for (Key& x : k) {
    switch (kind) {
      case 0: x = static_cast<Key>(rng()); break;                       // uniform
      case 1: x = Key{12345}; break;                                     // all equal
      case 2: x = static_cast<Key>((rng() % 5) << (sizeof(Key) * 8 - 3)); break;  // 5 values
      case 3: x = static_cast<Key>((Key{0x5a5} << (sizeof(Key) * 8 - 12)) | (rng() % 4096)); break;
      default: {  // magnitudes of a heavy-tailed gradient, as abs keys
        const double v = std::ldexp(static_cast<double>(rng() % 100000 + 1), static_cast<int>(rng() % 30));
        if constexpr (sizeof(Key) == 4) {
          x = gd::abs_key(static_cast<float>(v));
        } else {
          x = gd::abs_key(v);
        }
      }
    }
  }
  return k;
}

template <class Key>
void check_kth(const std::vector<Key>& keys, std::size_t need) {
  std::vector<Key> ref = keys;
  std::nth_element(ref.begin(), ref.begin() + static_cast<std::ptrdiff_t>(need - 1), ref.end(),
                   std::greater<Key>{});
  const Key kth = ref[need - 1];
  std::size_t greater = 0;
  for (const Key k : keys) greater += k > kth;

  std::vector<Key> scratch(keys.size());
  const auto got = gd::kth_largest_key(keys.data(), keys.size(), need, scratch.data());
  CHECK(got.kth == kth);
  CHECK(got.greater == greater);

  // In place (scratch == keys), as keep_top_of_list calls it.
  std::vector<Key> inplace = keys;
  const auto again = gd::kth_largest_key(inplace.data(), inplace.size(), need, inplace.data());
  CHECK(again.kth == kth);
  CHECK(again.greater == greater);
}

template <class Key>
void check_all() {
  std::mt19937_64 rng(42);
  for (const std::size_t m : {std::size_t{1}, std::size_t{2}, std::size_t{1023}, std::size_t{1024},
                              std::size_t{1025}, std::size_t{4097}, std::size_t{(1u << 20) + 3}}) {
    for (int kind = 0; kind < 5; ++kind) {
      CAPTURE(m);
      CAPTURE(kind);
      const std::vector<Key> keys = keys_of<Key>(kind, m, rng);
      for (const std::size_t need : {std::size_t{1}, (m + 1) / 2, m}) {
        CAPTURE(need);
        check_kth(keys, need);
      }
      if (m > 100) check_kth(keys, m / 100 + 1);
    }
  }
}

// The indices a finish must keep: the need largest keys, ties to the lower index, ascending.
std::vector<std::uint32_t> reference_keep(const std::vector<std::uint32_t>& list,
                                          const std::vector<std::uint32_t>& keys, std::size_t need) {
  std::vector<std::size_t> order(list.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return keys[a] > keys[b]; });
  std::vector<std::uint32_t> kept;
  for (std::size_t i = 0; i < need; ++i) kept.push_back(list[order[i]]);
  std::sort(kept.begin(), kept.end());
  return kept;
}

}  // namespace

TEST_CASE("kth_largest_key: the same key and count above it as nth_element, 32-bit keys") {
  check_all<std::uint32_t>();
}

TEST_CASE("kth_largest_key: the same key and count above it as nth_element, 64-bit keys") {
  check_all<std::uint64_t>();
}

TEST_CASE("keep_top_by_keys and keep_top_of_list keep the need largest, ties to the lower index") {
  std::mt19937_64 rng(7);
  for (const std::size_t m : {std::size_t{1}, std::size_t{17}, std::size_t{3000}, std::size_t{200001}}) {
    for (int kind = 0; kind < 5; ++kind) {
      CAPTURE(m);
      CAPTURE(kind);
      // A gradient whose magnitudes are the keys, and a strictly increasing index list into it.
      std::vector<std::uint32_t> list(m);
      std::uint32_t at = 0;
      for (auto& i : list) i = (at += 1 + static_cast<std::uint32_t>(rng() % 3));
      std::vector<float> g(static_cast<std::size_t>(at) + 1, 0.0f);
      std::vector<std::uint32_t> keys(m);
      for (std::size_t i = 0; i < m; ++i) {
        float v = 0.0f;
        switch (kind) {
          case 0: v = static_cast<float>(rng() % 1000000) * 0.001f; break;
          case 1: v = 2.5f; break;
          case 2: v = static_cast<float>(rng() % 4); break;
          case 3: v = 1.0f + static_cast<float>(rng() % 64) * 0x1p-20f; break;
          default: v = std::ldexp(static_cast<float>(rng() % 1000 + 1), static_cast<int>(rng() % 40) - 20);
        }
        g[list[i]] = (rng() % 2) ? v : -v;
        keys[i] = gd::abs_key(g[list[i]]);
      }
      for (const std::size_t need : {std::size_t{1}, (m + 2) / 3, m}) {
        CAPTURE(need);
        const std::vector<std::uint32_t> want = reference_keep(list, keys, need);

        std::vector<std::uint32_t> by_keys = list;
        std::vector<std::uint32_t> sorted(m);
        gd::keep_top_by_keys(std::span(by_keys), keys.data(), need, sorted.data());
        by_keys.resize(need);
        CHECK(by_keys == want);

        std::vector<std::uint32_t> of_list = list;
        gd::uninit_vector<std::uint32_t> scratch;
        gd::keep_top_of_list(std::span<const float>(g), std::span(of_list), need, scratch);
        of_list.resize(need);
        CHECK(of_list == want);
      }
    }
  }
}
