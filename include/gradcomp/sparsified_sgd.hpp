// gradcomp/sparsified_sgd.hpp: sparsified_sgd<Compressor, Exchange, Communicator>, the
// synchronous data-parallel SGD driver. Each step compresses every tensor's gradient, exchanges
// it, averages, and applies the update; it reports what it selected, sent and spent, and the
// feedback state can be checkpointed.
#pragma once

#include <algorithm>
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
#include <gradcomp/detail/sgd_checkpoint.hpp>
#include <gradcomp/detail/nonfinite.hpp>
#include <gradcomp/engine/staged_feedback.hpp>
#include <gradcomp/engine/tensor_record.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/sgd.hpp>
#include <gradcomp/sparse.hpp>

namespace gradcomp {

template <class Compressor, class Exchange, class Comm>
class sparsified_sgd {
  static_assert(communicator<Comm>,
                "sparsified_sgd<C, X, Comm>: Comm is not a gradcomp::communicator: it needs "
                "rank(), size(), barrier(), and allreduce, allgatherv, alltoallv and broadcast "
                "of the element types listed in gradcomp/concepts.hpp.");
  static_assert(gradcomp::exchange<Exchange, Compressor, Comm>,
                "sparsified_sgd<C, X, Comm>: X is not a gradcomp::exchange for this compressor: "
                "it needs `exchange_stats exchange(Comm&, const C&, const payload&, "
                "std::span<value_type>)`.");

 public:
  using value_type = typename Compressor::value_type;
  using T = value_type;

  // Tensors with ids 0, 1, ... in the order of layer_sizes.
  sparsified_sgd(Comm& comm, const std::vector<std::size_t>& layer_sizes, Compressor c = {},
                 Exchange x = {}, sgd_options opt = {},
                 density_schedule schedule = density_schedule::constant(1.0))
      : sparsified_sgd(comm, detail::tensor_specs(layer_sizes), std::move(c), std::move(x), opt,
                       schedule) {}

  // Tensors with explicit ids (taken as a span so that a braced list of sizes picks the
  // constructor above).
  sparsified_sgd(Comm& comm, std::span<const tensor_spec> tensors, Compressor c, Exchange x,
                 sgd_options opt, density_schedule schedule)
      : comm_(&comm), tensors_(tensors.begin(), tensors.end()), compressor_(std::move(c)),
        exchange_(std::move(x)), opt_(opt), schedule_(schedule) {
    check_options();
    offsets_ = detail::tensor_offsets("sparsified_sgd", tensors_);
    for (const tensor_spec& t : tensors_) {
      detail::check_tensor_size("sparsified_sgd", t, selects_all_v<typename Compressor::selector_type>);
    }
    for (const tensor_spec& t : tensors_) feedback_.add(compressor_, t.size);
    total_ = detail::total_size(tensors_);
    average_.assign(total_, T(0));
    staged_average_.assign(total_, T(0));
    if (opt_.momentum > 0.0) velocity_.assign(total_, T(0));
  }

  // One synchronous step on every rank: compress every tensor's gradient, exchange each (or all
  // at once, for an exchange that fuses tensors), hand picks an exchange left out back to the
  // feedback, then params -= lr * update. Sizes and the gradient's finiteness are checked for
  // all tensors before any state changes (the finiteness by compressor<> itself, per tensor,
  // into the staged state).
  //
  // A step is all or nothing: when it throws (a bad argument, a peer that failed, an exchange
  // that rejected a payload), the parameters, the velocity, every feedback buffer, the step
  // counter, the statistics and averaged_gradient() are exactly what they were before, so the
  // caller can retry the step or save a checkpoint. The feedback state is compressed into a
  // second copy that is kept only when every exchange has succeeded (twice the feedback's
  // memory, no extra pass over it).
  const step_stats& step(std::span<T> params, std::span<const T> grads) {
    check_size("params.size()", params.size());
    exchange_step(grads);
    return commit_step(params);
  }

  // step() in two halves, for a driver that runs the exchanges elsewhere and applies the
  // updates later (layerwise_sgd). exchange_step() compresses and exchanges every tensor into
  // staged state and changes nothing that can be observed; commit_step() then applies the
  // update, keeps the staged state and counts the step, and cannot fail once its argument is
  // checked; discard_step() drops a staged step (another tensor's exchange failed). Every
  // rank must stage and commit or discard the same steps.
  void exchange_step(std::span<const T> grads) {
    staged_ready_ = false;
    check_gradient(grads);
    const double rho = schedule_.at(step_);
    staged_stats_ = step_stats{};
    staged_stats_.step = step_;
    staged_stats_.target_density = rho;
    staged_stats_.n = total_;

    payloads_.resize(tensors_.size());
    compress_stats_.resize(tensors_.size());
    feedback_.discard();  // a step staged but never committed
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      compress_stats_[t] = feedback_.compress(compressor_, t, gradient_of(t, grads),
                                              context_for(t, rho), payloads_[t]);
    }

    exchange_stats_.resize(tensors_.size());
    restored_.assign(tensors_.size(), 0);
    if constexpr (fuses_tensors<Exchange, Compressor, Comm>) {
      exchange_.exchange_tensors(*comm_, std::as_const(compressor_),
                                 std::span<const payload>(payloads_), staged_average_views(),
                                 std::span<exchange_stats>(exchange_stats_));
    } else {
      for (std::size_t t = 0; t < tensors_.size(); ++t) exchange_tensor(t);
    }

    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      detail::add_tensor(staged_stats_, detail::tensor_stats_of(tensors_[t].id, tensors_[t].size,
                                                                compress_stats_[t],
                                                                exchange_stats_[t], restored_[t]));
    }
    detail::finish_totals(staged_stats_);
    staged_ready_ = true;
  }

  const step_stats& commit_step(std::span<T> params) {
    check_size("params.size()", params.size());
    if (!staged_ready_) {
      detail::throw_invalid_argument("sparsified_sgd::commit_step", "state", "no staged step",
                                     "a successful exchange_step() first");
    }
    detail::stopwatch clock;
    detail::sgd_update<T>(params.first(total_), staged_average_, velocity_, opt_);
    staged_stats_.seconds.update = clock.lap();
    feedback_.commit();
    average_.swap(staged_average_);
    stats_ = std::move(staged_stats_);
    total_bytes_sent_ += stats_.bytes_sent;
    total_bytes_received_ += stats_.bytes_received;
    ++step_;
    staged_ready_ = false;
    return stats_;
  }

  void discard_step() noexcept {
    feedback_.discard();
    staged_ready_ = false;
  }

  [[nodiscard]] const step_stats& last_stats() const noexcept { return stats_; }
  [[nodiscard]] std::uint64_t steps_done() const noexcept { return step_; }
  [[nodiscard]] std::size_t size() const noexcept { return total_; }
  [[nodiscard]] std::size_t total_bytes_sent() const noexcept { return total_bytes_sent_; }
  [[nodiscard]] std::size_t total_bytes_received() const noexcept { return total_bytes_received_; }
  [[nodiscard]] const std::vector<tensor_spec>& tensors() const noexcept { return tensors_; }
  // The last averaged gradient (before weight decay and momentum).
  [[nodiscard]] std::span<const T> averaged_gradient() const noexcept { return average_; }
  [[nodiscard]] Compressor& compressor() noexcept { return compressor_; }
  // The exchange, e.g. to tune topk_a2a's bucket size between steps.
  [[nodiscard]] Exchange& exchange() noexcept { return exchange_; }
  [[nodiscard]] typename Compressor::state_type& feedback_state(std::size_t tensor_index) {
    return feedback_.committed(tensor_index);
  }

  // Checkpoints: the step counter, every tensor's feedback buffers keyed by tensor id, and
  // the optimizer's velocity. load_state() accepts the tensors in any order, checks ids,
  // sizes, element type and buffer counts, and changes nothing unless all of it matches.
  void save_state(std::ostream& os) const {
    detail::save_sgd_checkpoint<T>(
        os, driver_name, step_, tensors_,
        [&](std::size_t t) {
          // buffers() hands out mutable spans for load_state(); here they are only read.
          std::vector<std::span<const T>> out;
          for (const auto& b :
               const_cast<typename Compressor::state_type&>(feedback_.committed(t)).buffers()) {
            out.emplace_back(b.data(), b.size());
          }
          return out;
        },
        std::span<const T>(velocity_));
  }

  void load_state(std::istream& is) {
    std::vector<typename Compressor::state_type> states;
    states.reserve(tensors_.size());
    for (const auto& t : tensors_) states.push_back(compressor_.make_state(t.size));
    std::vector<T> velocity(velocity_.size());
    const std::uint64_t step = detail::load_sgd_checkpoint<T>(
        is, driver_name, tensors_,
        [&](std::size_t t) {
          std::vector<std::span<T>> out;
          for (const auto& b : states[t].buffers()) out.emplace_back(b.data(), b.size());
          return out;
        },
        std::span<T>(velocity));
    feedback_.replace_committed(std::move(states));
    velocity_ = std::move(velocity);
    step_ = step;
    staged_ready_ = false;
  }

 private:
  // This rank, for call_id::rank: each rank rounds with its own quantize stream.
  std::uint32_t rank_id() const { return static_cast<std::uint32_t>(comm_->rank()); }

  void check_options() const {
    detail::check_sgd_options("sparsified_sgd", opt_);
    if constexpr (applies_momentum_v<typename Compressor::feedback_type>) {
      if (opt_.momentum != 0.0) {
        detail::throw_invalid_argument(
            "sparsified_sgd", "momentum", opt_.momentum,
            "0 with dgc_momentum feedback (it applies momentum before compression)");
      }
    }
  }

  std::size_t tensor_of(std::size_t flat_index) const {
    const auto it = std::upper_bound(offsets_.begin(), offsets_.end(), flat_index);
    return static_cast<std::size_t>(it - offsets_.begin()) - 1;
  }

  void check_size(const char* what, std::size_t n) const {
    if (n != total_) {
      detail::throw_invalid_argument("sparsified_sgd::step", what, n,
                                     detail::concat("the total of the tensor sizes (", total_, ")"));
    }
  }

  // gradcomp's compressor<> refuses a NaN or Inf itself, per tensor, before the staged state
  // is kept: in the pass that writes it (compressor::checks_in_pass) or by reading the gradient
  // first, which also gives ||g||^2 for the contraction where g is what it selects from. Only a
  // compressor of another kind needs the check of every gradient here.
  static constexpr bool compressor_checks = requires { Compressor::checks_in_pass; };

  void check_gradient(std::span<const T> grads) const {
    check_size("grads.size()", grads.size());
    if (!compressor_checks && compressor_.nonfinite() == nonfinite_policy::error) {
      if (const std::size_t bad = detail::first_nonfinite(grads); bad != total_) {
        const std::size_t t = tensor_of(bad);
        throw nonfinite_error(detail::concat(
            "gradcomp::sparsified_sgd::step: gradient of tensor ", tensors_[t].id, " holds ",
            grads[bad], " at index ", bad - offsets_[t],
            "; nonfinite_policy::error (the default) rejects non-finite gradients before any "
            "state changes"));
      }
    }
  }

  std::span<const T> gradient_of(std::size_t t, std::span<const T> grads) const {
    return grads.subspan(offsets_[t], tensors_[t].size);
  }
  std::span<T> staged_average_of(std::size_t t) {
    return std::span<T>(staged_average_).subspan(offsets_[t], tensors_[t].size);
  }
  std::span<const std::span<T>> staged_average_views() {
    average_views_.resize(tensors_.size());
    for (std::size_t t = 0; t < tensors_.size(); ++t) average_views_[t] = staged_average_of(t);
    return average_views_;
  }

  compress_context context_for(std::size_t t, double rho) const {
    // The gradient's finiteness was checked for all tensors at once (check_gradient), unless
    // the compressor is gradcomp's, which checks each tensor itself (compressor_checks).
    const bool finite_checked =
        !compressor_checks && compressor_.nonfinite() == nonfinite_policy::error;
    return compress_context{rho, call_id{opt_.seed, step_, tensors_[t].id, rank_id()}, finite_checked};
  }

  // Tensor t's exchange into its part of the staged average. Picks the exchange left out
  // (gTop-k) go back to the staged feedback state, so that nothing is lost, when the feedback
  // can take them.
  void exchange_tensor(std::size_t t) {
    if constexpr (exchange_with_unused<Exchange, Compressor, Comm>) {
      exchange_stats_[t] =
          exchange_.exchange(*comm_, compressor_, payloads_[t], staged_average_of(t), unused_);
      restored_[t] = feedback_.restore(compressor_, t, unused_.indices, unused_.values);
    } else {
      exchange_stats_[t] = exchange_.exchange(*comm_, compressor_, payloads_[t], staged_average_of(t));
    }
  }

  static constexpr std::string_view driver_name = "sparsified_sgd";

  Comm* comm_;
  std::vector<tensor_spec> tensors_;
  std::vector<std::size_t> offsets_;
  std::size_t total_ = 0;
  Compressor compressor_;
  Exchange exchange_;
  sgd_options opt_;
  density_schedule schedule_;
  detail::staged_feedback<Compressor> feedback_;  // committed, and what a step in flight makes
  std::vector<T> average_;
  std::vector<T> staged_average_;
  std::vector<T> velocity_;
  // Per tensor, reused from step to step.
  std::vector<payload> payloads_;
  std::vector<compress_stats> compress_stats_;
  std::vector<exchange_stats> exchange_stats_;
  std::vector<std::size_t> restored_;  // picks given back to the feedback
  std::vector<std::span<T>> average_views_;
  unused_picks unused_;
  step_stats stats_;
  step_stats staged_stats_;
  bool staged_ready_ = false;
  std::uint64_t step_ = 0;
  std::size_t total_bytes_sent_ = 0;
  std::size_t total_bytes_received_ = 0;
};

}  // namespace gradcomp
