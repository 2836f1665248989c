// gradcomp/schedule/layerwise.hpp: LAGS-SGD (layer-wise adaptive gradient sparsification).
// Every layer is sparsified with a density of its own, and its compression and exchange run on
// a communication thread as soon as the backward pass has produced its gradient, overlapping
// with the backward pass of the layers before it. lags_densities() picks the densities from the
// measured backward time per layer and the link's alpha and beta (the formula is below);
// the statistics report how much of the communication the backward pass hid.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <gradcomp/concepts.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/exchange/cost_model.hpp>
#include <gradcomp/sparsified_sgd.hpp>

namespace gradcomp {

// LAGS's choice of densities. Layer l's exchange (a sparse allgather of k_l index/value pairs,
// (P-1) 8 k_l beta + log2(P) alpha) should hide behind the backward computation that runs
// while it is in flight: the backward pass of layer l-1. With m_l = 4 n_l, the bytes of layer
// l's fp32 gradient,
//     rho_l = (t_comp_l - log2(P) alpha) / (2 (P-1) beta m_l),  clamped to [rho_min, 1],
// where t_comp_l = backward_seconds[l-1] (layers in forward order; the backward pass runs from
// the last to the first). Layer 0's exchange has no computation left to hide behind: rho_min.
// One rank communicates nothing: every density is 1. Every rank must pass the same inputs
// (e.g. the maximum over ranks of the measured times) to get the same densities.
inline std::vector<double> lags_densities(std::span<const std::size_t> sizes,
                                          std::span<const double> backward_seconds,
                                          const link_model& link, int ranks, double rho_min) {
  if (backward_seconds.size() != sizes.size()) {
    detail::throw_invalid_argument("lags_densities", "backward_seconds.size()",
                                   backward_seconds.size(),
                                   detail::concat("sizes.size() (", sizes.size(), ")"));
  }
  (void)k_for_density(1, rho_min);  // 0 < rho_min <= 1
  if (ranks < 1) detail::throw_invalid_argument("lags_densities", "ranks", ranks, ">= 1");
  if (!(link.alpha >= 0.0) || !(link.beta >= 0.0)) {
    detail::throw_invalid_argument("lags_densities", "link",
                                   detail::concat(link.alpha, " s, ", link.beta, " s/byte"),
                                   "alpha >= 0 and beta >= 0");
  }
  std::vector<double> rho(sizes.size(), 1.0);
  if (ranks == 1) return rho;
  const double p = static_cast<double>(ranks);
  const double latency = std::log2(p) * link.alpha;
  for (std::size_t l = 0; l < sizes.size(); ++l) {
    const double hide = l == 0 ? 0.0 : backward_seconds[l - 1];
    if (!(hide >= 0.0)) {
      detail::throw_invalid_argument("lags_densities", "backward_seconds", hide, ">= 0");
    }
    const double budget = hide - latency;
    const double per_density = 2.0 * (p - 1.0) * link.beta * 4.0 * static_cast<double>(sizes[l]);
    double r = rho_min;
    if (budget > 0.0) r = per_density > 0.0 ? budget / per_density : 1.0;
    rho[l] = std::clamp(r, rho_min, 1.0);
  }
  return rho;
}

// The overlap a plan predicts, in layerwise_stats::overlap's terms: the share of the
// communication that runs before the backward pass ends. The backward pass produces layer l's
// gradient when the layers after it are done (layers in forward order, the pass from the last
// to the first); one communication thread exchanges the layers in that order, each as soon as
// it is ready and the thread is free, taking log2(P) alpha + 2 (P-1) beta 4 n_l rho_l (the
// model lags_densities() plans with; compression time is not modelled). 0 when nothing is
// communicated.
inline double lags_planned_overlap(std::span<const std::size_t> sizes,
                                   std::span<const double> backward_seconds, const link_model& link,
                                   int ranks, std::span<const double> densities) {
  if (backward_seconds.size() != sizes.size() || densities.size() != sizes.size()) {
    detail::throw_invalid_argument("lags_planned_overlap", "backward_seconds.size(), densities.size()",
                                   detail::concat(backward_seconds.size(), ", ", densities.size()),
                                   detail::concat("sizes.size() (", sizes.size(), ")"));
  }
  if (ranks < 1) detail::throw_invalid_argument("lags_planned_overlap", "ranks", ranks, ">= 1");
  if (!(link.alpha >= 0.0) || !(link.beta >= 0.0)) {
    detail::throw_invalid_argument("lags_planned_overlap", "link",
                                   detail::concat(link.alpha, " s, ", link.beta, " s/byte"),
                                   "alpha >= 0 and beta >= 0");
  }
  for (std::size_t l = 0; l < sizes.size(); ++l) {
    if (!(backward_seconds[l] >= 0.0)) {
      detail::throw_invalid_argument("lags_planned_overlap", detail::concat("backward_seconds[", l, "]"),
                                     backward_seconds[l], ">= 0");
    }
    if (!(densities[l] > 0.0 && densities[l] <= 1.0)) {
      detail::throw_invalid_argument("lags_planned_overlap", detail::concat("densities[", l, "]"),
                                     densities[l], "in (0, 1]");
    }
  }
  if (ranks == 1) return 0.0;
  const double p = static_cast<double>(ranks);
  double ready = 0.0, backward_end = 0.0, thread_free = 0.0, busy = 0.0, hidden = 0.0;
  for (const double b : backward_seconds) backward_end += b;
  for (std::size_t j = sizes.size(); j-- > 0;) {
    ready += backward_seconds[j];
    const double c = std::log2(p) * link.alpha +
                     2.0 * (p - 1.0) * link.beta * 4.0 * static_cast<double>(sizes[j]) * densities[j];
    const double begin = std::max(ready, thread_free);
    thread_free = begin + c;
    busy += c;
    hidden += std::clamp(std::min(thread_free, backward_end) - begin, 0.0, c);
  }
  return busy > 0.0 ? hidden / busy : 0.0;
}

// When one tensor's work ran on the communication thread, in seconds since begin_step().
struct layer_timing {
  std::uint32_t id = 0;
  double density = 0.0;     // target
  double ready = 0.0;       // ready() was called
  double comm_begin = 0.0;  // the communication thread took it up
  double comm_end = 0.0;    // compressed and exchanged (finish_step() applies it)
};

struct layerwise_stats {
  // The tensors' statistics merged (sums; tensors in the order they were exchanged).
  step_stats step;
  std::vector<layer_timing> layers;  // in the order they were exchanged
  double backward_seconds = 0.0;     // begin_step() to the call of finish_step()
  // Per tensor, the communication thread's time on it (compression and exchange), summed.
  double communication_seconds = 0.0;
  // The part of communication_seconds that ran before finish_step() was called, i.e. while
  // the backward pass was still computing.
  double overlapped_seconds = 0.0;
  double overlap = 0.0;       // overlapped / communication (0 without communication)
  double wait_seconds = 0.0;  // finish_step() waiting for the exchanges still in flight
};

namespace detail {

// A LAGS step's statistics (layerwise_sgd's and device_layerwise_sgd's finish_step), tensor by
// tensor in the order they were exchanged: add_layer() each, then finish_layers().
class layerwise_totals {
 public:
  explicit layerwise_totals(layerwise_stats& next) : next_(&next) {}

  // Tensor statistics `ts`, exchanged over [timing.comm_begin, timing.comm_end) of a step whose
  // backward pass ended at `backward_end`.
  void add_layer(const step_stats& ts, const layer_timing& timing, double backward_end) {
    layerwise_stats& next = *next_;
    next.layers.push_back(timing);
    const double busy = timing.comm_end - timing.comm_begin;
    next.communication_seconds += busy;
    next.overlapped_seconds +=
        std::clamp(std::min(timing.comm_end, backward_end) - timing.comm_begin, 0.0, busy);
    step_stats& s = next.step;
    s.n += ts.n;
    s.selected += ts.selected;
    s.bytes_sent += ts.bytes_sent;
    s.bytes_received += ts.bytes_received;
    s.seconds.accumulate += ts.seconds.accumulate;
    s.seconds.select += ts.seconds.select;
    s.seconds.encode += ts.seconds.encode;
    s.seconds.exchange += ts.seconds.exchange;
    s.seconds.update += ts.seconds.update;
    s.tensors.insert(s.tensors.end(), ts.tensors.begin(), ts.tensors.end());
    weighted_target_ += ts.target_density * static_cast<double>(ts.n);
  }

  // The step's density, target density (the tensors' weighted by size) and overlap.
  void finish_layers() {
    layerwise_stats& next = *next_;
    step_stats& s = next.step;
    if (s.n) {
      s.density = static_cast<double>(s.selected) / static_cast<double>(s.n);
      s.target_density = weighted_target_ / static_cast<double>(s.n);
    }
    if (next.communication_seconds > 0.0) {
      next.overlap = next.overlapped_seconds / next.communication_seconds;
    }
  }

 private:
  layerwise_stats* next_;
  double weighted_target_ = 0.0;
};

// The communication thread of a LAGS driver (layerwise_sgd; device_layerwise_sgd,
// cuda/layerwise.cuh): the tensors made ready, in that order, taken up one at a time by a
// thread this object owns, which runs work(j, t, skip) for the j-th of them (tensor t; skip:
// an earlier one failed, the ranks' collectives are out of step already) and keeps the first
// failure it returns. The thread stops, once nothing queued is left, when this object goes.
class ready_queue {
 public:
  using work_fn = std::function<std::exception_ptr(std::size_t j, std::size_t t, bool skip)>;

  explicit ready_queue(work_fn work) : work_(std::move(work)) {
    worker_ = std::thread([this] { run(); });
  }
  ready_queue(const ready_queue&) = delete;
  ready_queue& operator=(const ready_queue&) = delete;
  ~ready_queue() {
    {
      const std::lock_guard lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    worker_.join();
  }

  // A new step: nothing queued, no failure (nothing may be in flight).
  void reset() {
    const std::lock_guard lock(mu_);
    queue_.clear();
    next_ = 0;
    done_ = 0;
    error_ = nullptr;
  }

  // Queues tensor t after those queued before; at(j) runs first, under the queue's lock, with
  // its place j (the caller's record of when it was made ready).
  template <class At>
  void push(std::size_t t, At&& at) {
    {
      const std::lock_guard lock(mu_);
      at(queue_.size());
      queue_.push_back(t);
    }
    work_cv_.notify_one();
  }

  // Waits until every tensor queued is done; whether none failed.
  bool wait_all() {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [this] { return done_ == queue_.size(); });
    return !error_;
  }

  // The first failure (null: none), forgotten.
  std::exception_ptr take_error() {
    const std::lock_guard lock(mu_);
    return std::exchange(error_, nullptr);
  }

  // The tensors in the order they were made ready (with nothing in flight: after wait_all()).
  [[nodiscard]] const std::vector<std::size_t>& order() const noexcept { return queue_; }

 private:
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [this] { return stop_ || next_ < queue_.size(); });
      if (next_ == queue_.size()) return;  // stopped, nothing left
      const std::size_t j = next_++;
      const std::size_t t = queue_[j];
      const bool skip = error_ != nullptr;
      lock.unlock();
      std::exception_ptr failure = work_(j, t, skip);
      lock.lock();
      if (failure && !error_) error_ = failure;
      ++done_;
      done_cv_.notify_all();
    }
  }

  work_fn work_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  bool stop_ = false;
  std::vector<std::size_t> queue_;  // tensor indices in ready() order
  std::size_t next_ = 0;            // queue_[next_] is the next to take up
  std::size_t done_ = 0;
  std::exception_ptr error_;
  std::thread worker_;  // last: started once everything above exists
};

}  // namespace detail

// One sparsified_sgd per tensor, each with a constant density of its own, run by a
// communication thread that this object owns. A step:
//
//     sgd.begin_step(params, grads);   // flat buffers, untouched by the caller until finish_step()
//     // backward pass, last layer first; after tensor t's gradient is written and its
//     // parameters are no longer read:
//     sgd.ready(t);
//     const layerwise_stats& s = sgd.finish_step();   // waits, then every tensor is updated
//
// The communication thread compresses tensor t and exchanges it while the caller goes on with
// the backward pass; finish_step() applies every tensor's SGD update once all exchanges have
// succeeded. Every rank must call ready() for the same tensors in the same order (the
// exchanges are collectives and run in ready() order), and must not call the communicator
// itself between begin_step() and finish_step(): the thread is then its only user, from one
// thread at a time. With MPI this needs MPI_THREAD_SERIALIZED (mpi_environment(argc, argv,
// MPI_THREAD_SERIALIZED)); the constructor checks the level MPI granted.
//
// A step is all or nothing, as sparsified_sgd's: an exception on the communication thread
// skips the rest of the step's exchanges and is rethrown by finish_step(), and then no
// parameter, velocity, feedback buffer or counter has changed (the tensors exchanged before
// the failure are discarded too). The caller may retry the step, on a communicator that still
// works. Destroying the optimizer while a step is in flight waits for the exchanges already
// started.
template <class Compressor, class Exchange, class Comm>
class layerwise_sgd {
 public:
  using value_type = typename Compressor::value_type;
  using T = value_type;
  using optimizer_type = sparsified_sgd<Compressor, Exchange, Comm>;

  // densities[t] is tensor t's constant density (see lags_densities()).
  layerwise_sgd(Comm& comm, std::span<const tensor_spec> tensors, std::span<const double> densities,
                Compressor c = {}, Exchange x = {}, sgd_options opt = {})
      : tensors_(tensors.begin(), tensors.end()), densities_(densities.begin(), densities.end()) {
    if (densities.size() != tensors.size()) {
      detail::throw_invalid_argument("layerwise_sgd", "densities.size()", densities.size(),
                                     detail::concat("tensors.size() (", tensors.size(), ")"));
    }
    offsets_ = detail::tensor_offsets("layerwise_sgd", tensors_);
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      optimizers_.push_back(std::make_unique<optimizer_type>(
          comm, std::span<const tensor_spec>(&tensors_[t], 1), c, x, opt,
          density_schedule::constant(densities_[t])));
    }
    total_ = detail::total_size(tensors_);
    timings_.resize(tensors_.size());
    is_ready_.assign(tensors_.size(), false);
    // The exchanges run on a thread of their own: a communicator that needs to be told (MPI
    // without MPI_THREAD_SERIALIZED) refuses here, not in a collective later.
    if constexpr (checks_thread_support<Comm>) comm.require_thread_support("layerwise_sgd");
    queue_.emplace([this](std::size_t j, std::size_t t, bool skip) { return exchange(j, t, skip); });
  }

  layerwise_sgd(const layerwise_sgd&) = delete;
  layerwise_sgd& operator=(const layerwise_sgd&) = delete;

  // Starts a step on the flat buffers (tensors back to back, in the constructor's order).
  // Both must stay alive, and the caller must not write a tensor's gradient or touch its
  // parameters after ready() for it, until finish_step() returns.
  void begin_step(std::span<T> params, std::span<const T> grads) {
    if (in_step_) {
      detail::throw_invalid_argument("layerwise_sgd::begin_step", "state", "in a step",
                                     "finish_step() before the next begin_step()");
    }
    check_size("params.size()", params.size());
    check_size("grads.size()", grads.size());
    queue_->reset();
    params_ = params;
    grads_ = grads;
    std::fill(is_ready_.begin(), is_ready_.end(), false);
    start_ = clock::now();
    waited_ = false;
    in_step_ = true;
  }

  // Tensor t's gradient is complete: the communication thread compresses and exchanges it,
  // after the tensors made ready before it; finish_step() applies it.
  void ready(std::size_t t) {
    if (!in_step_) {
      detail::throw_invalid_argument("layerwise_sgd::ready", "state", "no step",
                                     "begin_step() first");
    }
    if (t >= tensors_.size()) {
      detail::throw_invalid_argument("layerwise_sgd::ready", "t", t,
                                     detail::concat("< the number of tensors (", tensors_.size(), ")"));
    }
    if (is_ready_[t]) {
      detail::throw_invalid_argument("layerwise_sgd::ready", "t", t, "each tensor once per step");
    }
    if (waited_) {
      detail::throw_invalid_argument("layerwise_sgd::ready", "state", "after wait_exchanges()",
                                     "every ready() before wait_exchanges() and finish_step()");
    }
    is_ready_[t] = true;
    queue_->push(t, [this](std::size_t j) { timings_[j].ready = since_start(); });
  }

  // Waits for the exchanges in flight and returns whether all of them succeeded, changing
  // nothing: for a caller that must agree with the other ranks before the step is applied
  // (module_lags). finish_step() or abandon_step() follows.
  bool wait_exchanges() {
    if (!in_step_) {
      detail::throw_invalid_argument("layerwise_sgd::wait_exchanges", "state", "no step",
                                     "begin_step() first");
    }
    if (!waited_) {
      backward_end_ = since_start();
      exchanged_ = queue_->wait_all();
      finished_ = since_start();
      waited_ = true;
    }
    return exchanged_;
  }

  // Ends the step without applying any of it, whatever its exchanges did: every tensor's staged
  // state is dropped and no parameter, velocity, feedback buffer or counter changes. The
  // tensors still to be made ready need not be.
  void abandon_step() {
    if (!in_step_) return;
    (void)wait_exchanges();
    for (const std::size_t t : queue_->order()) optimizers_[t]->discard_step();
    (void)queue_->take_error();
    in_step_ = false;
  }

  // The backward pass is over: waits for the exchanges in flight and reports the step. Every
  // tensor must have been made ready.
  const layerwise_stats& finish_step() {
    if (!in_step_) {
      detail::throw_invalid_argument("layerwise_sgd::finish_step", "state", "no step",
                                     "begin_step() first");
    }
    (void)wait_exchanges();
    const double backward_end = backward_end_;
    const double finished = finished_;
    in_step_ = false;
    const std::vector<std::size_t>& order = queue_->order();
    if (!exchanged_ || order.size() != tensors_.size()) {
      // Nothing of the step is kept: the tensors exchanged so far are discarded.
      for (const std::size_t t : order) optimizers_[t]->discard_step();
      if (std::exception_ptr e = queue_->take_error()) std::rethrow_exception(e);
      detail::throw_invalid_argument("layerwise_sgd::finish_step", "tensors made ready",
                                     order.size(), detail::concat("all ", tensors_.size()));
    }

    // Every exchange succeeded: apply the updates, in ready() order.
    layerwise_stats next;
    next.backward_seconds = backward_end;
    next.wait_seconds = finished - backward_end;
    next.step.step = step_;
    detail::layerwise_totals totals(next);
    for (std::size_t j = 0; j < order.size(); ++j) {
      const std::size_t t = order[j];
      const step_stats& ts =
          optimizers_[t]->commit_step(params_.subspan(offsets_[t], tensors_[t].size));
      layer_timing timing = timings_[j];
      timing.id = tensors_[t].id;
      timing.density = densities_[t];
      totals.add_layer(ts, timing, backward_end);
    }
    totals.finish_layers();
    stats_ = std::move(next);
    total_bytes_sent_ += stats_.step.bytes_sent;
    total_bytes_received_ += stats_.step.bytes_received;
    ++step_;
    return stats_;
  }

  [[nodiscard]] const layerwise_stats& last_stats() const noexcept { return stats_; }
  [[nodiscard]] std::uint64_t steps_done() const noexcept { return step_; }
  [[nodiscard]] std::size_t size() const noexcept { return total_; }
  [[nodiscard]] std::size_t total_bytes_sent() const noexcept { return total_bytes_sent_; }
  [[nodiscard]] std::size_t total_bytes_received() const noexcept { return total_bytes_received_; }
  [[nodiscard]] const std::vector<tensor_spec>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] const std::vector<double>& densities() const noexcept { return densities_; }
  // Tensor t's own optimizer (feedback state, checkpoints); not during a step.
  [[nodiscard]] optimizer_type& optimizer(std::size_t t) { return *optimizers_.at(t); }

 private:
  using clock = std::chrono::steady_clock;

  void check_size(const char* what, std::size_t n) const {
    if (n != total_) {
      detail::throw_invalid_argument("layerwise_sgd::begin_step", what, n,
                                     detail::concat("the total of the tensor sizes (", total_, ")"));
    }
  }

  double since_start() const {
    return std::chrono::duration<double>(clock::now() - start_).count();
  }

  // The communication thread's work on the j-th tensor made ready, t (skip: an earlier one
  // failed): its exchange and when it ran.
  std::exception_ptr exchange(std::size_t j, std::size_t t, bool skip) {
    const double begin = since_start();
    std::exception_ptr failure;
    if (!skip) {
      try {
        optimizers_[t]->exchange_step(grads_.subspan(offsets_[t], tensors_[t].size));
      } catch (...) {
        failure = std::current_exception();
      }
    }
    timings_[j].comm_begin = begin;
    timings_[j].comm_end = since_start();
    return failure;
  }

  std::vector<tensor_spec> tensors_;
  std::vector<double> densities_;
  std::vector<std::size_t> offsets_;
  std::size_t total_ = 0;
  std::vector<std::unique_ptr<optimizer_type>> optimizers_;

  // Caller's side only (grads_, start_ and timings_ also used by the communication thread:
  // written before the tensors they concern are queued, or read after wait_all()).
  bool in_step_ = false;
  bool waited_ = false;  // wait_exchanges() ran in this step
  bool exchanged_ = false;  // and every exchange succeeded
  double backward_end_ = 0.0, finished_ = 0.0;
  std::vector<bool> is_ready_;
  layerwise_stats stats_;
  std::uint64_t step_ = 0;
  std::size_t total_bytes_sent_ = 0;
  std::size_t total_bytes_received_ = 0;
  std::span<T> params_;
  std::span<const T> grads_;
  clock::time_point start_{};
  std::vector<layer_timing> timings_;  // by queue position

  std::optional<detail::ready_queue> queue_;  // last: its thread stops before the rest goes
};

}  // namespace gradcomp
