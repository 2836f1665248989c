// gradcomp/cuda/layerwise.cuh: device_layerwise_sgd<Compressor, Exchange, Comm>, the device twin
// of layerwise_sgd (LAGS-SGD, schedule/layerwise.hpp): one device_sparsified_sgd per tensor,
// each with a constant density of its own, run by a communication thread this object owns, on
// the communicator's stream, while the backward pass goes on on the caller's (compute) stream.
//
//     sgd.begin_step(params, grads, compute);   // device buffers; compute: torch's stream
//     // backward pass, last layer first; once tensor t's gradient has been queued on compute:
//     sgd.ready(t);             // an event on compute; the thread's stream waits for it
//     sgd.finish_step();        // waits for the exchanges, then every update (on the comm stream)
//
// ready(t) records an event on the compute stream; the communication thread makes the
// communicator's stream wait for it, then runs tensor t's exchange_step there (its host waits
// block that thread only, not the backward pass). finish_step() applies every tensor's update
// (commit_step, on the communicator's stream, in ready() order) once all exchanges have
// succeeded, and the caller orders its next work after that stream (device_module_lags does).
// The same contract as the host's: every rank makes the same tensors ready in the same order,
// nobody else uses the communicator during a step, and a step is all or nothing (an exchange
// that fails skips the rest, finish_step() rethrows it, and no parameter, velocity, feedback
// buffer or counter has changed). The results are the host layerwise_sgd's bit for bit where
// each tensor's device step is the host's (cuda/sparsified_sgd.cuh).
//
// The timings are measured with CUDA events, on the device's clock from begin_step()'s event on
// the compute stream: a layer is ready when the compute stream has done the work queued before
// ready(t), its communication begins when the communicator's stream starts it (after that and
// after the layer before it) and ends when its exchange's last work is done; the backward pass
// ends when the compute stream has done the work queued before wait_exchanges() (or
// finish_step()). layerwise_stats' overlap is then the share of the communication the GPU ran
// while the backward pass was still running on it; wait_seconds is how long the communication
// went on after the backward pass (0 when it ended first).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/sparsified_sgd.cuh>
#include <gradcomp/device.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/schedule/layerwise.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp {

template <class Compressor, class Exchange, class Comm>
class device_layerwise_sgd {
 public:
  using value_type = float;
  using T = float;
  using optimizer_type = device_sparsified_sgd<Compressor, Exchange, Comm>;

  // densities[t] is tensor t's constant density (lags_densities()). The current CUDA device
  // is the one the communication thread works on.
  device_layerwise_sgd(Comm& comm, std::span<const tensor_spec> tensors,
                       std::span<const double> densities, Compressor c = {}, Exchange x = {},
                       sgd_options opt = {})
      : comm_(&comm), tensors_(tensors.begin(), tensors.end()),
        densities_(densities.begin(), densities.end()) {
    if (densities.size() != tensors.size()) {
      detail::throw_invalid_argument(driver_name, "densities.size()", densities.size(),
                                     detail::concat("tensors.size() (", tensors.size(), ")"));
    }
    offsets_ = detail::tensor_offsets(driver_name, tensors_);
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      optimizers_.push_back(std::make_unique<optimizer_type>(
          comm, std::span<const tensor_spec>(&tensors_[t], 1), c, x, opt,
          density_schedule::constant(densities_[t])));
    }
    total_ = detail::total_size(tensors_);
    detail::cuda_check(cudaGetDevice(&device_), "cudaGetDevice");
    start_ = make_event();
    backward_end_ = make_event();
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      ready_events_.push_back(make_event());
      begin_events_.push_back(make_event());
      end_events_.push_back(make_event());
    }
    is_ready_.assign(tensors_.size(), false);
    agreement_.resize(1);
    // The exchanges run on a thread of their own: a communicator that needs to be told (MPI
    // under staged_comm without MPI_THREAD_SERIALIZED) refuses here, not in a collective later.
    if constexpr (checks_thread_support<Comm>) comm.require_thread_support(driver_name);
    queue_.emplace([this](std::size_t j, std::size_t t, bool skip) { return exchange(j, t, skip); });
  }

  device_layerwise_sgd(const device_layerwise_sgd&) = delete;
  device_layerwise_sgd& operator=(const device_layerwise_sgd&) = delete;

  // Starts a step on the flat device buffers (tensors back to back, in the constructor's
  // order), whose gradients are written by work queued on `compute` (nullptr: the legacy
  // default stream). The caller must not write a tensor's gradient or its parameters after
  // ready() for it, until finish_step() returns.
  void begin_step(device_span<T> params, device_span<const T> grads, cudaStream_t compute) {
    if (in_step_) {
      detail::throw_invalid_argument("device_layerwise_sgd::begin_step", "state", "in a step",
                                     "finish_step() before the next begin_step()");
    }
    check_size("params.size()", params.size());
    check_size("grads.size()", grads.size());
    // nullptr is the legacy default stream, as torch's, also in a program compiled with
    // --default-stream per-thread (ready() may be called from autograd's thread).
    if (compute == nullptr) compute = cudaStreamLegacy;
    detail::cuda_check(cudaEventRecord(start_.get(), compute), "cudaEventRecord");
    queue_->reset();
    params_ = params;
    grads_ = grads;
    compute_ = compute;
    std::fill(is_ready_.begin(), is_ready_.end(), false);
    waited_ = false;
    in_step_ = true;
  }

  // Tensor t's gradient has been queued on the compute stream: the communication thread
  // exchanges it once that work is done, after the tensors made ready before it.
  void ready(std::size_t t) {
    if (!in_step_) {
      detail::throw_invalid_argument("device_layerwise_sgd::ready", "state", "no step",
                                     "begin_step() first");
    }
    if (t >= tensors_.size()) {
      detail::throw_invalid_argument(
          "device_layerwise_sgd::ready", "t", t,
          detail::concat("< the number of tensors (", tensors_.size(), ")"));
    }
    if (is_ready_[t]) {
      detail::throw_invalid_argument("device_layerwise_sgd::ready", "t", t,
                                     "each tensor once per step");
    }
    if (waited_) {
      detail::throw_invalid_argument("device_layerwise_sgd::ready", "state",
                                     "after wait_exchanges()",
                                     "every ready() before wait_exchanges() and finish_step()");
    }
    queue_->push(t, [&](std::size_t j) {
      detail::cuda_check(cudaEventRecord(ready_events_[j].get(), compute_), "cudaEventRecord");
      is_ready_[t] = true;
    });
  }

  // Waits for the exchanges in flight and returns whether all of them succeeded, changing
  // nothing (layerwise_sgd's). finish_step() or abandon_step() follows.
  bool wait_exchanges() {
    if (!in_step_) {
      detail::throw_invalid_argument("device_layerwise_sgd::wait_exchanges", "state", "no step",
                                     "begin_step() first");
    }
    if (!waited_) {
      // The exchanges are waited for even where the record fails (its error is then thrown,
      // and abandon_step() can end the step).
      const cudaError_t recorded = cudaEventRecord(backward_end_.get(), compute_);
      exchanged_ = queue_->wait_all();
      waited_ = true;
      if (recorded != cudaSuccess) exchanged_ = false;
      detail::cuda_check(recorded, "cudaEventRecord");
    }
    return exchanged_;
  }

  // After wait_exchanges(), with the communicator free: the largest of every rank's `mine`
  // (one allreduce of one float on the communicator's stream; module_lags's agreement on
  // whether a rank's backward pass missed a gradient: mine = rank + 1 there, else 0).
  float agree_max(float mine) {
    if (!in_step_ || !waited_) {
      detail::throw_invalid_argument("device_layerwise_sgd::agree_max", "state",
                                     "no step waited for", "begin_step(), then wait_exchanges()");
    }
    const cudaStream_t s = stream();
    detail::cuda_check(cudaMemcpyAsync(agreement_.data(), &mine, sizeof(float),
                                       cudaMemcpyHostToDevice, s),
                       "cudaMemcpyAsync");
    comm_->allreduce(device_span<float>(agreement_.data(), 1), reduce_op::max);
    float out = 0.0f;
    detail::cuda_check(cudaMemcpyAsync(&out, agreement_.data(), sizeof(float),
                                       cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return out;
  }

  // Ends the step without applying any of it (layerwise_sgd's).
  void abandon_step() {
    if (!in_step_) return;
    (void)wait_exchanges();
    for (const std::size_t t : queue_->order()) optimizers_[t]->discard_step();
    (void)queue_->take_error();
    in_step_ = false;
  }

  // The backward pass has been queued: waits for the exchanges, then queues every update on
  // the communicator's stream and reports the step (its timings waited for). Every tensor
  // must have been made ready.
  const layerwise_stats& finish_step() {
    if (!in_step_) {
      detail::throw_invalid_argument("device_layerwise_sgd::finish_step", "state", "no step",
                                     "begin_step() first");
    }
    (void)wait_exchanges();
    in_step_ = false;
    const std::vector<std::size_t>& order = queue_->order();
    if (!exchanged_ || order.size() != tensors_.size()) {
      for (const std::size_t t : order) optimizers_[t]->discard_step();
      if (std::exception_ptr e = queue_->take_error()) std::rethrow_exception(e);
      detail::throw_invalid_argument("device_layerwise_sgd::finish_step", "tensors made ready",
                                     order.size(), detail::concat("all ", tensors_.size()));
    }
    // The timings, on the device's clock, all read before anything is committed: every event
    // recorded is waited for (the exchanges' last work and the backward pass's). A CUDA error
    // here discards the step, as a failed exchange does.
    layerwise_stats next;
    std::vector<layer_timing> timings(order.size());
    double backward_end = 0.0, last_end = 0.0;
    try {
      if (!order.empty()) {
        detail::cuda_check(cudaEventSynchronize(end_events_[order.size() - 1].get()),
                           "cudaEventSynchronize");
      }
      detail::cuda_check(cudaEventSynchronize(backward_end_.get()), "cudaEventSynchronize");
      backward_end = seconds_to(backward_end_.get());
      last_end = backward_end;
      for (std::size_t j = 0; j < order.size(); ++j) {
        layer_timing& timing = timings[j];
        timing.id = tensors_[order[j]].id;
        timing.density = densities_[order[j]];
        timing.ready = seconds_to(ready_events_[j].get());
        timing.comm_begin = seconds_to(begin_events_[j].get());
        timing.comm_end = seconds_to(end_events_[j].get());
        last_end = std::max(last_end, timing.comm_end);
      }
    } catch (...) {
      for (const std::size_t t : order) optimizers_[t]->discard_step();
      throw;
    }
    next.backward_seconds = backward_end;
    next.wait_seconds = last_end - backward_end;
    next.step.step = step_;
    // The updates, in ready() order (commit_step fails only with a CUDA error: a failed launch).
    detail::layerwise_totals totals(next);
    for (std::size_t j = 0; j < order.size(); ++j) {
      const std::size_t t = order[j];
      const step_stats& ts = optimizers_[t]->commit_step(
          device_span<T>(params_.data() + offsets_[t], tensors_[t].size));
      totals.add_layer(ts, timings[j], backward_end);
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
  [[nodiscard]] cudaStream_t stream() const { return comm_->stream(); }
  // Tensor t's own device step (feedback state, checkpoints); not during a step.
  [[nodiscard]] optimizer_type& optimizer(std::size_t t) { return *optimizers_.at(t); }

 private:
  static constexpr std::string_view driver_name = "device_layerwise_sgd";

  struct destroy_event {
    void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
  };
  using event_ptr = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, destroy_event>;

  static event_ptr make_event() {
    cudaEvent_t e = nullptr;
    detail::cuda_check(cudaEventCreate(&e), "cudaEventCreate");  // with timing
    return event_ptr(e);
  }

  // Seconds from begin_step()'s event to e (both done).
  double seconds_to(cudaEvent_t e) const {
    float ms = 0.0f;
    detail::cuda_check(cudaEventElapsedTime(&ms, start_.get(), e), "cudaEventElapsedTime");
    return static_cast<double>(ms) / 1000.0;
  }

  void check_size(const char* what, std::size_t n) const {
    if (n != total_) {
      detail::throw_invalid_argument(
          "device_layerwise_sgd::begin_step", what, n,
          detail::concat("the total of the tensor sizes (", total_, ")"));
    }
  }

  // The communication thread's work on the j-th tensor made ready, t (skip: an earlier one
  // failed): its stream waits for the compute stream's work before its ready(), then its
  // exchange, between two events.
  std::exception_ptr exchange(std::size_t j, std::size_t t, bool skip) {
    std::exception_ptr failure;
    try {
      detail::cuda_check(cudaSetDevice(device_), "cudaSetDevice");
      const cudaStream_t s = stream();
      detail::cuda_check(cudaStreamWaitEvent(s, ready_events_[j].get(), 0),
                         "cudaStreamWaitEvent");
      detail::cuda_check(cudaEventRecord(begin_events_[j].get(), s), "cudaEventRecord");
      if (!skip) {
        optimizers_[t]->exchange_step(
            device_span<const T>(grads_.data() + offsets_[t], tensors_[t].size));
      }
    } catch (...) {
      failure = std::current_exception();
    }
    // Recorded whatever happened, so that finish_step()'s timings can be read; where the
    // record itself fails, the step fails with it.
    const cudaError_t recorded = cudaEventRecord(end_events_[j].get(), stream());
    if (recorded != cudaSuccess && !failure) {
      try {
        detail::cuda_check(recorded, "cudaEventRecord");
      } catch (...) {
        failure = std::current_exception();
      }
    }
    return failure;
  }

  Comm* comm_;
  std::vector<tensor_spec> tensors_;
  std::vector<double> densities_;
  std::vector<std::size_t> offsets_;
  std::size_t total_ = 0;
  std::vector<std::unique_ptr<optimizer_type>> optimizers_;
  int device_ = 0;
  event_ptr start_, backward_end_;
  // By queue position: recorded on the compute stream at ready(), and on the communicator's
  // stream as the exchange begins and ends.
  std::vector<event_ptr> ready_events_, begin_events_, end_events_;
  device_buffer<float> agreement_;

  // Caller's side only (grads_ also read by the communication thread: written before the
  // tensors it concerns are queued).
  bool in_step_ = false;
  bool waited_ = false;
  bool exchanged_ = false;  // wait_exchanges(): every exchange succeeded
  std::vector<bool> is_ready_;
  layerwise_stats stats_;
  std::uint64_t step_ = 0;
  std::size_t total_bytes_sent_ = 0;
  std::size_t total_bytes_received_ = 0;
  device_span<T> params_;
  device_span<const T> grads_;
  cudaStream_t compute_ = nullptr;

  std::optional<detail::ready_queue> queue_;  // last: its thread stops before the rest goes
};

}  // namespace gradcomp
