// gradcomp/feedback/residual.hpp: error feedback with a residual (TopK-SGD with error
// compensation): acc = e + g is compressed, and e keeps acc - decoded, so what was not sent
// (or was sent with quantization error) is added to the next step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/feedback/common.hpp>

namespace gradcomp {

struct residual {
  template <gradient_value T>
  struct state {
    std::vector<T> e;  // holds acc between accumulate() and update(), the residual otherwise
    std::vector<std::span<T>> buffers() { return {std::span<T>(e)}; }
  };

  template <gradient_value T>
  state<T> make_state(std::size_t n) const {
    return state<T>{std::vector<T>(n, T(0))};
  }

  // e += g; the accumulated vector is e itself, so no extra buffer is needed.
  template <gradient_value T>
  std::span<const T> accumulate(state<T>& st, std::span<const T> g) const {
    detail::check_feedback_size("residual::accumulate", g.size(), st.e.size());
    T* e = st.e.data();
    const T* gp = g.data();
    for (std::size_t i = 0, n = g.size(); i < n; ++i) e[i] += gp[i];
    return st.e;
  }

  // The state after accumulate(from, g), written to `to` with `from` left as it was:
  // to.e = from.e + g. A step that must be able to fail without changing anything compresses
  // into a second state this way and keeps whichever of the two survives.
  template <gradient_value T>
  std::span<const T> accumulate_into(const state<T>& from, state<T>& to,
                                     std::span<const T> g) const {
    detail::check_feedback_size("residual::accumulate", g.size(), from.e.size());
    detail::check_feedback_size("residual::accumulate", g.size(), to.e.size());
    T* e = to.e.data();
    const T* ep = from.e.data();
    const T* gp = g.data();
    for (std::size_t i = 0, n = g.size(); i < n; ++i) e[i] = ep[i] + gp[i];
    return to.e;
  }

  // The buffer accumulate() adds g into and returns, for a selector that does e += g itself
  // while it scans (select_accumulate_into): accumulate(st, g) is exactly e[i] += g[i] on it,
  // so folding the addition into the selector's pass changes no value. compressor<> uses
  // this, and the const form for the state a step reads without changing.
  template <gradient_value T>
  std::span<T> in_place_accumulator(state<T>& st) const {
    return st.e;
  }
  template <gradient_value T>
  std::span<const T> in_place_accumulator(const state<T>& st) const {
    return st.e;
  }

  // e = acc - decoded at the sent coordinates; unsent coordinates keep acc unchanged.
  template <gradient_value T>
  void update(state<T>& st, std::span<const std::uint32_t> idx,
              std::span<const float> decoded) const {
    detail::check_sent("residual::update", idx, decoded.size(), st.e.size());
    for (std::size_t j = 0; j < idx.size(); ++j) st.e[idx[j]] -= static_cast<T>(decoded[j]);
  }

  // Undo update() for coordinates that were sent but not used by the aggregation (gTop-k
  // drops local picks that are not in the global top-k): their values go back to e.
  template <gradient_value T>
  void restore(state<T>& st, std::span<const std::uint32_t> idx,
               std::span<const float> decoded) const {
    detail::check_sent("residual::restore", idx, decoded.size(), st.e.size());
    for (std::size_t j = 0; j < idx.size(); ++j) st.e[idx[j]] += static_cast<T>(decoded[j]);
  }
};

static_assert(feedback<residual>);
static_assert(feedback<residual, double>);

}  // namespace gradcomp
