// gradcomp/cuda/periodic_averaging.cuh: device_periodic_averaging<Quantizer, Exchange, Comm>,
// the device twin of periodic_averaging (PQASGD, schedule/periodic_averaging.hpp): the same
// quantizer and exchange types, sgd_options, averaging_options, step_stats and checkpoint
// format, with parameters, gradients, anchor, velocity and error feedback in device memory and
// the rounds over a device_communicator (nccl_comm, or cuda::staged_comm over a host
// communicator). Every call runs on comm.stream(); the caller's gradient must be ready there.
//
// A step: the gradient is checked for NaN and Inf (one small read back: a refused gradient
// changes nothing), then the local SGD update on the device (sgd_kernel, the host's operations
// one for one); every `period` steps, a round. Round r averages slice c = r mod R of every
// tensor (the host's slices) by a device_sparsified_sgd<compressor<dense, Q, residual>, X,
// Comm> over those slices (one per slice index c, made once): the change params - anchor of
// each slice is gathered into its flat buffer, exchange_step runs with the host round's
// call_id (seed mixed with the rank, step = r, rank field 0: the host's draws bit for bit),
// commit_exchange keeps its residual (zeroed afterwards where error_feedback is false), and
// anchor += mean, params = anchor over the slices. The result is the host's bit for bit where
// the host's is deterministic: the dense step's exchange is the host's dense_allreduce or
// sparse_allgather, bit for bit where its communicator adds in rank order (staged_comm over a
// host communicator; ncclAllReduce adds in its own order).
//
// All or nothing, as the host's: a step that ends with a round keeps a device copy of the
// parameters and the velocity; a round that throws (a peer failed, a non-finite change, a
// rejected payload) restores them, and the round's driver changed nothing (its transaction).
// Checkpoints are the host periodic_averaging's bytes: either driver loads the other's.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <memory>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <gradcomp/compressor.hpp>
#include <gradcomp/cuda/dispatch/launch.cuh>
#include <gradcomp/cuda/dispatch/sgd.cuh>
#include <gradcomp/cuda/kernels/step_kernels.cuh>
#include <gradcomp/cuda/memory.cuh>
#include <gradcomp/cuda/sparsified_sgd.cuh>
#include <gradcomp/detail/checkpoint.hpp>
#include <gradcomp/detail/sgd_checkpoint.hpp>
#include <gradcomp/detail/timer.hpp>
#include <gradcomp/device.hpp>
#include <gradcomp/engine/tensor_record.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/schedule/periodic_averaging.hpp>
#include <gradcomp/select/dense.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp {

namespace cuda::step_impl {

// anchor[i] += mean[i]; params[i] = anchor[i] for i < n: a round's result over one slice (the
// host's anchor_[at + i] += mean_[at + i]; params[at + i] = anchor_[at + i]).
template <class T>
__global__ void take_mean_kernel(T* anchor, T* params, const T* mean, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const T a = __fadd_rn(anchor[i], mean[i]);
    anchor[i] = a;
    params[i] = a;
  }
}

}  // namespace cuda::step_impl

template <class Quantizer, class Exchange, class Comm>
class device_periodic_averaging {
 public:
  using value_type = float;
  using T = float;
  using compressor_type = compressor<dense, Quantizer, residual, float>;
  // A round's exchange, over one slice index's slices (its checks name device_sparsified_sgd).
  using round_driver = device_sparsified_sgd<compressor_type, Exchange, Comm>;

  device_periodic_averaging(Comm& comm, std::span<const tensor_spec> tensors, Quantizer q = {},
                            Exchange x = {}, sgd_options opt = {}, averaging_options avg = {})
      : comm_(&comm), tensors_(tensors.begin(), tensors.end()), opt_(opt), avg_(avg) {
    // The host driver's checks, in its order and with its words.
    if (avg_.period < 1) detail::throw_invalid_argument(driver_name, "period", avg_.period, ">= 1");
    if (avg_.subsets < 1) {
      detail::throw_invalid_argument(driver_name, "subsets", avg_.subsets, ">= 1");
    }
    detail::check_sgd_options(driver_name, opt_);
    offsets_ = detail::tensor_offsets(driver_name, tensors_);
    for (const tensor_spec& t : tensors_) detail::check_tensor_size(driver_name, t, true);
    total_ = detail::total_size(tensors_);
    // Slice index c's parts (the non-empty slices, in tensor order) and its round driver, whose
    // tensors are those slices under their tensors' ids. Its own sgd_options are never used
    // for an update (commit_exchange), nor its seed (every round passes its call_id).
    parts_.resize(avg_.subsets);
    std::size_t change_capacity = 0;  // the largest round's elements
    for (unsigned c = 0; c < avg_.subsets; ++c) {
      std::vector<tensor_spec> specs;
      std::size_t pos = 0;
      for (std::size_t t = 0; t < tensors_.size(); ++t) {
        const auto [begin, end] = slice(t, c);
        if (begin == end) continue;
        parts_[c].push_back(part{t, offsets_[t] + begin, end - begin, pos});
        specs.push_back(tensor_spec{tensors_[t].id, end - begin});
        pos += end - begin;
      }
      // The dense device step over sparse_allgather numbers its coordinates in 32 bits: refused
      // here, with this driver's name (the host's periodic_averaging has no such bound).
      if (std::is_same_v<Exchange, sparse_allgather> && pos > (std::size_t{1} << 32)) {
        detail::throw_invalid_argument(
            driver_name, "the elements of one round's slices", pos,
            "<= 2^32 with sparse_allgather (the dense device step's 32-bit indices; more "
            "subsets make each round's slices smaller)");
      }
      change_capacity = std::max(change_capacity, pos);
      rounds_.push_back(specs.empty() ? nullptr
                                      : std::make_unique<round_driver>(
                                            comm, specs, compressor_type(dense{}, q), x,
                                            sgd_options{}, density_schedule::constant(1.0)));
    }
    if (total_) {
      anchor_.resize(total_);
      saved_params_.resize(total_);
    }
    if (opt_.momentum > 0.0 && total_) {
      velocity_.resize(total_);
      saved_velocity_.resize(total_);
      detail::cuda_check(cudaMemsetAsync(velocity_.data(), 0, total_ * sizeof(T), stream()),
                         "cudaMemsetAsync");
    }
    change_.resize(std::max<std::size_t>(change_capacity, 1));
    errors_.resize(1);
    detail::cuda_check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
  }

  device_periodic_averaging(const device_periodic_averaging&) = delete;
  device_periodic_averaging& operator=(const device_periodic_averaging&) = delete;

  // One local SGD step, then a round if this was the p-th step since the last one (the host's
  // step()). Collective on the steps with a round only. All or nothing.
  const step_stats& step(device_span<T> params, device_span<const T> grads) {
    check_size("params.size()", params.size());
    check_size("grads.size()", grads.size());
    refuse_nonfinite(grads);
    const bool with_round = (step_ + 1) % avg_.period == 0;
    const bool new_anchor = !has_anchor_ && total_;
    if (new_anchor) copy(anchor_.data(), params.data(), total_);
    if (with_round) {
      copy(saved_params_.data(), params.data(), total_);
      if (velocity_.size()) copy(saved_velocity_.data(), velocity_.data(), total_);
    }
    has_anchor_ = has_anchor_ || new_anchor;
    step_stats next;
    next.step = step_;
    next.n = total_;
    detail::stopwatch clock;
    update(params, grads);
    next.seconds.update = clock.lap();
    if (with_round) {
      try {
        run_round(params, next);
      } catch (...) {
        // Best effort where the error is the device's own: the round's error is reported.
        cudaMemcpyAsync(params.data(), saved_params_.data(), total_ * sizeof(T),
                        cudaMemcpyDeviceToDevice, stream());
        if (velocity_.size()) std::swap(velocity_, saved_velocity_);
        if (new_anchor) has_anchor_ = false;
        cudaStreamSynchronize(stream());
        throw;
      }
      last_round_step_ = step_ + 1;
    }
    ++step_;
    finish(std::move(next));
    return stats_;
  }

  // A round now, whatever the step count (the host's average()). Collective; all or nothing.
  const step_stats& average(device_span<T> params) {
    check_size("params.size()", params.size());
    step_stats next;
    next.step = step_;
    next.n = total_;
    const bool new_anchor = !has_anchor_ && total_;
    if (new_anchor) copy(anchor_.data(), params.data(), total_);
    has_anchor_ = has_anchor_ || new_anchor;
    try {
      run_round(params, next);
    } catch (...) {
      if (new_anchor) has_anchor_ = false;
      throw;
    }
    last_round_step_ = step_;
    finish(std::move(next));
    return stats_;
  }

  [[nodiscard]] bool just_averaged() const noexcept {
    return last_round_step_ == step_ && step_ > 0;
  }
  [[nodiscard]] const step_stats& last_stats() const noexcept { return stats_; }
  [[nodiscard]] std::uint64_t steps_done() const noexcept { return step_; }
  [[nodiscard]] std::uint64_t rounds_done() const noexcept { return round_; }
  [[nodiscard]] std::size_t size() const noexcept { return total_; }
  [[nodiscard]] std::size_t total_bytes_sent() const noexcept { return total_bytes_sent_; }
  [[nodiscard]] std::size_t total_bytes_received() const noexcept { return total_bytes_received_; }
  [[nodiscard]] const averaging_options& options() const noexcept { return avg_; }
  [[nodiscard]] cudaStream_t stream() const { return comm_->stream(); }

  // The host periodic_averaging's checkpoint, byte for byte. Waits for the stream.
  void save_state(std::ostream& os) const {
    detail::put_averaging_header<T>(os, {step_, round_, last_round_step_}, avg_.subsets,
                                    tensors_);
    const std::vector<T> anchor = download(anchor_.data(), has_anchor_ ? total_ : 0);
    const std::vector<T> velocity = download(velocity_.data(), velocity_.size());
    detail::put_sized(os, std::span<const T>(anchor));
    detail::put_sized(os, std::span<const T>(velocity));
    // Slice s = t R + c (the host's order): one buffer, the residual of that slice.
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      for (unsigned c = 0; c < avg_.subsets; ++c) {
        const auto [begin, end] = slice(t, c);
        std::vector<T> e;
        if (begin != end) {
          const device_span<const T> d = rounds_[c]->residual(index_in_round(t, c));
          e = download(d.data(), d.size());
        }
        detail::put(os, std::uint32_t{1});
        detail::put(os, static_cast<std::uint64_t>(e.size()));
        detail::put_array(os, std::span<const T>(e));
      }
    }
    if (!os) {
      throw error(
          "gradcomp::device_periodic_averaging::save_state: the stream failed while writing");
    }
  }

  // Loads the host's format (either driver's); checks all of it and changes nothing unless it
  // all matches.
  void load_state(std::istream& is) {
    const detail::averaging_counters at =
        detail::get_averaging_header<T>(is, driver_name, avg_.subsets, tensors_);
    const std::vector<T> anchor = detail::get_sized<T>(is, driver_name, "anchor", {0, total_});
    const std::vector<T> velocity =
        detail::get_sized<T>(is, driver_name, "velocity", {velocity_.size(), velocity_.size()});
    // Each slice index's residuals, flat in its round driver's order.
    std::vector<std::vector<T>> residuals(avg_.subsets);
    for (unsigned c = 0; c < avg_.subsets; ++c) {
      residuals[c].resize(parts_[c].empty() ? 0 : parts_[c].back().pos + parts_[c].back().n);
    }
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      for (unsigned c = 0; c < avg_.subsets; ++c) {
        const auto [begin, end] = slice(t, c);
        if (const auto nbuf = get<std::uint32_t>(is); nbuf != 1) {
          fail_load(
              detail::concat("a slice has ", nbuf, " feedback buffers in the checkpoint, 1 here"));
        }
        if (const auto n = get<std::uint64_t>(is); n != end - begin) {
          fail_load(detail::concat("a feedback buffer has ", n, " elements in the checkpoint, ",
                                   end - begin, " here"));
        }
        if (begin == end) continue;
        const part& pt = parts_[c][index_in_round(t, c)];
        detail::get_array(is, std::span<T>(residuals[c].data() + pt.pos, pt.n), driver_name);
      }
    }
    // Everything read and checked: now the device state (each round driver's residuals through
    // its own checkpoint format, which it checks again; only a CUDA error can fail from here,
    // and then the drivers loaded before it keep what they loaded).
    for (unsigned c = 0; c < avg_.subsets; ++c) {
      if (!rounds_[c]) continue;
      const round_driver& d = *rounds_[c];
      std::stringstream ss;
      detail::save_sgd_checkpoint<T>(
          ss, "device_sparsified_sgd", d.steps_done(), d.tensors(),
          [&](std::size_t i) {
            const part& pt = parts_[c][i];
            return std::vector<std::span<const T>>{
                std::span<const T>(residuals[c].data() + pt.pos, pt.n)};
          },
          std::span<const T>());
      rounds_[c]->load_state(ss);
    }
    if (!anchor.empty()) upload(anchor_.data(), anchor);
    if (!velocity.empty()) upload(velocity_.data(), velocity);
    detail::cuda_check(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
    has_anchor_ = !anchor.empty();
    step_ = at.step;
    round_ = at.round;
    last_round_step_ = at.last_round_step;
  }

 private:
  static constexpr std::string_view driver_name = "device_periodic_averaging";
  static constexpr unsigned threads = 256;
  static constexpr std::size_t max_blocks = 4096;

  // Slice c of tensor t: flat elements [at, at + n), at [pos, pos + n) of the round's buffers.
  struct part {
    std::size_t t = 0;
    std::size_t at = 0;
    std::size_t n = 0;
    std::size_t pos = 0;
  };

  [[noreturn]] static void fail_load(const std::string& why) {
    detail::fail_load(driver_name, why);
  }
  template <class V>
  static V get(std::istream& is) {
    return detail::get<V>(is, driver_name);
  }
  void check_size(const char* what, std::size_t n) const {
    if (n != total_) {
      detail::throw_invalid_argument(
          driver_name, what, n, detail::concat("the total of the tensor sizes (", total_, ")"));
    }
  }

  // The host's slices.
  std::pair<std::size_t, std::size_t> slice(std::size_t t, unsigned c) const {
    return detail::averaging_slice(tensors_[t].size, avg_.subsets, c);
  }

  // Tensor t's place among slice index c's parts (its slice is not empty).
  std::size_t index_in_round(std::size_t t, unsigned c) const {
    std::size_t i = 0;
    while (parts_[c][i].t != t) ++i;
    return i;
  }

  void copy(T* to, const T* from, std::size_t n) const {
    if (!n) return;
    detail::cuda_check(cudaMemcpyAsync(to, from, n * sizeof(T), cudaMemcpyDeviceToDevice, stream()),
                       "cudaMemcpyAsync");
  }
  std::vector<T> download(const T* p, std::size_t n) const {
    return detail::download_on(stream(), p, n);
  }
  void upload(T* p, const std::vector<T>& v) const { detail::upload_on(stream(), p, v); }

  // The host's first check: a NaN or Inf in the gradient is refused before anything changes
  // (one read back of the first such index, and of its value where there is one).
  void refuse_nonfinite(device_span<const T> grads) {
    if (!total_) return;
    const cudaStream_t s = stream();
    detail::cuda_check(cudaMemsetAsync(errors_.data(), 0xff, sizeof(cuda::error_record), s),
                       "cudaMemsetAsync");
    cuda::step_impl::first_nonfinite_kernel<T>
        <<<cuda::grid_for(total_, threads, max_blocks), threads, 0, s>>>(grads.data(), total_,
                                                                        errors_.data());
    cuda::check_launch("first_nonfinite_kernel");
    cuda::error_record first{};
    detail::cuda_check(cudaMemcpyAsync(&first, errors_.data(), sizeof(first),
                                       cudaMemcpyDeviceToHost, s),
                       "cudaMemcpyAsync");
    detail::cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    if (first.first == cuda::no_error) return;
    const auto bad = static_cast<std::size_t>(first.first);
    const std::vector<T> value = download(grads.data() + bad, 1);
    throw nonfinite_error(detail::concat("gradcomp::device_periodic_averaging::step: the gradient "
                                         "holds ", value[0], " at index ", bad,
                                         "; nothing was changed"));
  }

  // The local step: detail::sgd_update's operations (sgd_kernel), on this rank's gradient.
  void update(device_span<T> params, device_span<const T> g) {
    cuda::launch_sgd_update(params.data(), g.data(), velocity_.data(), total_, opt_, stream());
  }

  void finish(step_stats&& next) {
    stats_ = std::move(next);
    total_bytes_sent_ += stats_.bytes_sent;
    total_bytes_received_ += stats_.bytes_received;
  }

  // One round: slice c's changes exchanged by its round driver (a throw there changes nothing:
  // its transaction), then, once they have all arrived, the round driver keeps its staged
  // residual and the anchor and the parameters take the means. Nothing after the exchange can
  // fail but a CUDA error (a failed launch or memset), which would leave the round driver's
  // residual kept while step() restores the parameters.
  void run_round(device_span<T> params, step_stats& st) {
    const unsigned c = static_cast<unsigned>(round_ % avg_.subsets);
    const cudaStream_t s = stream();
    // The host round's call_id: the rank mixed into the seed, the round as the step.
    const std::uint64_t seed = detail::averaging_round_seed(opt_.seed, comm_->rank());
    if (rounds_[c]) {
      round_driver& d = *rounds_[c];
      for (const part& pt : parts_[c]) {
        cuda::step_impl::subtract_kernel<T>
            <<<cuda::grid_for(pt.n, threads, max_blocks), threads, 0, s>>>(
                change_.data() + pt.pos, params.data() + pt.at, anchor_.data() + pt.at, pt.n);
        cuda::check_launch("subtract_kernel");
      }
      const std::size_t m = parts_[c].back().pos + parts_[c].back().n;
      d.exchange_step(device_span<const T>(change_.data(), m), call_id{seed, round_, 0, 0});
      const step_stats& rs = d.commit_exchange();
      if (!avg_.error_feedback) d.clear_feedback();
      detail::stopwatch clock;
      const T* mean = d.averaged_gradient().data();
      for (const part& pt : parts_[c]) {
        cuda::step_impl::take_mean_kernel<T>
            <<<cuda::grid_for(pt.n, threads, max_blocks), threads, 0, s>>>(
                anchor_.data() + pt.at, params.data() + pt.at, mean + pt.pos, pt.n);
        cuda::check_launch("take_mean_kernel");
      }
      for (const tensor_stats& ts : rs.tensors) detail::add_tensor(st, ts);
      st.seconds.update += clock.lap();
    }
    st.target_density = 1.0 / static_cast<double>(avg_.subsets);
    detail::finish_totals(st);
    ++round_;
  }

  Comm* comm_;
  std::vector<tensor_spec> tensors_;
  std::vector<std::size_t> offsets_;
  std::size_t total_ = 0;
  sgd_options opt_;
  averaging_options avg_;
  std::vector<std::vector<part>> parts_;                // [c]: slice index c's non-empty slices
  std::vector<std::unique_ptr<round_driver>> rounds_;  // [c]: null where every slice is empty
  device_buffer<T> anchor_;  // the parameters at each slice's last averaging
  bool has_anchor_ = false;  // the host's !anchor_.empty()
  device_buffer<T> velocity_;
  device_buffer<T> saved_params_;    // a step with a round restores these when the round fails
  device_buffer<T> saved_velocity_;
  device_buffer<T> change_;
  device_buffer<cuda::error_record> errors_;
  step_stats stats_;
  std::uint64_t step_ = 0;
  std::uint64_t round_ = 0;
  std::uint64_t last_round_step_ = 0;
  std::size_t total_bytes_sent_ = 0;
  std::size_t total_bytes_received_ = 0;
};

}  // namespace gradcomp
