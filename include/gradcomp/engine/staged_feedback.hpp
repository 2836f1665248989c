// gradcomp/engine/staged_feedback.hpp: the step's transaction over feedback state, the one
// every driver uses (sparsified_sgd, periodic_averaging, and, with its slots named by bucket id
// (bucket_slots), the DDP hook's engines: the run-time bucket engine over host state, the CUDA
// engine over device tensors).
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
#include <map>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/compressor.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp::detail {

// The transaction itself, over any state type (host feedback state, a device tensor): each slot
// holds a committed and a staged state. A step writes a slot's staged state and marks the slot
// (stage()); commit() keeps the staged state of every marked slot (the two swap: no copy),
// discard() forgets the marks. What a state is and how a step writes it is the caller's.
template <class State>
class staged_slots {
 public:
  // A new slot (a released one where there is one): its committed state, the buffer its steps
  // stage into, its element count.
  std::size_t add(State committed, State staged, std::size_t n) {
    if (!free_.empty()) {
      const std::size_t i = free_.back();
      slots_[i] = slot{std::move(committed), std::move(staged), n, false, false};
      free_.pop_back();
      return i;
    }
    slots_.push_back(slot{std::move(committed), std::move(staged), n, false, false});
    return slots_.size() - 1;
  }
  // Slot i is no longer used: its states become `committed` and `staged` (empty ones, which
  // frees what it held), nothing of it is pending, and add() reuses it. Releasing a released
  // slot again changes nothing.
  void release(std::size_t i, State committed, State staged) {
    slot& s = slots_.at(i);
    if (s.released) return;
    free_.push_back(i);  // first: if it cannot grow, the slot stays as it was
    s = slot{std::move(committed), std::move(staged), 0, false, true};
  }
  // Slot i anew, nothing pending (a released slot is in use again).
  void reset(std::size_t i, State committed, State staged, std::size_t n) {
    slot& s = slots_.at(i);
    if (s.released) std::erase(free_, i);
    s = slot{std::move(committed), std::move(staged), n, false, false};
  }
  void clear() noexcept {
    slots_.clear();
    free_.clear();
  }

  // Slot i's staged state is this step's (commit() keeps it) or not (a step that is rewriting
  // it unmarks it first, so that a failure half-way leaves nothing to commit).
  void stage(std::size_t i, bool pending = true) { slots_.at(i).pending = pending; }

  // Keeps the staged state of every marked slot. Cannot fail.
  void commit() noexcept {
    for (slot& s : slots_) {
      if (s.pending) std::swap(s.committed, s.staged);
      s.pending = false;
    }
  }
  // Forgets every marked slot's staged state.
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
  [[nodiscard]] State& committed(std::size_t i) { return slots_.at(i).committed; }
  [[nodiscard]] const State& committed(std::size_t i) const { return slots_.at(i).committed; }
  [[nodiscard]] State& staged(std::size_t i) { return slots_.at(i).staged; }

  // Replaces every slot's committed state at once (a checkpoint that was checked whole);
  // nothing stays pending.
  void replace_committed(std::vector<State>&& states) {
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
    State committed;
    State staged;
    std::size_t n = 0;  // a state without buffers has no other record of the size
    bool pending = false;
    bool released = false;  // on free_, for add() to reuse
  };
  std::vector<slot> slots_;
  std::vector<std::size_t> free_;  // released slots, for add() to reuse
};

// The slots named by a bucket id instead of an index (the DDP hook's engines, host and CUDA):
// a bucket's slot is made at its first step, keeps its size, and drop() frees it for another
// bucket. The index forms (add, reset, release, replace_committed) are not offered: they would
// leave the names behind.
template <class State>
class bucket_slots : protected staged_slots<State> {
  using base = staged_slots<State>;

 public:
  using base::commit;
  using base::committed;
  using base::discard;
  using base::elements;
  using base::pending;
  using base::size;
  using base::stage;
  using base::staged;

  // Bucket `bucket`'s slot, if it has one.
  [[nodiscard]] std::optional<std::size_t> find(std::int64_t bucket) const {
    const auto it = ids_.find(bucket);
    if (it == ids_.end()) return std::nullopt;
    return it->second;
  }
  // Bucket `bucket`'s slot, made from make() (a pair: committed and staged state of n elements)
  // at the bucket's first use; a bucket whose size is not the one it had is refused, naming it.
  template <class Make>
  std::size_t slot_for(std::int64_t bucket, std::size_t n, Make&& make) {
    if (const auto i = find(bucket)) {
      if (const std::size_t had = this->elements(*i); had != n) {
        throw_invalid_argument("bucket_engine", "bucket size", n,
                               concat("the size bucket ", bucket, " had before (", had,
                                      "); its feedback state is kept per bucket id"));
      }
      return *i;
    }
    auto [committed, staged] = std::forward<Make>(make)();
    return add_named(bucket, std::move(committed), std::move(staged), n);
  }
  // Bucket `bucket` anew with these states of n elements (a checkpoint's, or zeros), nothing
  // pending; returns its slot.
  std::size_t put(std::int64_t bucket, State committed, State staged, std::size_t n) {
    if (const auto i = find(bucket)) {
      base::reset(*i, std::move(committed), std::move(staged), n);
      return *i;
    }
    return add_named(bucket, std::move(committed), std::move(staged), n);
  }
  // Forgets bucket `bucket`: its states become these empty ones (which frees what it held) and
  // its slot goes to the next new bucket. Nothing happens for a bucket without a slot.
  void drop(std::int64_t bucket, State committed, State staged) {
    const auto it = ids_.find(bucket);
    if (it == ids_.end()) return;
    base::release(it->second, std::move(committed), std::move(staged));
    ids_.erase(it);
  }
  void clear() noexcept {
    base::clear();
    ids_.clear();
  }

 private:
  std::size_t add_named(std::int64_t bucket, State committed, State staged, std::size_t n) {
    const auto it = ids_.emplace(bucket, 0).first;
    try {
      it->second = base::add(std::move(committed), std::move(staged), n);
    } catch (...) {
      ids_.erase(it);
      throw;
    }
    return it->second;
  }
  std::map<std::int64_t, std::size_t> ids_;  // bucket id -> its slot
};

// The host drivers' form: the slots hold a compressor's feedback state, and a step writes a
// slot's staged state by compressing from its committed one. Slots is staged_slots (slots by
// index: sparsified_sgd, periodic_averaging) or bucket_slots (by bucket id: the bucket engine).
template <class Compressor, template <class> class Slots = staged_slots>
class staged_feedback : public Slots<typename Compressor::state_type> {
  using base = Slots<typename Compressor::state_type>;
  // The index forms below are staged_slots' only (bucket_slots names its slots by bucket id).
  static constexpr bool by_index =
      std::is_same_v<base, staged_slots<typename Compressor::state_type>>;

 public:
  using state_type = typename Compressor::state_type;
  using value_type = typename Compressor::value_type;

  // A new slot of n elements with zeroed state; returns its index.
  std::size_t add(const Compressor& c, std::size_t n)
    requires by_index
  {
    return base::add(c.make_state(n), c.make_state(n), n);
  }
  // Slot i anew: zeroed state of n elements, nothing pending.
  void reset(const Compressor& c, std::size_t i, std::size_t n)
    requires by_index
  {
    base::reset(i, c.make_state(n), c.make_state(n), n);
  }
  // Slot i is no longer used: its buffers are freed and add() reuses it.
  void release(const Compressor& c, std::size_t i)
    requires by_index
  {
    base::release(i, c.make_state(0), c.make_state(0));
  }

  // Compresses g with slot i's committed state into its staged state (the slot is pending from
  // then on; a second compression of the slot in one step replaces the first).
  compress_stats compress(Compressor& c, std::size_t i, std::span<const value_type> g,
                          const compress_context& ctx, payload& out) {
    if (g.size() != this->elements(i)) {
      throw_invalid_argument("staged_feedback::compress", "gradient size", g.size(),
                             concat("the size of its slot (", this->elements(i), ")"));
    }
    this->stage(i, false);
    const compress_stats cs =
        c.compress(g, std::as_const(this->committed(i)), this->staged(i), ctx, out);
    this->stage(i);
    return cs;
  }

  // Gives picks the exchange left out back to slot i's staged state, when the feedback can
  // take them; returns how many it took (0 where the feedback drops them).
  std::size_t restore(Compressor& c, std::size_t i, std::span<const std::uint32_t> idx,
                      std::span<const value_type> values) {
    if constexpr (restores_picks<typename Compressor::feedback_type, value_type>) {
      c.feedback().restore(this->staged(i), idx, values);
      return idx.size();
    } else {
      (void)c, (void)i, (void)values;
      return 0;
    }
  }
};

}  // namespace gradcomp::detail
