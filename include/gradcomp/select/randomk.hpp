// gradcomp/select/randomk.hpp: Random-k, k distinct coordinates drawn uniformly at random.
// The draw is a pure function of (seed, step, tensor id, n, k), so every rank selects the
// same indices and the values can be summed by a dense allreduce of k numbers.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/detail/random.hpp>
#include <gradcomp/detail/select/keys.hpp>

namespace gradcomp {

namespace detail {

// Floyd's algorithm draws m distinct values of [0, n) with exactly m random numbers and
// exactly uniform subsets: for j = n-m .. n-1 draw t in [0, j]; take t, or j if t is taken.
// Membership is kept in an open-addressing hash set when m is small against n (memory and
// time O(m), then a sort), and in a bitmap of n bits otherwise (no sort: the bitmap is read
// in order).
class floyd_sampler {
 public:
  // Writes the m drawn values, ascending, to out (m entries).
  void draw(const counter_rng& rng, std::uint64_t n, std::size_t m, std::uint32_t* out) {
    if (use_bitmap(n, m)) {
      draw_bitmap(rng, n, m);
      std::size_t w = 0;
      for_each_bit(n, /*set=*/true,
                   [&](std::uint64_t i) { out[w++] = static_cast<std::uint32_t>(i); });
    } else {
      draw_hashed(rng, n, m, out);
      std::sort(out, out + m);
    }
  }

  // Writes the n - m values NOT drawn, ascending: used when k > n/2, so that only the smaller
  // complement is drawn. `out` holds n - m entries.
  void draw_complement(const counter_rng& rng, std::uint64_t n, std::size_t m, std::uint32_t* out) {
    if (use_bitmap(n, m)) {
      draw_bitmap(rng, n, m);
      std::size_t w = 0;
      for_each_bit(n, /*set=*/false,
                   [&](std::uint64_t i) { out[w++] = static_cast<std::uint32_t>(i); });
    } else {
      std::vector<std::uint32_t> drawn(m);
      draw_hashed(rng, n, m, drawn.data());
      std::sort(drawn.begin(), drawn.end());
      std::size_t w = 0;
      std::size_t d = 0;
      for (std::uint64_t i = 0; i < n; ++i) {
        if (d < m && drawn[d] == i) {
          ++d;
        } else {
          out[w++] = static_cast<std::uint32_t>(i);
        }
      }
    }
  }

 private:
  std::vector<std::uint64_t> table_;  // hash slots (value + 1; 0 = empty) or bitmap words

  // A hash set costs about 16 bytes per drawn value, the bitmap n/8 bytes plus a scan.
  static bool use_bitmap(std::uint64_t n, std::size_t m) { return m * 128 >= n; }

  void draw_bitmap(const counter_rng& rng, std::uint64_t n, std::size_t m) {
    table_.assign(static_cast<std::size_t>((n + 63) / 64), 0);
    std::uint64_t draw = 0;
    for (std::uint64_t j = n - m; j < n; ++j) {
      std::uint64_t t = rng.below(draw++, j + 1);
      if (table_[t >> 6] >> (t & 63) & 1) t = j;
      table_[t >> 6] |= std::uint64_t{1} << (t & 63);
    }
  }

  template <class F>
  void for_each_bit(std::uint64_t n, bool set, F&& f) const {
    const std::size_t words = static_cast<std::size_t>((n + 63) / 64);
    for (std::size_t w = 0; w < words; ++w) {
      std::uint64_t bits = set ? table_[w] : ~table_[w];
      if (w + 1 == words && (n & 63) != 0) bits &= (std::uint64_t{1} << (n & 63)) - 1;
      while (bits != 0) {
        f(std::uint64_t{w} * 64 + static_cast<unsigned>(std::countr_zero(bits)));
        bits &= bits - 1;
      }
    }
  }

  void draw_hashed(const counter_rng& rng, std::uint64_t n, std::size_t m, std::uint32_t* out) {
    const std::size_t slots = std::bit_ceil(std::max<std::size_t>(2 * m, 16));
    table_.assign(slots, 0);
    const std::size_t mask = slots - 1;
    // Inserts v (stored as v + 1); returns false if it was present.
    auto insert = [&](std::uint64_t v) {
      std::size_t h = static_cast<std::size_t>(mix64(v)) & mask;
      while (table_[h] != 0) {
        if (table_[h] == v + 1) return false;
        h = (h + 1) & mask;
      }
      table_[h] = v + 1;
      return true;
    };
    std::uint64_t draw = 0;
    std::size_t w = 0;
    for (std::uint64_t j = n - m; j < n; ++j) {
      std::uint64_t t = rng.below(draw++, j + 1);
      if (!insert(t)) {
        t = j;  // j exceeds every value drawn so far: never present
        insert(t);
      }
      out[w++] = static_cast<std::uint32_t>(t);
    }
  }
};

}  // namespace detail

// Random-k: k distinct indices, uniform over all k-subsets, from the counter-based stream
// stream_key(ctx.id, stream_tag::select). Costs O(k log k) for small k and O(n / 64 + k)
// otherwise; for k > n/2 the n - k left-out indices are drawn instead. stats.threshold = 0.
struct randomk {
  static constexpr bool shared_indices = true;  // same call_id -> same indices on every rank
  detail::floyd_sampler sampler{};              // reused between calls

  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& ctx,
                         std::vector<std::uint32_t>& indices) {
    const std::size_t n = g.size();
    detail::check_index_range("randomk", n);
    check_k("randomk", ctx.k, n);
    const std::size_t k = ctx.k;
    selection_stats st;
    indices.resize(k);
    if (k == 0) return st;
    draw(sampler, n, k, ctx.id, indices.data());
    st.count = k;
    return st;
  }

  // The k indices select() picks from a tensor of n elements (k <= n, checked by the caller),
  // ascending, into out[0, k): a function of (id's seed, step and tensor id, n, k) alone, never
  // of the values, so the device form draws them on the host too (cuda/select.cuh).
  static void draw(detail::floyd_sampler& sampler, std::size_t n, std::size_t k, const call_id& id,
                   std::uint32_t* out) {
    if (k == 0) return;
    const detail::counter_rng rng{detail::stream_key(id, detail::stream_tag::select)};
    if (2 * k <= n) {
      sampler.draw(rng, n, k, out);
    } else {
      sampler.draw_complement(rng, n, n - k, out);
    }
  }
};

static_assert(gradcomp::selector<gradcomp::randomk>);
static_assert(gradcomp::selector<gradcomp::randomk, double>);

}  // namespace gradcomp
