// The drivers the fault-injection tests run (tests/reliability/transaction_test.cpp in-process,
// tests/mpi/mpi_faults.cpp under MPI), over any communicator: sparsified_sgd with every
// exchange and every kind of feedback, layerwise_sgd and periodic_averaging, each behind one
// interface (make, step, checkpoint bytes, step count) on two small tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/schedule.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/sparsified_sgd.hpp>

#include "../reliability/support.hpp"

namespace gradcomp_test::drivers {

using namespace gradcomp;

// A residual feedback that cannot stage its accumulation (no accumulate_into, no
// in_place_accumulator): the compressor copies its state instead. Checks that generic path.
struct copying_residual {
  template <gradient_value T>
  using state = residual::state<T>;
  template <gradient_value T>
  state<T> make_state(std::size_t n) const {
    return residual{}.make_state<T>(n);
  }
  template <gradient_value T>
  std::span<const T> accumulate(state<T>& st, std::span<const T> g) const {
    return residual{}.accumulate(st, g);
  }
  template <gradient_value T>
  void update(state<T>& st, std::span<const std::uint32_t> idx, std::span<const float> d) const {
    residual{}.update(st, idx, d);
  }
};
static_assert(feedback<copying_residual> && !stages_accumulation<copying_residual>);

// Two tensors: a fault in the second's exchange must undo the first's.
inline const std::vector<tensor_spec> tensors = {{3, 300}, {8, 57}};
inline constexpr std::size_t total = 357;

inline std::vector<float> gradient_of(int rank, int step) {
  return gradcomp::reliability::gradient<float>(total, 1000 * static_cast<std::uint64_t>(step) +
                                                  static_cast<std::uint64_t>(rank));
}

// What is compared bit for bit: the parameters and the driver's checkpoint.
struct rank_state {
  std::vector<unsigned char> params;
  std::string checkpoint;
  std::uint64_t steps = 0;
  friend bool operator==(const rank_state&, const rank_state&) = default;
};

// The drivers under test, behind one interface: make P of them, run one step on a rank.
template <class Comm>
struct driver_case {
  std::string name;
  // Makes rank r's driver over its communicator.
  std::function<std::shared_ptr<void>(Comm&)> make;
  std::function<void(void* driver, std::vector<float>& params, int rank, int step)> step;
  std::function<std::string(void* driver)> checkpoint;
  std::function<std::uint64_t(void* driver)> steps;
};

template <class Comm, class C, class X>
driver_case<Comm> sgd_case(std::string name, C c, X x, sgd_options opt) {
  using D = sparsified_sgd<C, X, Comm>;
  driver_case<Comm> d;
  d.name = std::move(name);
  d.make = [=](Comm& comm) {
    return std::shared_ptr<void>(std::make_shared<D>(comm, std::span<const tensor_spec>(tensors), c,
                                                     x, opt, density_schedule::constant(0.05)));
  };
  d.step = [](void* p, std::vector<float>& params, int rank, int step) {
    static_cast<D*>(p)->step(params, gradient_of(rank, step));
  };
  d.checkpoint = [](void* p) {
    std::ostringstream os;
    static_cast<D*>(p)->save_state(os);
    return os.str();
  };
  d.steps = [](void* p) { return static_cast<D*>(p)->steps_done(); };
  return d;
}

template <class Comm, class C, class X>
driver_case<Comm> layerwise_case(std::string name, C c, X x, sgd_options opt) {
  using D = layerwise_sgd<C, X, Comm>;
  driver_case<Comm> d;
  d.name = std::move(name);
  d.make = [=](Comm& comm) {
    const double densities[] = {0.05, 0.2};
    return std::shared_ptr<void>(std::make_shared<D>(comm, std::span<const tensor_spec>(tensors),
                                                     std::span<const double>(densities), c, x, opt));
  };
  d.step = [](void* p, std::vector<float>& params, int rank, int step) {
    auto& sgd = *static_cast<D*>(p);
    const std::vector<float> g = gradient_of(rank, step);
    sgd.begin_step(params, g);
    sgd.ready(1);  // the backward pass: last layer first
    sgd.ready(0);
    sgd.finish_step();
  };
  d.checkpoint = [](void* p) {
    auto& sgd = *static_cast<D*>(p);
    std::ostringstream os;
    for (std::size_t t = 0; t < tensors.size(); ++t) sgd.optimizer(t).save_state(os);
    return os.str();
  };
  d.steps = [](void* p) { return static_cast<D*>(p)->steps_done(); };
  return d;
}

template <class Comm, class Q, class X>
driver_case<Comm> averaging_case(std::string name, Q q, X x, sgd_options opt, averaging_options avg) {
  using D = periodic_averaging<Q, X, Comm>;
  driver_case<Comm> d;
  d.name = std::move(name);
  d.make = [=](Comm& comm) {
    return std::shared_ptr<void>(
        std::make_shared<D>(comm, std::span<const tensor_spec>(tensors), q, x, opt, avg));
  };
  d.step = [](void* p, std::vector<float>& params, int rank, int step) {
    static_cast<D*>(p)->step(params, gradient_of(rank, step));
  };
  d.checkpoint = [](void* p) {
    std::ostringstream os;
    static_cast<D*>(p)->save_state(os);
    return os.str();
  };
  d.steps = [](void* p) { return static_cast<D*>(p)->steps_done(); };
  return d;
}

inline auto_exchange fixed_auto(unsigned candidates) {
  auto_options o;
  o.link = link_model{20e-6, 1e-9, 1e-10};
  o.candidates = candidates;
  return auto_exchange(o);
}

template <class Comm>
std::vector<driver_case<Comm>> all_cases() {
  const sgd_options momentum{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4, .seed = 3};
  const sgd_options plain{.lr = 0.05, .seed = 3};
  using topk_res = compressor<topk, identity, residual>;
  return {
      sgd_case<Comm>("sparsified_sgd, topk + residual, sparse_allgather", topk_res{},
               sparse_allgather{}, momentum),
      sgd_case<Comm>("sparsified_sgd, gaussiank + fp16 + residual, sparse_allgather",
               compressor<gaussiank, fp16, residual>{}, sparse_allgather{}, momentum),
      sgd_case<Comm>("sparsified_sgd, topk + qsgd + residual, gtopk (tree)",
               compressor<topk, qsgd, residual>{}, gtopk{}, momentum),
      sgd_case<Comm>("sparsified_sgd, topk + residual, gtopk (exact)", topk_res{},
               gtopk(gtopk_values::exact), momentum),
      sgd_case<Comm>("sparsified_sgd, topk + residual, topk_a2a (buckets)", topk_res{}, topk_a2a(400),
               momentum),
      sgd_case<Comm>("sparsified_sgd, randomk + bf16 + residual, dense_allreduce",
               compressor<randomk, bf16, residual>{}, dense_allreduce{}, momentum),
      sgd_case<Comm>("sparsified_sgd, topk + dgc_momentum, sparse_allgather",
               compressor<topk, identity, dgc_momentum>{}, sparse_allgather{}, plain),
      sgd_case<Comm>("sparsified_sgd, topk + residual, auto_exchange", topk_res{},
               fixed_auto(all_exchanges), momentum),
      sgd_case<Comm>("sparsified_sgd, topk + a feedback that cannot stage, sparse_allgather",
               compressor<topk, identity, copying_residual>{}, sparse_allgather{}, momentum),
      layerwise_case<Comm>("layerwise_sgd, topk + residual, sparse_allgather", topk_res{},
                     sparse_allgather{}, momentum),
      layerwise_case<Comm>("layerwise_sgd, topk + residual, gtopk", topk_res{}, gtopk{}, momentum),
      averaging_case<Comm>("periodic_averaging, qsgd, sparse_allgather", qsgd::with_bits(4),
                     sparse_allgather{}, momentum, averaging_options{.period = 1, .subsets = 2}),
      averaging_case<Comm>("periodic_averaging, fp16, dense_allreduce", fp16{}, dense_allreduce{},
                     momentum, averaging_options{.period = 1}),
  };
}

}  // namespace gradcomp_test::drivers
