// gradcomp/torch/device_module.hpp: the module drivers of torch/module.hpp for a
// torch::nn::Module whose parameters are on a CUDA device: device_module_sgd (module_sgd over
// the device-resident step, device_sparsified_sgd, cuda/sparsified_sgd.cuh),
// device_module_averaging (module_averaging over cuda/periodic_averaging.cuh) and
// device_module_lags (module_lags over cuda/layerwise.cuh), on the module's flat buffers,
// which stay on the device; no gradient or parameter passes through host memory.
//
//     // drivers.cu, compiled by nvcc (no torch header there):
//     gradcomp::cuda::device_driver_factory make_driver(gradcomp::nccl_comm& comm) {
//       return gradcomp::cuda::device_sgd_factory<compressor<topk, identity, residual>,
//                                                 sparse_allgather>(comm, {}, {}, options, schedule);
//     }
//     // train.cpp, compiled by the host compiler with LibTorch:
//     gradcomp::torch_module::device_module_sgd opt(model, make_driver(comm));
//     loss.backward();
//     opt.step(c10::cuda::getCurrentCUDAStream().stream());  // torch's current stream: every
//     opt.zero_grad();   // .grad() on the device is exchanged, the parameters updated in place
//
// The split is the compilers': the driver launches kernels (nvcc), LibTorch's headers need the
// host compiler (nvcc 13 in C++20 mode refuses torch 1.13's), and the two meet through the
// virtual interface of cuda/device_driver.hpp. The tensors, their ids and order, the layouts,
// merged groups and checkpoints keyed by name are module_sgd's (module_layout.hpp); the
// driver's options (compressor, exchange, sgd_options, density schedule) are the factory's.
//
// Streams: the driver runs on its communicator's stream. step(compute) orders it after the work
// queued on `compute` with an event, and the work queued on `compute` afterwards (the next
// forward pass) after the update, with another: no host wait beyond the driver's own.
// `compute` must be torch's current stream (c10::cuda::getCurrentCUDAStream().stream();
// nullptr where the caller never set one, the legacy default stream): autograd accumulates
// the gradients there, and zero_grad(), step()'s copies between the module and the flat
// buffers (the per-parameter layout, or a replaced .grad()) and the next forward pass run
// there too. It is not read from torch here: that needs libc10_cuda, which a torch without
// CUDA lacks. A step that throws changes no parameter and no state (the driver's
// transaction), and `compute` is still made to wait for what the driver queued.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <istream>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <type_traits>
#include <utility>

#include <torch/nn/module.h>

#include <gradcomp/cuda/device_driver.hpp>
#include <gradcomp/cuda/memory.cuh>  // detail::cuda_check (host code only)
#include <gradcomp/error.hpp>
#include <gradcomp/torch/module.hpp>

namespace gradcomp::torch_module {

// What the device module drivers share: the module's flat buffers on one
// CUDA device (module_base), the check that the current device is theirs, and a driver's call
// on its own stream ordered between the work queued on torch's stream before and after it.
class device_module_base : public module_base<float> {
  using base = module_base<float>;

 protected:
  device_module_base(torch::nn::Module& m, module_layout layout,
                     const std::optional<merge_plan>& groups, const char* who, bool has_factory)
      : base(m, layout, groups, parameter_device::cuda) {
    int current = -1;
    detail::cuda_check(cudaGetDevice(&current), "cudaGetDevice");
    const int where = this->params_.front().tensor.device().index();
    if (current != where) {
      detail::throw_invalid_argument(who, "the current CUDA device", current,
                                     detail::concat("the parameters' device, ", where,
                                                    " (cudaSetDevice first)"));
    }
    if (!has_factory) {
      detail::throw_invalid_argument(who, "make", "an empty factory",
                                     "a factory of device drivers (cuda/device_driver.cuh)");
    }
    cudaEvent_t e = nullptr;
    detail::cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                       "cudaEventCreateWithFlags");
    event_.reset(e);
  }

  // The driver a factory returned: there, and over the module's elements.
  void check_driver(const char* who, bool made, std::size_t size) const {
    if (!made) {
      detail::throw_invalid_argument(who, "make", "a factory that returned no driver",
                                     "a factory of device drivers (cuda/device_driver.cuh)");
    }
    const auto n = static_cast<std::size_t>(this->flat_.params.numel());
    if (size != n) {
      detail::throw_invalid_argument(who, "the driver's size()", size,
                                     detail::concat("the module's ", n, " parameter elements"));
    }
  }

  device_span<float> params() { return {this->flat_.params.data_ptr<float>(), elements()}; }
  device_span<const float> grads() { return {this->flat_.grads.data_ptr<float>(), elements()}; }

  // work() (a driver's call, on `own`) after what `compute` has queued, and what `compute`
  // queues next after it, whether it returns or throws (then the ordering is best effort: the
  // call's own error is the one reported).
  template <class Work>
  const step_stats& ordered(cudaStream_t compute, cudaStream_t own, Work&& work) {
    detail::cuda_check(cudaEventRecord(event_.get(), compute), "cudaEventRecord");
    detail::cuda_check(cudaStreamWaitEvent(own, event_.get(), 0), "cudaStreamWaitEvent");
    return followed(compute, own, std::forward<Work>(work));
  }

  // work(), then what `compute` queues next after what `own` has queued, whether work
  // returns or throws (then best effort, as above).
  template <class Work>
  decltype(auto) followed(cudaStream_t compute, cudaStream_t own, Work&& work) {
    try {
      decltype(auto) out = work();
      detail::cuda_check(cudaEventRecord(event_.get(), own), "cudaEventRecord");
      detail::cuda_check(cudaStreamWaitEvent(compute, event_.get(), 0), "cudaStreamWaitEvent");
      return out;
    } catch (...) {
      cudaEventRecord(event_.get(), own);
      cudaStreamWaitEvent(compute, event_.get(), 0);
      throw;
    }
  }

 private:
  struct destroy_event {
    void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
  };

  std::size_t elements() const { return static_cast<std::size_t>(this->flat_.params.numel()); }

  std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, destroy_event> event_;
};

// device_module_sgd's and device_module_averaging's common part: a driver of type Driver
// (cuda/device_driver.hpp) made once by a factory with the module's tensors, its step on the
// flat buffers ordered with torch's stream, and checkpoints keyed by tensor name.
template <class Driver, class Factory>
class device_module_of : public device_module_base {
 public:
  // Every parameter of m must be a contiguous float tensor on one CUDA device (refused
  // otherwise, naming the parameter, before the factory is called); `make` is called once with
  // the tensors. The current CUDA device must be the parameters' (the driver's buffers, stream
  // and events are made there; refused otherwise, before the factory is called).
  device_module_of(torch::nn::Module& m, const Factory& make, module_layout layout,
                   const std::optional<merge_plan>& groups, const char* who)
      : device_module_base(m, layout, groups, who, static_cast<bool>(make)) {
    driver_ = make(detail_module::specs(this->groups_));
    check_driver(who, driver_ != nullptr, driver_ ? driver_->size() : 0);
  }

  // One step on every rank, on the module's .grad() (zero where undefined); the parameters are
  // updated in place. `compute`: torch's current stream, where the backward pass ran and the
  // next forward pass runs (c10::cuda::getCurrentCUDAStream().stream(); nullptr where the
  // caller never set one).
  const step_stats& step(cudaStream_t compute) {
    this->sync_buffers();
    const step_stats& s =
        ordered(compute, driver_->stream(), [&]() -> const step_stats& {
          return driver_->step(params(), grads());
        });
    this->sync_module();
    return s;
  }

  // Checkpoints keyed by tensor name, as module_sgd's: the driver's state is in its host twin's
  // format, so a checkpoint moves between the host and device module drivers.
  void save(std::ostream& os) const { this->save_with(os, *driver_); }
  void load(std::istream& is) { this->load_with(is, *driver_); }

  [[nodiscard]] Driver& driver() noexcept { return *driver_; }
  [[nodiscard]] const Driver& driver() const noexcept { return *driver_; }

 protected:
  std::unique_ptr<Driver> driver_;
};

// module_sgd for CUDA parameters over the device-resident step (above).
class device_module_sgd
    : public device_module_of<cuda::device_step_driver, cuda::device_driver_factory> {
 public:
  device_module_sgd(torch::nn::Module& m, const cuda::device_driver_factory& make,
                    module_layout layout = module_layout::flat,
                    const std::optional<merge_plan>& groups = {})
      : device_module_of(m, make, layout, groups, "device_module_sgd") {}
};

// module_averaging (PQASGD) for a module whose parameters are on a CUDA device: local SGD
// steps on the device, and every `period` steps a round of device_periodic_averaging
// (cuda/periodic_averaging.cuh), behind cuda::device_averaging_driver, made by nvcc:
//
//     // drivers.cu (nvcc):
//     gradcomp::cuda::averaging_driver_factory make_driver(gradcomp::nccl_comm& comm) {
//       return gradcomp::cuda::device_averaging_factory<fp16, dense_allreduce>(comm, {}, {},
//                                                                          options, {4, 1});
//     }
//     // train.cpp (the host compiler, LibTorch):
//     gradcomp::torch_module::device_module_averaging opt(model, make_driver(comm));
//     opt.step(c10::cuda::getCurrentCUDAStream().stream());
//
// The parameters must be equal on every rank before the first step (broadcast them). Streams,
// the transaction and the layouts are device_module_sgd's; checkpoints keyed by tensor name
// move between it and module_averaging.
class device_module_averaging
    : public device_module_of<cuda::device_averaging_driver, cuda::averaging_driver_factory> {
 public:
  device_module_averaging(torch::nn::Module& m, const cuda::averaging_driver_factory& make,
                          module_layout layout = module_layout::flat,
                          const std::optional<merge_plan>& groups = {})
      : device_module_of(m, make, layout, groups, "device_module_averaging") {}

  // A round now unless the last step ended with one (e.g. before evaluating). Collective.
  void average(cudaStream_t compute) {
    if (driver_->just_averaged()) return;
    this->sync_buffers();
    ordered(compute, driver_->stream(),
            [&]() -> const step_stats& { return driver_->average(params()); });
    this->sync_module();
  }
};

// module_lags (LAGS-SGD) for a module whose parameters are on a CUDA device: autograd's hooks
// release each tensor, in module_lags's fixed order, as its gradient is complete, and
// device_layerwise_sgd (cuda/layerwise.cuh, behind cuda::device_layerwise_driver) exchanges it
// on the communicator's stream while the backward pass goes on on the compute stream; the
// overlap is measured with CUDA events. Always the flat layout. A step:
//
//     const cudaStream_t compute = c10::cuda::getCurrentCUDAStream().stream();
//     lags.begin_step(compute);   // before backward(): gradients zeroed, hooks armed
//     loss.backward();
//     lags.finish_step();         // waits for the exchanges; every parameter updated, or none
//
// The missing-gradient agreement, the refusals and the transaction are module_lags's (one
// collective of one number through the driver); `compute` then waits for the updates.
// Construct it while `compute` is torch's current stream: autograd accumulates a parameter's
// gradient on the stream that was current when its gradient accumulator was made, and the
// constructor makes them (holding them, with their hooks, as long as it lives).
class device_module_lags : public device_module_base {
 public:
  // densities[i] for the i-th tensor in registration order (module_lags's).
  device_module_lags(torch::nn::Module& m, const cuda::layerwise_driver_factory& make,
                     std::span<const double> densities,
                     const std::optional<merge_plan>& groups = {})
      : device_module_base(m, module_layout::flat, groups, "device_module_lags",
                           static_cast<bool>(make)),
        release_(this->groups_, this->params_.size()) {
    driver_ = make(detail_module::specs(this->groups_),
                   release_.by_name(densities, "torch_module::device_module_lags"));
    check_driver("device_module_lags", driver_ != nullptr, driver_ ? driver_->size() : 0);
    hooks_.emplace(this->params_,
                   [this](std::size_t param) { release_.gradient_done(*driver_, param); },
                   "device_module_lags");
  }

  device_module_lags(const device_module_lags&) = delete;
  device_module_lags& operator=(const device_module_lags&) = delete;

  // Before backward(): the gradients are zeroed (in place, on torch's current stream, which
  // must be `compute`) and the hooks armed.
  void begin_step(cudaStream_t compute) {
    this->sync_buffers();
    {
      at::NoGradGuard no_grad;
      this->flat_.grads.zero_();
    }
    compute_ = compute;
    release_.arm([&] { driver_->begin_step(params(), grads(), compute); });
  }

  // After backward(): module_lags's agreement, then every update (or none); the compute
  // stream waits for them.
  const layerwise_stats& finish_step() {
    return followed(compute_, driver_->stream(), [this]() -> const layerwise_stats& {
      return release_.finish(
          *driver_, driver_->rank(),
          [this](double mine) {
            return static_cast<double>(driver_->agree_max(static_cast<float>(mine)));
          },
          "device_module_lags");
    });
  }

  [[nodiscard]] cuda::device_layerwise_driver& driver() noexcept { return *driver_; }
  [[nodiscard]] const cuda::device_layerwise_driver& driver() const noexcept { return *driver_; }

 private:
  detail_module::lags_release release_;
  std::unique_ptr<cuda::device_layerwise_driver> driver_;
  cudaStream_t compute_ = nullptr;
  // Last: removed (and silenced) before the members they call into go.
  std::optional<detail_module::accumulator_hooks> hooks_;
};

}  // namespace gradcomp::torch_module
