// gradcomp/schedule/periodic_averaging.hpp: PQASGD (periodic quantized averaging). Each rank
// runs local SGD without communicating; every p steps the ranks average the quantized change of
// the model since the last averaging, with error feedback on that change. With subsets R > 1 a
// round averages only one of R rotating slices of every tensor (sparse parameter averaging).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <gradcomp/compressor.hpp>
#include <gradcomp/concepts.hpp>
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
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      for (unsigned c = 0; c < avg_.subsets; ++c) {
        const auto [begin, end] = slice(t, c);
        states_.push_back(compressor_.make_state(end - begin));
      }
    }
    total_ = detail::total_size(tensors_);
    if (opt_.momentum > 0.0) velocity_.assign(total_, T(0));
  }

  // One local SGD step (lr, momentum, Nesterov and weight decay on this rank's own gradient),
  // then an averaging round if this was the p-th step since the last one. Collective on the
  // averaging steps only; the statistics count this step's communication.
  const step_stats& step(std::span<T> params, std::span<const T> grads) {
    check_size("params.size()", params.size());
    check_size("grads.size()", grads.size());
    if (const std::size_t bad = detail::find_nonfinite(grads); bad != total_) {
      throw nonfinite_error(detail::concat("gradcomp::periodic_averaging::step: the gradient holds ",
                                           grads[bad], " at index ", bad,
                                           "; nothing was changed"));
    }
    if (anchor_.empty() && total_) anchor_.assign(params.begin(), params.end());
    stats_ = step_stats{};
    stats_.step = step_;
    stats_.n = total_;

    detail::stopwatch clock;
    detail::sgd_update<T>(params.first(total_), grads, velocity_, opt_);
    stats_.seconds.update = clock.lap();
    ++step_;
    if (step_ % avg_.period == 0) run_round(params);
    total_bytes_sent_ += stats_.bytes_sent;
    total_bytes_received_ += stats_.bytes_received;
    return stats_;
  }

  // An averaging round now, whatever the step count (e.g. before evaluating at the end of an
  // epoch). Collective.
  const step_stats& average(std::span<T> params) {
    check_size("params.size()", params.size());
    if (anchor_.empty() && total_) anchor_.assign(params.begin(), params.end());
    stats_ = step_stats{};
    stats_.step = step_;
    stats_.n = total_;
    run_round(params);
    total_bytes_sent_ += stats_.bytes_sent;
    total_bytes_received_ += stats_.bytes_received;
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

 private:
  void check_size(const char* what, std::size_t n) const {
    if (n != total_) {
      detail::throw_invalid_argument("periodic_averaging", what, n,
                                     detail::concat("the total of the tensor sizes (", total_, ")"));
    }
  }

  std::pair<std::size_t, std::size_t> slice(std::size_t t, unsigned c) const {
    const std::size_t n = tensors_[t].size;
    const std::size_t r = avg_.subsets;
    return {n / r * c + std::min<std::size_t>(c, n % r),
            n / r * (c + 1) + std::min<std::size_t>(c + 1, n % r)};
  }

  void run_round(std::span<T> params) {
    const unsigned c = static_cast<unsigned>(round_ % avg_.subsets);
    // Quantizers draw from (seed, step, tensor id); mixing the rank into the seed gives each
    // rank its own rounding noise, so that the noise averages out over the ranks instead of
    // adding up coherently (the dense selector picks the same coordinates everywhere anyway).
    const std::uint64_t seed =
        opt_.seed + 0x9e3779b97f4a7c15ULL * (static_cast<std::uint64_t>(comm_->rank()) + 1);
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      const auto [begin, end] = slice(t, c);
      if (begin == end) continue;
      const std::size_t m = end - begin;
      const std::size_t at = offsets_[t] + begin;
      auto& state = states_[t * avg_.subsets + c];
      change_.resize(m);
      for (std::size_t i = 0; i < m; ++i) change_[i] = params[at + i] - anchor_[at + i];
      const compress_context ctx{1.0, call_id{seed, round_, tensors_[t].id}};
      const compress_stats cs = compressor_.compress(change_, state, ctx, payload_);
      if (!avg_.error_feedback) {
        for (auto& b : state.buffers()) std::fill(b.begin(), b.end(), T(0));
      }
      mean_.resize(m);
      const exchange_stats xs = exchange_.exchange(*comm_, compressor_, payload_, std::span<T>(mean_));
      detail::stopwatch clock;
      for (std::size_t i = 0; i < m; ++i) {
        anchor_[at + i] += mean_[i];
        params[at + i] = anchor_[at + i];
      }
      tensor_stats ts;
      ts.id = tensors_[t].id;
      ts.n = m;
      ts.selected = cs.selection.count;
      ts.density = 1.0;
      ts.bytes_sent = xs.bytes_sent;
      ts.bytes_received = xs.bytes_received;
      ts.exchange = xs.name;
      ts.predicted_seconds = xs.predicted_seconds;
      ts.exchange_seconds = xs.seconds;
      stats_.tensors.push_back(ts);
      stats_.selected += ts.selected;
      stats_.bytes_sent += xs.bytes_sent;
      stats_.bytes_received += xs.bytes_received;
      stats_.seconds.accumulate += cs.seconds_accumulate;
      stats_.seconds.select += cs.seconds_select;
      stats_.seconds.encode += cs.seconds_encode;
      stats_.seconds.exchange += xs.seconds;
      stats_.seconds.update += clock.lap();
    }
    stats_.target_density = 1.0 / static_cast<double>(avg_.subsets);
    stats_.density = total_ ? static_cast<double>(stats_.selected) / static_cast<double>(total_) : 0.0;
    ++round_;
    last_round_step_ = step_;
  }

  Comm* comm_;
  std::vector<tensor_spec> tensors_;
  std::vector<std::size_t> offsets_;
  std::size_t total_ = 0;
  compressor_type compressor_;
  Exchange exchange_;
  sgd_options opt_;
  averaging_options avg_;
  std::vector<typename compressor_type::state_type> states_;  // [tensor][slice]
  std::vector<T> anchor_;    // the parameters at each slice's last averaging
  std::vector<T> velocity_;
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
