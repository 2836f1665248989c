// gradcomp/schedule/periodic_averaging.hpp: PQASGD (periodic quantized averaging). Each rank
// runs local SGD without communicating; every p steps the ranks average the quantized change of
// the model since the last averaging, with error feedback on that change. With subsets R > 1 a
// round averages only one of R rotating slices of every tensor (sparse parameter averaging).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gradcomp/compressor.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/checkpoint.hpp>
#include <gradcomp/detail/nonfinite.hpp>
#include <gradcomp/engine/staged_feedback.hpp>
#include <gradcomp/engine/tensor_record.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/select/dense.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp {

struct averaging_options {
  unsigned period = 4;   // p: an averaging round after every p local steps
  unsigned subsets = 1;  // R: round r averages slice r mod R of every tensor; 1: all of it
  // Keep what quantization lost of each rank's change and add it to its next change (the
  // residual law of feedback/residual.hpp); false drops it.
  bool error_feedback = true;
};

namespace detail {

// Slice c of a tensor of n elements split into `subsets` (periodic_averaging's rounds):
// [c n / R, (c + 1) n / R), the remainder spread over the first slices.
inline std::pair<std::size_t, std::size_t> averaging_slice(std::size_t n, unsigned subsets,
                                                           unsigned c) {
  const std::size_t r = subsets;
  return {n / r * c + std::min<std::size_t>(c, n % r),
          n / r * (c + 1) + std::min<std::size_t>(c + 1, n % r)};
}

// periodic_averaging's checkpoint (and device_periodic_averaging's, byte for byte): a header
// (magic, version, element size, the counters, the number of slices, each tensor's id and
// size), the anchor and the velocity (each with its length), then every slice's feedback
// buffers. The header's and the vectors' parts are here; the slices' are each driver's.
inline constexpr std::uint32_t averaging_checkpoint_magic = 0x41504347;  // "GCPA" little-endian
inline constexpr std::uint32_t averaging_checkpoint_version = 1;

struct averaging_counters {
  std::uint64_t step = 0;
  std::uint64_t round = 0;
  std::uint64_t last_round_step = 0;
};

template <class T>
void put_averaging_header(std::ostream& os, const averaging_counters& at, unsigned subsets,
                          std::span<const tensor_spec> tensors) {
  put(os, averaging_checkpoint_magic);
  put(os, averaging_checkpoint_version);
  put(os, static_cast<std::uint32_t>(sizeof(T)));
  put(os, at.step);
  put(os, at.round);
  put(os, at.last_round_step);
  put(os, static_cast<std::uint32_t>(subsets));
  put(os, static_cast<std::uint32_t>(tensors.size()));
  for (const tensor_spec& t : tensors) {
    put(os, t.id);
    put(os, static_cast<std::uint64_t>(t.size));
  }
}

// Reads and checks the header against the driver's slices and tensors (refused naming the
// first mismatch; nothing of the driver changes).
template <class T>
averaging_counters get_averaging_header(std::istream& is, std::string_view driver,
                                        unsigned subsets, std::span<const tensor_spec> tensors) {
  check_header(is, driver, "gradcomp periodic_averaging", averaging_checkpoint_magic,
               averaging_checkpoint_version, static_cast<std::uint32_t>(sizeof(T)));
  averaging_counters at;
  at.step = get<std::uint64_t>(is, driver);
  at.round = get<std::uint64_t>(is, driver);
  at.last_round_step = get<std::uint64_t>(is, driver);
  if (const auto r = get<std::uint32_t>(is, driver); r != subsets) {
    fail_load(driver, concat("checkpoint averages ", r, " slices per tensor, this optimizer ",
                             subsets));
  }
  if (const auto count = get<std::uint32_t>(is, driver); count != tensors.size()) {
    fail_load(driver, concat("checkpoint has ", count, " tensors, this optimizer has ",
                             tensors.size()));
  }
  for (const tensor_spec& t : tensors) {
    const auto id = get<std::uint32_t>(is, driver);
    const auto n = get<std::uint64_t>(is, driver);
    if (id != t.id || n != t.size) {
      fail_load(driver, concat("checkpoint has tensor ", id, " of ", n, " elements where this "
                               "optimizer has tensor ", t.id, " of ", t.size));
    }
  }
  return at;
}

// The seed of a round's call_id on `rank`: the rank mixed into the options' seed, so that each
// rank has its own rounding noise, which averages out over the ranks instead of adding up
// coherently (the dense selector picks the same coordinates everywhere anyway).
inline std::uint64_t averaging_round_seed(std::uint64_t seed, int rank) {
  return seed + 0x9e3779b97f4a7c15ULL * (static_cast<std::uint64_t>(rank) + 1);
}

// A vector with its length (the anchor, the velocity).
template <class T>
void put_sized(std::ostream& os, std::span<const T> v) {
  put(os, static_cast<std::uint64_t>(v.size()));
  put_array(os, v);
}

// A vector whose length must be one of `sizes` (the anchor is empty before the first step).
template <class T>
std::vector<T> get_sized(std::istream& is, std::string_view driver, const char* what,
                         std::pair<std::size_t, std::size_t> sizes) {
  const auto n = get<std::uint64_t>(is, driver);
  if (n != sizes.first && n != sizes.second) {
    fail_load(driver, concat("checkpoint has a ", what, " of ", n, " elements, this optimizer ",
                             sizes.second));
  }
  std::vector<T> v(static_cast<std::size_t>(n));
  get_array(is, std::span<T>(v), driver);
  return v;
}

}  // namespace detail

// Round r, for tensor t of n elements and R = subsets, averages the slice
// [c n / R, (c + 1) n / R) with c = r mod R; a slice that is empty is skipped on every rank.
// A rank's change d = theta - anchor + e over the slice (anchor: the slice at its last
// averaging, e: the error feedback) is quantized with Q (no selection: every coordinate),
// the payloads are exchanged, and theta = anchor = anchor + mean of the decoded changes.
// Coordinates outside the slice keep their local progress until their slice's turn.
//
// The parameters must be equal on every rank at the first step (broadcast them), since a
// round averages changes, not values. The optimizer state (momentum) stays local.
template <class Quantizer, class Exchange, class Comm, class T = float>
class periodic_averaging {
  static_assert(communicator<Comm>,
                "periodic_averaging<Q, X, Comm>: Comm is not a gradcomp::communicator.");

 public:
  using value_type = T;
  using compressor_type = compressor<dense, Quantizer, residual, T>;
  static_assert(exchange<Exchange, compressor_type, Comm>,
                "periodic_averaging<Q, X, Comm>: X is not a gradcomp::exchange for "
                "compressor<dense, Q, residual>.");

  periodic_averaging(Comm& comm, std::span<const tensor_spec> tensors, Quantizer q = {},
                     Exchange x = {}, sgd_options opt = {}, averaging_options avg = {})
      : comm_(&comm), tensors_(tensors.begin(), tensors.end()), compressor_(dense{}, std::move(q)),
        exchange_(std::move(x)), opt_(opt), avg_(avg) {
    if (avg_.period < 1) {
      detail::throw_invalid_argument("periodic_averaging", "period", avg_.period, ">= 1");
    }
    if (avg_.subsets < 1) {
      detail::throw_invalid_argument("periodic_averaging", "subsets", avg_.subsets, ">= 1");
    }
    detail::check_sgd_options("periodic_averaging", opt_);
    offsets_ = detail::tensor_offsets("periodic_averaging", tensors_);
    for (const tensor_spec& t : tensors_) detail::check_tensor_size("periodic_averaging", t, true);
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      for (unsigned c = 0; c < avg_.subsets; ++c) {
        const auto [begin, end] = slice(t, c);
        feedback_.add(compressor_, end - begin);
      }
    }
    total_ = detail::total_size(tensors_);
    if (opt_.momentum > 0.0) velocity_.assign(total_, T(0));
  }

  // One local SGD step (lr, momentum, Nesterov and weight decay on this rank's own gradient),
  // then an averaging round if this was the p-th step since the last one. Collective on the
  // averaging steps only; the statistics count this step's communication.
  //
  // All or nothing: when a round fails (a peer failed, an exchange rejected a payload), the
  // parameters, the velocity, the anchor, every error-feedback buffer and the counters are
  // what they were before the step. To restore them, a step that ends with a round keeps a
  // copy of the parameters and the velocity (one copy every p steps); the round compresses
  // into a second feedback state and applies nothing until every exchange has succeeded.
  const step_stats& step(std::span<T> params, std::span<const T> grads) {
    check_size("params.size()", params.size());
    check_size("grads.size()", grads.size());
    if (const std::size_t bad = detail::first_nonfinite(grads); bad != total_) {
      throw nonfinite_error(detail::concat("gradcomp::periodic_averaging::step: the gradient holds ",
                                           grads[bad], " at index ", bad,
                                           "; nothing was changed"));
    }
    const bool with_round = (step_ + 1) % avg_.period == 0;
    // The anchor is the parameters at the first step (every rank holds the same then).
    const bool new_anchor = anchor_.empty() && total_;
    if (new_anchor) anchor_.assign(params.begin(), params.begin() + static_cast<std::ptrdiff_t>(total_));
    if (with_round) {
      saved_params_.assign(params.begin(), params.begin() + static_cast<std::ptrdiff_t>(total_));
      saved_velocity_ = velocity_;
    }
    step_stats next;
    next.step = step_;
    next.n = total_;
    detail::stopwatch clock;
    detail::sgd_update<T>(params.first(total_), grads, velocity_, opt_);
    next.seconds.update = clock.lap();
    if (with_round) {
      try {
        run_round(params, next);
      } catch (...) {
        std::copy(saved_params_.begin(), saved_params_.end(), params.begin());
        velocity_.swap(saved_velocity_);
        if (new_anchor) anchor_.clear();
        throw;
      }
      last_round_step_ = step_ + 1;
    }
    ++step_;
    finish(std::move(next));
    return stats_;
  }

  // An averaging round now, whatever the step count (e.g. before evaluating at the end of an
  // epoch). Collective; all or nothing, as step().
  const step_stats& average(std::span<T> params) {
    check_size("params.size()", params.size());
    step_stats next;
    next.step = step_;
    next.n = total_;
    const bool new_anchor = anchor_.empty() && total_;
    if (new_anchor) anchor_.assign(params.begin(), params.begin() + static_cast<std::ptrdiff_t>(total_));
    try {
      run_round(params, next);
    } catch (...) {
      if (new_anchor) anchor_.clear();
      throw;
    }
    last_round_step_ = step_;
    finish(std::move(next));
    return stats_;
  }

  // Whether the last step() ended with an averaging round (every rank then holds the same
  // parameters when subsets == 1).
  [[nodiscard]] bool just_averaged() const noexcept { return last_round_step_ == step_ && step_ > 0; }
  [[nodiscard]] const step_stats& last_stats() const noexcept { return stats_; }
  [[nodiscard]] std::uint64_t steps_done() const noexcept { return step_; }
  [[nodiscard]] std::uint64_t rounds_done() const noexcept { return round_; }
  [[nodiscard]] std::size_t size() const noexcept { return total_; }
  [[nodiscard]] std::size_t total_bytes_sent() const noexcept { return total_bytes_sent_; }
  [[nodiscard]] std::size_t total_bytes_received() const noexcept { return total_bytes_received_; }
  [[nodiscard]] const averaging_options& options() const noexcept { return avg_; }

  // Checkpoints: the counters, the anchor, the velocity and every slice's error-feedback
  // buffers, with the tensors' ids and sizes. load_state() checks all of it against this
  // optimizer and changes nothing unless it all matches.
  void save_state(std::ostream& os) const {
    detail::put_averaging_header<T>(os, {step_, round_, last_round_step_}, avg_.subsets,
                                    tensors_);
    detail::put_sized(os, std::span<const T>(anchor_));
    detail::put_sized(os, std::span<const T>(velocity_));
    for (std::size_t s = 0; s < feedback_.size(); ++s) {
      // buffers() hands out mutable spans for load_state(); here they are only read.
      auto buffers = const_cast<typename compressor_type::state_type&>(feedback_.committed(s)).buffers();
      detail::put(os, static_cast<std::uint32_t>(buffers.size()));
      for (const auto& b : buffers) {
        detail::put(os, static_cast<std::uint64_t>(b.size()));
        detail::put_array(os, std::span<const T>(b.data(), b.size()));
      }
    }
    if (!os) throw error("gradcomp::periodic_averaging::save_state: the stream failed while writing");
  }

  void load_state(std::istream& is) {
    const detail::averaging_counters at =
        detail::get_averaging_header<T>(is, driver_name, avg_.subsets, tensors_);
    std::vector<T> anchor = detail::get_sized<T>(is, driver_name, "anchor", {0, total_});
    std::vector<T> velocity =
        detail::get_sized<T>(is, driver_name, "velocity", {velocity_.size(), velocity_.size()});
    std::vector<typename compressor_type::state_type> states;
    for (std::size_t s = 0; s < feedback_.size(); ++s) {
      const auto [begin, end] = slice(s / avg_.subsets, static_cast<unsigned>(s % avg_.subsets));
      states.push_back(compressor_.make_state(end - begin));
      auto buffers = states.back().buffers();
      if (const auto nbuf = get<std::uint32_t>(is); nbuf != buffers.size()) {
        fail_load(detail::concat("a slice has ", nbuf, " feedback buffers in the checkpoint, ",
                                 buffers.size(), " here"));
      }
      for (auto& b : buffers) {
        if (const auto n = get<std::uint64_t>(is); n != b.size()) {
          fail_load(detail::concat("a feedback buffer has ", n, " elements in the checkpoint, ",
                                   b.size(), " here"));
        }
        detail::get_array(is, b, driver_name);
      }
    }
    step_ = at.step;
    round_ = at.round;
    last_round_step_ = at.last_round_step;
    anchor_ = std::move(anchor);
    velocity_ = std::move(velocity);
    feedback_.replace_committed(std::move(states));
  }

 private:
  static constexpr std::string_view driver_name = "periodic_averaging";

  [[noreturn]] static void fail_load(const std::string& why) { detail::fail_load(driver_name, why); }
  template <class V>
  static V get(std::istream& is) {
    return detail::get<V>(is, driver_name);
  }

  void check_size(const char* what, std::size_t n) const {
    if (n != total_) {
      detail::throw_invalid_argument("periodic_averaging", what, n,
                                     detail::concat("the total of the tensor sizes (", total_, ")"));
    }
  }

  std::pair<std::size_t, std::size_t> slice(std::size_t t, unsigned c) const {
    return detail::averaging_slice(tensors_[t].size, avg_.subsets, c);
  }

  void finish(step_stats&& next) {
    stats_ = std::move(next);
    total_bytes_sent_ += stats_.bytes_sent;
    total_bytes_received_ += stats_.bytes_received;
  }

  // One averaging round, in two phases: every tensor's slice is compressed (into staged
  // feedback state) and exchanged, then, once all have succeeded, the anchor and the
  // parameters take the means and the staged state is kept. A throw in the first phase leaves
  // everything as it was; the second cannot throw.
  void run_round(std::span<T> params, step_stats& st) {
    const unsigned c = static_cast<unsigned>(round_ % avg_.subsets);
    // Quantizers draw from (seed, step, tensor id), the seed this rank's own.
    const std::uint64_t seed = detail::averaging_round_seed(opt_.seed, comm_->rank());
    mean_.resize(total_);
    feedback_.discard();
    try {
      for (std::size_t t = 0; t < tensors_.size(); ++t) {
        const auto [begin, end] = slice(t, c);
        if (begin == end) continue;
        const std::size_t m = end - begin;
        const std::size_t at = offsets_[t] + begin;
        const std::size_t s = t * avg_.subsets + c;
        change_.resize(m);
        for (std::size_t i = 0; i < m; ++i) change_[i] = params[at + i] - anchor_[at + i];
        const compress_context ctx{1.0, call_id{seed, round_, tensors_[t].id}};
        const compress_stats cs = feedback_.compress(compressor_, s, change_, ctx, payload_);
        if (!avg_.error_feedback) {
          for (auto& b : feedback_.staged(s).buffers()) std::fill(b.begin(), b.end(), T(0));
        }
        const exchange_stats xs = exchange_.exchange(*comm_, compressor_, payload_,
                                                     std::span<T>(mean_).subspan(at, m));
        detail::add_tensor(st, detail::tensor_stats_of(tensors_[t].id, m, cs, xs, 0));
      }
    } catch (...) {
      feedback_.discard();
      throw;
    }

    detail::stopwatch clock;
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      const auto [begin, end] = slice(t, c);
      if (begin == end) continue;
      const std::size_t at = offsets_[t] + begin;
      for (std::size_t i = 0; i < end - begin; ++i) {
        anchor_[at + i] += mean_[at + i];
        params[at + i] = anchor_[at + i];
      }
    }
    feedback_.commit();
    st.seconds.update += clock.lap();
    st.target_density = 1.0 / static_cast<double>(avg_.subsets);
    detail::finish_totals(st);
    ++round_;
  }

  Comm* comm_;
  std::vector<tensor_spec> tensors_;
  std::vector<std::size_t> offsets_;
  std::size_t total_ = 0;
  compressor_type compressor_;
  Exchange exchange_;
  sgd_options opt_;
  averaging_options avg_;
  // [tensor][slice]: committed, and what a round in flight makes
  detail::staged_feedback<compressor_type> feedback_;
  std::vector<T> anchor_;    // the parameters at each slice's last averaging
  std::vector<T> velocity_;
  std::vector<T> saved_params_;    // a step with a round restores these when the round fails
  std::vector<T> saved_velocity_;
  std::vector<T> change_;
  std::vector<T> mean_;
  payload payload_;
  step_stats stats_;
  std::uint64_t step_ = 0;
  std::uint64_t round_ = 0;
  std::uint64_t last_round_step_ = 0;
  std::size_t total_bytes_sent_ = 0;
  std::size_t total_bytes_received_ = 0;
};

}  // namespace gradcomp
