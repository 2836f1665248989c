// gradcomp/feedback/dgc_momentum.hpp: Deep Gradient Compression's momentum correction.
// u = m u + g; v = v + u; v is compressed; at the sent coordinates v keeps only the
// quantization error and u is zeroed (momentum factor masking). Optional local gradient
// clipping by L2 norm before accumulation.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/energy.hpp>
#include <gradcomp/feedback/common.hpp>

namespace gradcomp {

struct dgc_momentum {
  double momentum = 0.9;  // m, in [0, 1)
  double clip_norm = 0.0;  // clip ||g||_2 to this before accumulating; 0 disables

  // DGC applies momentum before compression, so the optimizer must not apply it again.
  static constexpr bool applies_momentum = true;

  template <gradient_value T>
  struct state {
    std::vector<T> u;  // momentum
    std::vector<T> v;  // accumulated velocity, the vector compressed
    std::vector<std::span<T>> buffers() { return {std::span<T>(u), std::span<T>(v)}; }
  };

  template <gradient_value T>
  state<T> make_state(std::size_t n) const {
    check();
    return state<T>{std::vector<T>(n, T(0)), std::vector<T>(n, T(0))};
  }

  template <gradient_value T>
  std::span<const T> accumulate(state<T>& st, std::span<const T> g) const {
    return accumulate_into(st, st, g);
  }

  // The state after accumulate(from, g), written to `to` with `from` left as it was (to may be
  // from): to.u = m from.u + g, to.v = from.v + to.u. With `energy`, also puts ||to.v||^2
  // there (the top-k contraction's denominator), from each stretch of v while it is cached.
  template <gradient_value T>
  std::span<const T> accumulate_into(const state<T>& from, state<T>& to, std::span<const T> g,
                                     double* energy = nullptr) const {
    check();
    detail::check_feedback_size("dgc_momentum::accumulate", g.size(), from.v.size());
    detail::check_feedback_size("dgc_momentum::accumulate", g.size(), to.v.size());
    T scale = T(1);
    if (clip_norm > 0.0) {
      double sq = 0.0;
      for (T x : g) sq += static_cast<double>(x) * static_cast<double>(x);
      const double norm = std::sqrt(sq);
      if (norm > clip_norm) scale = static_cast<T>(clip_norm / norm);
    }
    const T m = static_cast<T>(momentum);
    const T* u0 = from.u.data();
    const T* v0 = from.v.data();
    T* u = to.u.data();
    T* v = to.v.data();
    const T* gp = g.data();
    const std::size_t n = g.size();
    if (energy != nullptr) *energy = 0.0;
    for (std::size_t b = 0; b < n; b += 1024) {
      const std::size_t end = std::min(n, b + 1024);
      for (std::size_t i = b; i < end; ++i) {
        const T ui = m * u0[i] + scale * gp[i];
        u[i] = ui;
        v[i] = v0[i] + ui;
      }
      if (energy != nullptr) detail::add_squares(v + b, end - b, energy);
    }
    return to.v;
  }

  template <gradient_value T>
  void update(state<T>& st, std::span<const std::uint32_t> idx,
              std::span<const float> decoded) const {
    detail::check_sent("dgc_momentum::update", idx, decoded.size(), st.v.size());
    for (std::size_t j = 0; j < idx.size(); ++j) {
      st.v[idx[j]] -= static_cast<T>(decoded[j]);
      st.u[idx[j]] = T(0);
    }
  }

  // gTop-k: coordinates sent but not used go back to v. Their momentum was already masked,
  // which DGC's masking rule accepts (u restarts from the next gradient).
  template <gradient_value T>
  void restore(state<T>& st, std::span<const std::uint32_t> idx,
               std::span<const float> decoded) const {
    detail::check_sent("dgc_momentum::restore", idx, decoded.size(), st.v.size());
    for (std::size_t j = 0; j < idx.size(); ++j) st.v[idx[j]] += static_cast<T>(decoded[j]);
  }

  void check() const {
    if (!(momentum >= 0.0 && momentum < 1.0)) {
      detail::throw_invalid_argument("dgc_momentum", "momentum", momentum, "0 <= momentum < 1");
    }
    if (!(clip_norm >= 0.0)) {
      detail::throw_invalid_argument("dgc_momentum", "clip_norm", clip_norm,
                                     "clip_norm >= 0 (0 disables clipping)");
    }
  }
};

static_assert(feedback<dgc_momentum>);
static_assert(feedback<dgc_momentum, double>);

}  // namespace gradcomp
