// Single-process references for the exchanges: what P ranks' payloads must combine to,
// computed sequentially from the P payloads alone. Shared by the in-process tests
// (tests/exchange/) and the MPI tests (tests/mpi/), so both compare with the same thing.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <gradcomp/exchange/gtopk.hpp>
#include <gradcomp/sparse.hpp>
#include <gradcomp/step.hpp>

#include "data.hpp"

namespace gradcomp_test {

using namespace gradcomp;

// Rank r's payload for a tensor of n elements: a gradient (normal for even ranks, Laplace for
// odd ones, seeded by rank, step and salt), compressed at `density`.
template <class C>
payload payload_for_rank(C c, int rank, std::size_t n, double density, std::uint64_t step = 0,
                         std::uint64_t salt = 0) {
  auto st = c.make_state(n);
  const auto g = gradcomp_test::make_input<typename C::value_type>(rank % 2 ? dist::laplace : dist::normal, n, 1000 * salt + 100 * step + static_cast<std::uint64_t>(rank));
  payload p;
  c.compress(g, st, compress_context{density, call_id{42, step, 9}}, p);
  return p;
}

template <class C>
std::vector<payload> payloads_for(const C& c, int ranks, std::size_t n, double density,
                                  std::uint64_t step = 0, std::uint64_t salt = 0) {
  std::vector<payload> ps;
  for (int r = 0; r < ranks; ++r) ps.push_back(payload_for_rank(c, r, n, density, step, salt));
  return ps;
}

// sparse_allgather, topk_a2a and auto's decoded dense allreduce: the decoded payloads added in
// rank order into zeros (in T), then divided by P.
template <class C>
std::vector<typename C::value_type> reference_mean(const C& c, std::span<const payload> ps,
                                                   std::size_t n) {
  using T = typename C::value_type;
  std::vector<T> sum(n, T(0));
  for (const auto& p : ps) c.decompress(p, sum, decompress_mode::accumulate);
  for (T& x : sum) x /= static_cast<T>(ps.size());
  return sum;
}

// dense_allreduce: the wire values (sum_type) added in rank order in the wire type, then
// decoded and divided by P (or, for fp16, each divided by P before the sum).
template <class C>
std::vector<typename C::value_type> reference_wire_mean(const C& c, std::span<const payload> ps,
                                                        std::size_t n) {
  using T = typename C::value_type;
  using Q = typename C::quantizer_type;
  using W = typename Q::sum_type;
  const auto ranks = static_cast<float>(ps.size());
  std::vector<W> sum;
  for (std::size_t r = 0; r < ps.size(); ++r) {
    const payload& p = ps[r];
    std::vector<float> v(p.count);
    c.decode_values(p, v);
    if (r == 0) sum.resize(p.count);
    for (std::size_t j = 0; j < p.count; ++j) {
      const W w = Q::prescale_before_sum ? W(v[j] / ranks) : W(v[j]);
      sum[j] = r == 0 ? w : static_cast<W>(sum[j] + w);
    }
  }
  std::vector<T> mean(n, T(0));
  const T divisor = Q::prescale_before_sum ? T(1) : static_cast<T>(ps.size());
  for (std::size_t j = 0; j < ps[0].count; ++j) {
    mean[ps[0].index(j)] = static_cast<T>(static_cast<float>(sum[j])) / divisor;
  }
  return mean;
}

// gTop-k, simulated: the same binomial merge tree over the P payloads, sequentially, with a
// map-based merge and a full sort instead of nth_element.
template <class T>
struct gtopk_expected {
  std::vector<T> out;
  std::vector<std::pair<std::uint32_t, float>> global;            // sorted by index
  std::vector<std::vector<std::pair<std::uint32_t, float>>> unused;  // per rank
};

inline bool reference_before(const std::pair<std::uint32_t, float>& a,
                             const std::pair<std::uint32_t, float>& b) {
  const bool an = std::isnan(a.second), bn = std::isnan(b.second);
  if (an != bn) return an;
  if (!an && std::fabs(a.second) != std::fabs(b.second)) return std::fabs(a.second) > std::fabs(b.second);
  return a.first < b.first;
}

template <class C>
gtopk_expected<typename C::value_type> reference_gtopk(const C& c, std::span<const payload> ps,
                                                       std::size_t n, gtopk_values mode) {
  using T = typename C::value_type;
  using set = std::vector<std::pair<std::uint32_t, float>>;
  const std::size_t p = ps.size();
  std::size_t k = 0;
  std::vector<set> sets(p);
  for (std::size_t r = 0; r < p; ++r) {
    k = std::max<std::size_t>(k, ps[r].count);
    std::vector<float> v(ps[r].count);
    c.decode_values(ps[r], v);
    for (std::size_t j = 0; j < ps[r].count; ++j) sets[r].emplace_back(ps[r].index(j), v[j]);
  }
  const std::vector<set> mine = sets;
  auto merge = [k](const set& a, const set& b) {
    std::map<std::uint32_t, float> m;
    for (const auto& [i, v] : a) m[i] = v;
    for (const auto& [i, v] : b) {
      auto it = m.find(i);
      if (it == m.end()) {
        m[i] = v;
      } else {
        it->second = it->second + v;
      }
    }
    set u(m.begin(), m.end());
    if (u.size() > k) {
      std::sort(u.begin(), u.end(), reference_before);
      u.resize(k);
      std::sort(u.begin(), u.end());
    }
    return u;
  };
  for (std::size_t step = 1; step < p; step *= 2) {
    for (std::size_t r = 0; r + step < p; r += 2 * step) sets[r] = merge(sets[r], sets[r + step]);
  }
  gtopk_expected<T> e;
  e.global = sets[0];
  e.out.assign(n, T(0));
  for (const auto& [i, v] : e.global) {
    if (mode == gtopk_values::tree) {
      e.out[i] = static_cast<T>(v) / static_cast<T>(p);
    } else {
      T acc{};
      for (std::size_t r = 0; r < p; ++r) {
        T x = T(0);
        for (const auto& [j, w] : mine[r]) {
          if (j == i) x = static_cast<T>(w);
        }
        acc = r == 0 ? x : static_cast<T>(acc + x);
      }
      e.out[i] = acc / static_cast<T>(p);
    }
  }
  e.unused.resize(p);
  for (std::size_t r = 0; r < p; ++r) {
    for (const auto& pick : mine[r]) {
      const bool global = std::any_of(e.global.begin(), e.global.end(),
                                      [&](const auto& g) { return g.first == pick.first; });
      if (!global) e.unused[r].push_back(pick);
    }
  }
  return e;
}

// Bitwise equality of float/double vectors (NaN == NaN, +0 != -0): what "bit for bit" means.
template <class T>
bool same_bits(std::span<const T> a, std::span<const T> b) {
  using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<U>(a[i]) != std::bit_cast<U>(b[i])) return false;
  }
  return true;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return same_bits(std::span<const T>(a), std::span<const T>(b));
}

// The registry's name (runtime::exchanges) of the exchange a step reports it ran
// (step_stats::exchange: the exchange's own name; 'auto': the one it chose). A reference engine
// configured with it runs, by name, what 'auto' chose in another engine: 'auto' measures its
// link once per engine, so two engines may choose differently, and gtopk gives other bits.
inline std::string registry_exchange_name(std::string_view ran) {
  if (ran == "dense_allreduce") return "allreduce";
  if (ran == "sparse_allgather") return "allgather";
  if (ran == "topk_a2a") return "a2a";
  if (ran == "gtopk") return "gtopk";
  throw std::invalid_argument("registry_exchange_name: no exchange is named '" + std::string(ran) + "'");
}

// Names joined by spaces, for a CAPTURE.
inline std::string joined(const std::vector<std::string>& names) {
  std::string j;
  for (const auto& x : names) j += x + " ";
  return j;
}

// The registry's name of the one exchange every step in `ran` reports it ran; refused
// (std::invalid_argument, naming them) where the steps ran different exchanges or none.
inline std::string registry_exchange_name(const std::vector<std::string>& ran) {
  for (const auto& x : ran) {
    if (x != ran.front()) {
      throw std::invalid_argument("registry_exchange_name: the steps ran different exchanges: " +
                                  joined(ran));
    }
  }
  if (ran.empty()) throw std::invalid_argument("registry_exchange_name: no step ran");
  return registry_exchange_name(ran.front());
}

}  // namespace gradcomp_test
