// gradcomp/feedback/none.hpp: no error feedback. What is not sent is dropped; the vector
// compressed is the gradient itself (no copy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/feedback/common.hpp>

namespace gradcomp {

struct no_feedback {
  template <gradient_value T>
  struct state {
    std::size_t size = 0;
    std::vector<std::span<T>> buffers() { return {}; }
  };

  template <gradient_value T>
  state<T> make_state(std::size_t n) const {
    return state<T>{n};
  }

  template <gradient_value T>
  std::span<const T> accumulate(state<T>& st, std::span<const T> g) const {
    detail::check_feedback_size("no_feedback::accumulate", g.size(), st.size);
    return g;
  }

  // Nothing to keep: the state after a step is the state before it.
  template <gradient_value T>
  std::span<const T> accumulate_into(const state<T>& from, state<T>& to,
                                     std::span<const T> g) const {
    detail::check_feedback_size("no_feedback::accumulate", g.size(), from.size);
    to.size = from.size;
    return g;
  }

  template <gradient_value T>
  void update(state<T>&, std::span<const std::uint32_t>, std::span<const float>) const {}
};

static_assert(feedback<no_feedback>);
static_assert(feedback<no_feedback, double>);

}  // namespace gradcomp
