// Checks shared by fast_paths_test.cpp and portable_paths_test.cpp: the fused and sampled
// paths of the selectors must select exactly what their plain forms select.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/context.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/sparse.hpp>
#include <gradcomp/step.hpp>

#include "select_test_inputs.hpp"

namespace gradcomp_test {

inline void check_same_stats(const gradcomp::selection_stats& a,
                             const gradcomp::selection_stats& b) {
  CHECK(a.count == b.count);
  CHECK(a.iterations == b.iterations);
  CHECK(a.fallback == b.fallback);
  if (std::isnan(b.threshold)) {
    CHECK(std::isnan(a.threshold));
  } else {
    CHECK(a.threshold == b.threshold);
  }
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// select_accumulate(e, g) on one copy of the selector against select(e + g) on another: the
// same indices and statistics, and e left holding e + g exactly.
template <class Selector, class T>
gradcomp::selection_stats check_accumulate(const Selector& proto, std::vector<T> e,
                                           const std::vector<T>& g, std::size_t k) {
  std::vector<T> acc(e.size());
  for (std::size_t i = 0; i < e.size(); ++i) acc[i] = e[i] + g[i];
  Selector fused = proto;
  Selector plain = proto;
  const gradcomp::select_context ctx{k, 0.5, {}};
  std::vector<std::uint32_t> got;
  std::vector<std::uint32_t> want;
  const auto sf = fused.select_accumulate(std::span<T>(e), std::span<const T>(g), ctx, got);
  const auto sp = plain.select(std::span<const T>(acc), ctx, want);
  CHECK(got == want);
  check_same_stats(sf, sp);
  CHECK(same_bits(e, acc));
  return sf;
}

template <class Selector, class T>
void accumulate_paths(const Selector& proto) {
  for (std::size_t n : {0, 1, 2, 40, 2048, 2049, 5000, 70001}) {
    for (dist d : all_dists) {
      const auto e = make_input<T>(d, n, 100 + n);
      const auto g = make_input<T>(d, n, 200 + n);
      std::vector<std::size_t> ks = k_values(n);
      for (std::size_t k : {std::size_t{3}, std::size_t{64}, std::size_t{65}}) {
        if (k <= n) ks.push_back(k);
      }
      for (std::size_t k : ks) {
        const std::string dist_name = name(d);
        CAPTURE(dist_name);
        CAPTURE(n);
        CAPTURE(k);
        check_accumulate(proto, e, g, k);
      }
    }
  }
}

// Two configurations of one selector that must agree on every selection.
template <class Selector, class T>
void check_same_selection(Selector a, Selector b, const std::vector<T>& g, std::size_t k) {
  const gradcomp::select_context ctx{k, 0.5, {}};
  std::vector<std::uint32_t> out_a;
  std::vector<std::uint32_t> out_b;
  const auto sa = a.select(std::span<const T>(g), ctx, out_a);
  const auto sb = b.select(std::span<const T>(g), ctx, out_b);
  CHECK(out_a == out_b);
  check_same_stats(sa, sb);
}

// A selector with only select(): compressor<> cannot fuse it and accumulates first.
template <class S>
struct unfused {
  S inner{};
  template <gradcomp::gradient_value T>
  gradcomp::selection_stats select(std::span<const T> g, const gradcomp::select_context& ctx,
                                   std::vector<std::uint32_t>& indices) {
    return inner.select(g, ctx, indices);
  }
};

// compressor<S, Q, residual> (fused) against compressor<unfused<S>, Q, residual> over a few
// steps: identical payloads and feedback state; for fp32 values also the residual law
// acc == decoded + residual, bit for bit.
template <class S, class Q, class T>
void check_fused_step(Q q) {
  for (std::size_t n : {std::size_t{5000}, std::size_t{70001}}) {
    for (double density : {0.001, 0.01, 0.2}) {
      gradcomp::compressor<S, Q, gradcomp::residual, T> fused(S{}, q);
      gradcomp::compressor<unfused<S>, Q, gradcomp::residual, T> plain(unfused<S>{}, q);
      auto sf = fused.make_state(n);
      auto sp = plain.make_state(n);
      gradcomp::payload pf;
      gradcomp::payload pp;
      for (std::uint64_t step = 0; step < 4; ++step) {
        CAPTURE(n);
        CAPTURE(density);
        CAPTURE(step);
        const auto g = make_input<T>(step % 2 ? dist::laplace : dist::normal, n, 40 + step);
        std::vector<T> acc(n);
        for (std::size_t i = 0; i < n; ++i) acc[i] = sf.e[i] + g[i];
        const gradcomp::compress_context ctx{density, {.seed = 5, .step = step}};
        const auto cf = fused.compress(std::span<const T>(g), sf, ctx, pf);
        const auto cp = plain.compress(std::span<const T>(g), sp, ctx, pp);
        CHECK(pf == pp);
        check_same_stats(cf.selection, cp.selection);
        CHECK(same_bits(sf.e, sp.e));
        if constexpr (std::is_same_v<Q, gradcomp::identity>) {
          std::vector<float> decoded(pf.count);
          fused.decode_values(pf, decoded);
          std::vector<T> rebuilt = sf.e;
          for (std::size_t j = 0; j < pf.count; ++j) rebuilt[pf.indices[j]] += static_cast<T>(decoded[j]);
          CHECK(same_bits(rebuilt, acc));  // unsent coordinates: the residual is acc itself
        }
      }
    }
  }
}

}  // namespace gradcomp_test
