// gradcomp/cuda/device_driver.hpp: the device-resident drivers behind virtual interfaces, so
// that code compiled by the host compiler alone (a LibTorch training loop:
// torch/device_module.hpp) can drive them: device_sparsified_sgd<C, X, Comm>
// (device_step_driver), device_periodic_averaging<Q, X, Comm> (device_averaging_driver) and
// device_layerwise_sgd<C, X, Comm> (device_layerwise_driver). They launch kernels, so they are
// compiled by nvcc; LibTorch's headers are not (nvcc 13 in C++20 mode refuses torch 1.13's).
// The two meet here: a translation unit compiled by nvcc makes a factory
// (cuda/device_driver.cuh: device_sgd_factory, device_averaging_factory,
// device_layerwise_factory), and the host side calls it with its tensors and steps the driver
// it returns. Needs the CUDA runtime's header only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <istream>
#include <memory>
#include <ostream>
#include <span>

#include <gradcomp/device.hpp>
#include <gradcomp/schedule/layerwise.hpp>
#include <gradcomp/sgd.hpp>

namespace gradcomp::cuda {

// What a device step driver offers its host-side caller: device_sparsified_sgd's step,
// statistics and checkpoints. Every call runs on stream(); step() returns once the step's
// exchange is done, with the update queued on stream().
class device_step_driver {
 public:
  virtual ~device_step_driver() = default;
  // params and grads: device memory of size() floats, not overlapping (the gradient ready on
  // stream()).
  virtual const step_stats& step(device_span<float> params, device_span<const float> grads) = 0;
  [[nodiscard]] virtual std::size_t size() const = 0;
  [[nodiscard]] virtual cudaStream_t stream() const = 0;
  [[nodiscard]] virtual const step_stats& last_stats() const = 0;
  [[nodiscard]] virtual std::uint64_t steps_done() const = 0;
  virtual void save_state(std::ostream& os) const = 0;
  virtual void load_state(std::istream& is) = 0;
};

// Makes a driver over the given tensors (their ids and sizes, in the flat buffer's order).
using device_driver_factory =
    std::function<std::unique_ptr<device_step_driver>(std::span<const tensor_spec>)>;

// What a device periodic averaging driver (PQASGD: cuda/periodic_averaging.cuh) offers its
// host-side caller: device_periodic_averaging's local steps, rounds, statistics and
// checkpoints, every call on stream().
class device_averaging_driver {
 public:
  virtual ~device_averaging_driver() = default;
  // A local step, and a round every `period` steps (collective then only).
  virtual const step_stats& step(device_span<float> params, device_span<const float> grads) = 0;
  // A round now (collective).
  virtual const step_stats& average(device_span<float> params) = 0;
  [[nodiscard]] virtual bool just_averaged() const = 0;
  [[nodiscard]] virtual std::size_t size() const = 0;
  [[nodiscard]] virtual cudaStream_t stream() const = 0;
  [[nodiscard]] virtual const step_stats& last_stats() const = 0;
  [[nodiscard]] virtual std::uint64_t steps_done() const = 0;
  [[nodiscard]] virtual std::uint64_t rounds_done() const = 0;
  virtual void save_state(std::ostream& os) const = 0;
  virtual void load_state(std::istream& is) = 0;
};

using averaging_driver_factory =
    std::function<std::unique_ptr<device_averaging_driver>(std::span<const tensor_spec>)>;

// What a device LAGS driver (cuda/layerwise.cuh: device_layerwise_sgd) offers its host-side
// caller (device_module_lags): the step in its parts, as layerwise_sgd's, with the compute
// stream the gradients are written on.
class device_layerwise_driver {
 public:
  virtual ~device_layerwise_driver() = default;
  virtual void begin_step(device_span<float> params, device_span<const float> grads,
                          cudaStream_t compute) = 0;
  virtual void ready(std::size_t t) = 0;
  virtual bool wait_exchanges() = 0;
  // After wait_exchanges(): the largest of every rank's `mine` (one collective).
  virtual float agree_max(float mine) = 0;
  virtual void abandon_step() = 0;
  virtual const layerwise_stats& finish_step() = 0;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual std::size_t size() const = 0;
  [[nodiscard]] virtual cudaStream_t stream() const = 0;
  [[nodiscard]] virtual const layerwise_stats& last_stats() const = 0;
  [[nodiscard]] virtual std::uint64_t steps_done() const = 0;
};

// Makes a driver over the given tensors, densities[t] for tensor t.
using layerwise_driver_factory = std::function<std::unique_ptr<device_layerwise_driver>(
    std::span<const tensor_spec>, std::span<const double>)>;

}  // namespace gradcomp::cuda
