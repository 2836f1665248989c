// gradcomp/detail/staged_feedback.hpp: the step's transaction over feedback state, the one
// every driver uses (sparsified_sgd, periodic_averaging, the run-time bucket engine).
//
// Each slot (a tensor, a tensor's slice, a bucket) keeps its feedback state twice: the
// committed state, and the state a step in flight makes from it. compress() reads the committed
// state and writes the staged one; restore() gives picks an exchange left out back to the staged
// state. commit() keeps the staged state of every slot compressed since the last commit or
// discard; discard() forgets them. So a step that fails anywhere, on any slot, leaves every
// slot's feedback as it was, and one that succeeds costs no copy: the two states swap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <gradcomp/compressor.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp::detail {

template <class Compressor>
class staged_feedback {
 public:
  using state_type = typename Compressor::state_type;
  using value_type = typename Compressor::value_type;

  // A new slot of n elements with zeroed state; returns its index.
  std::size_t add(const Compressor& c, std::size_t n) {
    slots_.push_back(slot{c.make_state(n), c.make_state(n), n, false});
    return slots_.size() - 1;
  }
  // Slot i anew: zeroed state of n elements, nothing pending.
  void reset(const Compressor& c, std::size_t i, std::size_t n) {
    slots_.at(i) = slot{c.make_state(n), c.make_state(n), n, false};
  }
  void clear() noexcept { slots_.clear(); }

  // Compresses g with slot i's committed state into its staged state (the slot is pending from
  // then on; a second compression of the slot in one step replaces the first).
  compress_stats compress(Compressor& c, std::size_t i, std::span<const value_type> g,
                          const compress_context& ctx, payload& out) {
    slot& s = slots_[i];
    if (g.size() != s.n) {
      throw_invalid_argument("staged_feedback::compress", "gradient size", g.size(),
                             concat("the size of its slot (", s.n, ")"));
    }
    s.pending = false;
    const compress_stats cs = c.compress(g, std::as_const(s.committed), s.staged, ctx, out);
    s.pending = true;
    return cs;
  }

  // Gives picks the exchange left out back to slot i's staged state, when the feedback can
  // take them; returns how many it took (0 where the feedback drops them).
  std::size_t restore(Compressor& c, std::size_t i, std::span<const std::uint32_t> idx,
                      std::span<const value_type> values) {
    if constexpr (restores_picks<typename Compressor::feedback_type, value_type>) {
      c.feedback().restore(slots_[i].staged, idx, values);
      return idx.size();
    } else {
      (void)c, (void)i, (void)values;
      return 0;
    }
  }

  // Keeps the staged state of every pending slot. Cannot fail.
  void commit() noexcept {
    for (slot& s : slots_) {
      if (s.pending) std::swap(s.committed, s.staged);
      s.pending = false;
    }
  }
  // Forgets every pending slot's staged state.
  void discard() noexcept {
    for (slot& s : slots_) s.pending = false;
  }
  [[nodiscard]] bool pending() const noexcept {
    for (const slot& s : slots_) {
      if (s.pending) return true;
    }
    return false;
  }

  [[nodiscard]] std::size_t size() const noexcept { return slots_.size(); }
  [[nodiscard]] std::size_t elements(std::size_t i) const { return slots_.at(i).n; }
  [[nodiscard]] state_type& committed(std::size_t i) { return slots_.at(i).committed; }
  [[nodiscard]] const state_type& committed(std::size_t i) const { return slots_.at(i).committed; }
  // The state the step in flight is making (e.g. to drop what a driver does not keep).
  [[nodiscard]] state_type& staged(std::size_t i) { return slots_.at(i).staged; }

  // Replaces every slot's committed state at once (a checkpoint that was checked whole);
  // nothing stays pending.
  void replace_committed(std::vector<state_type>&& states) {
    if (states.size() != slots_.size()) {
      throw_invalid_argument("staged_feedback::replace_committed", "states.size()", states.size(),
                             concat(slots_.size(), " (one per slot)"));
    }
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      slots_[i].committed = std::move(states[i]);
      slots_[i].pending = false;
    }
  }

 private:
  struct slot {
    state_type committed;
    state_type staged;
    std::size_t n = 0;  // a feedback without buffers has no other record of the size
    bool pending = false;
  };
  std::vector<slot> slots_;
};

}  // namespace gradcomp::detail
