// gradcomp/cuda/device_driver.cuh: device_sparsified_sgd<C, X, Comm>,
// device_periodic_averaging<Q, X, Comm> and device_layerwise_sgd<C, X, Comm> behind the
// virtual interfaces of cuda/device_driver.hpp, and the factories that make them. Compile with
// nvcc; hand the factory to host-compiled code (torch/device_module.hpp's device_module_sgd,
// device_module_averaging and device_module_lags).
//
//     // drivers.cu (nvcc):
//     gradcomp::cuda::device_driver_factory make_driver(gradcomp::nccl_comm& comm) {
//       return gradcomp::cuda::device_sgd_factory<compressor<topk, identity, residual>,
//                                                 sparse_allgather>(comm, {}, {}, options, schedule);
//     }
#pragma once

#include <memory>
#include <span>
#include <utility>

#include <gradcomp/cuda/device_driver.hpp>
#include <gradcomp/cuda/layerwise.cuh>
#include <gradcomp/cuda/periodic_averaging.cuh>
#include <gradcomp/cuda/sparsified_sgd.cuh>

namespace gradcomp::cuda {

// device_sparsified_sgd<C, X, Comm> as a device_step_driver over *comm, which it keeps alive as
// long as the driver where `comm` owns it (device_sgd_factory over a shared_ptr; over a Comm&
// it is a pointer that owns nothing). With Graph, step() is the driver's graph_step (unquantized
// top-k over sparse_allgather: every check on the device, one wait, and over nccl_comm the step
// captured in CUDA graphs; device_graph_sgd_factory).
template <class C, class X, class Comm, bool Graph = false>
class device_sgd_driver final : public device_step_driver {
 public:
  using driver_type = device_sparsified_sgd<C, X, Comm>;

  device_sgd_driver(std::shared_ptr<Comm> comm, std::span<const tensor_spec> tensors, C c, X x,
                    sgd_options opt, density_schedule schedule)
      : comm_(std::move(comm)), driver_(*comm_, tensors, std::move(c), std::move(x), opt, schedule) {}

  const step_stats& step(device_span<float> params, device_span<const float> grads) override {
    if constexpr (Graph) {
      return driver_.graph_step(params, grads);
    } else {
      return driver_.step(params, grads);
    }
  }
  [[nodiscard]] std::size_t size() const override { return driver_.size(); }
  [[nodiscard]] cudaStream_t stream() const override { return driver_.stream(); }
  [[nodiscard]] const step_stats& last_stats() const override { return driver_.last_stats(); }
  [[nodiscard]] std::uint64_t steps_done() const override { return driver_.steps_done(); }
  void save_state(std::ostream& os) const override { driver_.save_state(os); }
  void load_state(std::istream& is) override { driver_.load_state(is); }

  [[nodiscard]] driver_type& driver() noexcept { return driver_; }

 private:
  std::shared_ptr<Comm> comm_;  // declared first: destroyed after the driver
  driver_type driver_;
};

// A factory of device_sparsified_sgd<C, X, Comm> drivers over a communicator every driver it
// makes shares and keeps alive (for example a cuda::staged_comm made for them).
template <class C, class X, class Comm, bool Graph = false>
device_driver_factory device_sgd_factory(std::shared_ptr<Comm> comm, C c = {}, X x = {},
                                         sgd_options opt = {},
                                         density_schedule schedule = density_schedule::constant(1.0)) {
  return [comm, c, x, opt, schedule](std::span<const tensor_spec> tensors) {
    return std::unique_ptr<device_step_driver>(
        std::make_unique<device_sgd_driver<C, X, Comm, Graph>>(comm, tensors, c, x, opt, schedule));
  };
}

// A factory of drivers that step by graph_step: compressor<topk, identity, residual> over
// sparse_allgather with every check on the device and one wait a step, and over nccl_comm the
// step captured in CUDA graphs and replayed (device_module_sgd's flat buffers stay where they
// are, so its graphs are replayed; docs/gpu.md). The same result as device_sgd_factory's.
template <class Comm>
device_driver_factory device_graph_sgd_factory(
    std::shared_ptr<Comm> comm, topk sel = {}, sgd_options opt = {},
    density_schedule schedule = density_schedule::constant(1.0)) {
  using C = compressor<topk, identity, gradcomp::residual>;
  return device_sgd_factory<C, sparse_allgather, Comm, true>(std::move(comm), C(sel),
                                                             sparse_allgather{}, opt, schedule);
}

// The same over comm, which the caller keeps alive as long as the drivers it makes.
template <class Comm>
device_driver_factory device_graph_sgd_factory(
    Comm& comm, topk sel = {}, sgd_options opt = {},
    density_schedule schedule = density_schedule::constant(1.0)) {
  return device_graph_sgd_factory<Comm>(std::shared_ptr<Comm>(std::shared_ptr<Comm>(), &comm),
                                        std::move(sel), opt, schedule);
}

// The same over comm, which the caller keeps alive as long as the drivers it makes: a
// shared_ptr that owns nothing (the aliasing constructor over an empty one).
template <class C, class X, class Comm>
device_driver_factory device_sgd_factory(Comm& comm, C c = {}, X x = {}, sgd_options opt = {},
                                         density_schedule schedule = density_schedule::constant(1.0)) {
  return device_sgd_factory<C, X, Comm>(std::shared_ptr<Comm>(std::shared_ptr<Comm>(), &comm),
                                        std::move(c), std::move(x), opt, schedule);
}

// device_periodic_averaging<Q, X, Comm> as a device_averaging_driver, keeping *comm alive as
// device_sgd_driver does.
template <class Q, class X, class Comm>
class device_averaging_driver_of final : public device_averaging_driver {
 public:
  using driver_type = device_periodic_averaging<Q, X, Comm>;

  device_averaging_driver_of(std::shared_ptr<Comm> comm, std::span<const tensor_spec> tensors,
                             Q q, X x, sgd_options opt, averaging_options avg)
      : comm_(std::move(comm)), driver_(*comm_, tensors, std::move(q), std::move(x), opt, avg) {}

  const step_stats& step(device_span<float> params, device_span<const float> grads) override {
    return driver_.step(params, grads);
  }
  const step_stats& average(device_span<float> params) override { return driver_.average(params); }
  [[nodiscard]] bool just_averaged() const override { return driver_.just_averaged(); }
  [[nodiscard]] std::size_t size() const override { return driver_.size(); }
  [[nodiscard]] cudaStream_t stream() const override { return driver_.stream(); }
  [[nodiscard]] const step_stats& last_stats() const override { return driver_.last_stats(); }
  [[nodiscard]] std::uint64_t steps_done() const override { return driver_.steps_done(); }
  [[nodiscard]] std::uint64_t rounds_done() const override { return driver_.rounds_done(); }
  void save_state(std::ostream& os) const override { driver_.save_state(os); }
  void load_state(std::istream& is) override { driver_.load_state(is); }

  [[nodiscard]] driver_type& driver() noexcept { return driver_; }

 private:
  std::shared_ptr<Comm> comm_;  // declared first: destroyed after the driver
  driver_type driver_;
};

// A factory of device_periodic_averaging<Q, X, Comm> drivers over a communicator they share
// and keep alive.
template <class Q, class X, class Comm>
averaging_driver_factory device_averaging_factory(std::shared_ptr<Comm> comm, Q q = {}, X x = {},
                                                  sgd_options opt = {},
                                                  averaging_options avg = {}) {
  return [comm, q, x, opt, avg](std::span<const tensor_spec> tensors) {
    return std::unique_ptr<device_averaging_driver>(
        std::make_unique<device_averaging_driver_of<Q, X, Comm>>(comm, tensors, q, x, opt, avg));
  };
}

// The same over comm, which the caller keeps alive as long as the drivers it makes.
template <class Q, class X, class Comm>
averaging_driver_factory device_averaging_factory(Comm& comm, Q q = {}, X x = {},
                                                  sgd_options opt = {},
                                                  averaging_options avg = {}) {
  return device_averaging_factory<Q, X, Comm>(std::shared_ptr<Comm>(std::shared_ptr<Comm>(), &comm),
                                              std::move(q), std::move(x), opt, avg);
}

// device_layerwise_sgd<C, X, Comm> as a device_layerwise_driver, keeping *comm alive as
// device_sgd_driver does.
template <class C, class X, class Comm>
class device_layerwise_driver_of final : public device_layerwise_driver {
 public:
  using driver_type = device_layerwise_sgd<C, X, Comm>;

  device_layerwise_driver_of(std::shared_ptr<Comm> comm, std::span<const tensor_spec> tensors,
                             std::span<const double> densities, C c, X x, sgd_options opt)
      : comm_(std::move(comm)),
        driver_(*comm_, tensors, densities, std::move(c), std::move(x), opt) {}

  void begin_step(device_span<float> params, device_span<const float> grads,
                  cudaStream_t compute) override {
    driver_.begin_step(params, grads, compute);
  }
  void ready(std::size_t t) override { driver_.ready(t); }
  bool wait_exchanges() override { return driver_.wait_exchanges(); }
  float agree_max(float mine) override { return driver_.agree_max(mine); }
  void abandon_step() override { driver_.abandon_step(); }
  const layerwise_stats& finish_step() override { return driver_.finish_step(); }
  [[nodiscard]] int rank() const override { return comm_->rank(); }
  [[nodiscard]] std::size_t size() const override { return driver_.size(); }
  [[nodiscard]] cudaStream_t stream() const override { return driver_.stream(); }
  [[nodiscard]] const layerwise_stats& last_stats() const override { return driver_.last_stats(); }
  [[nodiscard]] std::uint64_t steps_done() const override { return driver_.steps_done(); }

  [[nodiscard]] driver_type& driver() noexcept { return driver_; }

 private:
  std::shared_ptr<Comm> comm_;  // declared first: destroyed after the driver
  driver_type driver_;
};

// A factory of device_layerwise_sgd<C, X, Comm> drivers over a communicator they share and
// keep alive.
template <class C, class X, class Comm>
layerwise_driver_factory device_layerwise_factory(std::shared_ptr<Comm> comm, C c = {}, X x = {},
                                                  sgd_options opt = {}) {
  return [comm, c, x, opt](std::span<const tensor_spec> tensors,
                           std::span<const double> densities) {
    return std::unique_ptr<device_layerwise_driver>(
        std::make_unique<device_layerwise_driver_of<C, X, Comm>>(comm, tensors, densities, c, x,
                                                                 opt));
  };
}

// The same over comm, which the caller keeps alive as long as the drivers it makes.
template <class C, class X, class Comm>
layerwise_driver_factory device_layerwise_factory(Comm& comm, C c = {}, X x = {},
                                                  sgd_options opt = {}) {
  return device_layerwise_factory<C, X, Comm>(std::shared_ptr<Comm>(std::shared_ptr<Comm>(), &comm),
                                              std::move(c), std::move(x), opt);
}

}  // namespace gradcomp::cuda
