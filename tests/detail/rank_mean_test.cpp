// detail::rank_order_mean (the local work of sparse_allgather and topk_a2a) against the
// textbook sum: zeros, every rank's values added at their indices in rank order, every element
// divided by P. Bit for bit, over output sizes around the region size and beyond the
// streaming-store size, outputs that start off the 16-byte boundary, 1 to 64 ranks, sparse,
// dense and mixed runs, densities on both sides of the touched-only division, and values that
// are not Gaussian (wide exponents, both signs, zeros of both signs, repeated magnitudes).
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include <gradcomp/detail/rank_mean.hpp>

namespace {

using gradcomp::index_value;
using gradcomp::detail::rank_pairs;
using gradcomp::detail::rank_mean_region;
using gradcomp::detail::rank_order_mean;
using gradcomp::detail::stream_min_bytes;
using gradcomp::detail::rank_values;

float odd_value(std::mt19937_64& rng) {
  switch (rng() % 8) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return 3.0f;  // repeated magnitudes: sums that cancel exactly
    case 3: return -3.0f;
    default: {
      const int e = static_cast<int>(rng() % 60) - 30;
      return std::ldexp(static_cast<float>(rng() % 1000 + 1) * (rng() % 2 ? 1.0f : -1.0f), e);
    }
  }
}

// One rank's contribution: indices in [first, first + n) with probability 1 / every, or dense.
struct rank_data {
  bool dense = false;
  std::vector<std::uint32_t> index;
  std::vector<float> value;
};

rank_data make_rank(std::mt19937_64& rng, std::size_t n, std::uint64_t first, std::size_t every,
                    bool dense) {
  rank_data d;
  d.dense = dense;
  for (std::size_t i = 0; i < n; ++i) {
    if (!dense && rng() % every != 0) continue;
    if (!dense) d.index.push_back(static_cast<std::uint32_t>(first + i));
    d.value.push_back(odd_value(rng));
  }
  return d;
}

template <class T>
std::vector<T> textbook(const std::vector<rank_data>& ranks, std::size_t n, std::uint64_t first) {
  std::vector<T> out(n, T(0));
  for (const rank_data& d : ranks) {
    for (std::size_t j = 0; j < d.value.size(); ++j) {
      const std::size_t i = d.dense ? j : static_cast<std::size_t>(d.index[j] - first);
      out[i] += static_cast<T>(d.value[j]);
    }
  }
  const T p = static_cast<T>(ranks.size());
  for (T& x : out) x /= p;
  return out;
}

template <class T>
bool same_bits(std::span<const T> a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

}  // namespace

TEST_CASE_TEMPLATE("rank_order_mean: the textbook rank-order mean, bit for bit", T, float, double) {
  constexpr std::size_t region = rank_mean_region<T>;
  const std::size_t beyond_stream = stream_min_bytes / sizeof(T) + 2 * region + 5;
  std::mt19937_64 rng(42);
  const std::uint64_t first = 1000;
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{17}, region - 1, region,
                              region + 1, 3 * region + 7, (std::size_t{1} << 20) + 3,
                              beyond_stream}) {
    for (const std::size_t ranks : {std::size_t{1}, std::size_t{3}, std::size_t{4}, std::size_t{16},
                                    std::size_t{64}}) {
      // Large outputs with few ranks only: the property is the same, the time is not.
      if (n > region * 20 && ranks > 4) continue;
      // Sparse at 1/1000 (touched-only division), 1/5 (whole-region division), and a dense run
      // among sparse ones.
      for (const int mix : {0, 1, 2}) {
        CAPTURE(n);
        CAPTURE(ranks);
        CAPTURE(mix);
        std::vector<rank_data> data;
        for (std::size_t r = 0; r < ranks; ++r) {
          const bool dense = mix == 2 && r == ranks / 2;
          data.push_back(make_rank(rng, n, first, mix == 0 ? 1000 : 5, dense));
        }
        const std::vector<T> want = textbook<T>(data, n, first);

        std::vector<rank_values> runs;
        for (const rank_data& d : data) {
          runs.push_back({d.index.data(), d.value.data(), d.value.size(), d.dense});
        }
        // Out one element past a 16-byte boundary, filled with garbage that must not survive.
        std::vector<T> storage(n + 1, T(-7.5));
        const std::span<T> out(storage.data() + 1, n);
        std::vector<std::size_t> cursor;
        rank_order_mean<T>(out, first, std::span<const rank_values>(runs), cursor);
        CHECK(same_bits<T>(out, want));
        CHECK(storage[0] == T(-7.5));  // nothing written before out

        if (mix == 2) continue;  // pair runs cannot be dense
        std::vector<std::vector<index_value>> pairs(ranks);
        std::vector<rank_pairs> pruns;
        for (std::size_t r = 0; r < ranks; ++r) {
          for (std::size_t j = 0; j < data[r].index.size(); ++j) {
            pairs[r].push_back(index_value{data[r].index[j], data[r].value[j]});
          }
          pruns.push_back({pairs[r].data(), pairs[r].size()});
        }
        std::vector<T> aligned(n, T(9));
        rank_order_mean<T>(std::span<T>(aligned), first, std::span<const rank_pairs>(pruns), cursor);
        CHECK(same_bits<T>(std::span<const T>(aligned), want));
      }
    }
  }
}

TEST_CASE("rank_order_mean: P that is and is not a power of two divides exactly like x / P") {
  // x * (1 / P) is used for powers of two; it must give x / P for values down to subnormals.
  for (const std::size_t ranks : {std::size_t{2}, std::size_t{3}, std::size_t{8}, std::size_t{7}}) {
    CAPTURE(ranks);
    const std::size_t n = 64;
    std::vector<rank_data> data(ranks);
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t i = 0; i < n; ++i) {
        data[r].index.push_back(static_cast<std::uint32_t>(i));
        // Subnormals, the smallest normals, the largest finite values.
        const float v = i % 3 == 0   ? std::ldexp(1.0f + static_cast<float>(i), -140)
                        : i % 3 == 1 ? std::ldexp(1.0f, -126) * static_cast<float>(i + 1)
                                     : 3.0e38f / static_cast<float>(ranks);
        data[r].value.push_back(r % 2 ? -v : v);
      }
    }
    std::vector<rank_values> runs;
    for (const rank_data& d : data) runs.push_back({d.index.data(), d.value.data(), d.value.size()});
    std::vector<float> out(n);
    std::vector<std::size_t> cursor;
    rank_order_mean<float>(std::span<float>(out), 0, std::span<const rank_values>(runs), cursor);
    CHECK(same_bits<float>(std::span<const float>(out), textbook<float>(data, n, 0)));
  }
}
