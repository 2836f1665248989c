// gradcomp/torch/module.hpp: gradcomp's drivers over a torch::nn::Module, for C++ training
// loops written with LibTorch.
//
//     gradcomp::torch_module::module_sgd<compressor<topk, identity, residual>, sparse_allgather,
//                                        in_process_comm> opt(model, comm, {}, {}, options);
//     loss.backward();
//     opt.step();        // reads every parameter's .grad(), exchanges, updates in place
//     opt.zero_grad();
//
// The module's named parameters become gradcomp tensors with ids taken from their names
// (FNV-1a), so that checkpoints are keyed by name and survive a change of registration order.
// Tensors are one per parameter, or merged groups of consecutive parameters (a merge_plan,
// schedule/merged.hpp), ordered by name. With the flat layout (the default) every parameter's
// data and gradient become views into two contiguous buffers, so a step reads the gradients
// and writes the parameters where they are, with no copy; the per-parameter layout leaves the
// module's tensors alone and copies through scratch buffers.
//
// module_sgd drives sparsified_sgd, module_averaging periodic_averaging (PQASGD), and
// module_lags layerwise_sgd (LAGS-SGD) from autograd: a post-hook on every parameter's
// gradient accumulator tells it when a gradient is complete, so communication overlaps the
// real backward pass. Every rank must hand the tensors over in the same order: the hooks
// release them in one fixed order (the reverse of registration, the order a sequential
// model's backward pass produces them), holding back a tensor whose predecessors are not
// ready. measure_backward() times the backward pass per tensor with the same hooks, for
// lags_densities() and plan_merged_groups().
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include <gradcomp/detail/checkpoint.hpp>
#include <gradcomp/error.hpp>
#include <gradcomp/schedule/layerwise.hpp>
#include <gradcomp/schedule/merged.hpp>
#include <gradcomp/schedule/periodic_averaging.hpp>
#include <gradcomp/sparsified_sgd.hpp>
#include <gradcomp/torch/autograd_hooks.hpp>
#include <gradcomp/torch/module_layout.hpp>
#include <gradcomp/torch/tensor.hpp>

namespace gradcomp::torch_module {

struct module_options {
  sgd_options sgd{};
  density_schedule schedule = density_schedule::constant(1.0);
  module_layout layout = module_layout::flat;
  std::optional<merge_plan> groups{};  // merged groups of consecutive parameters
};

// What the module optimizers share: the parameters, the tensors, the flat buffers, and moving
// values between the module and the buffers.
template <class T>
class module_base {
 public:
  module_base(torch::nn::Module& m, module_layout layout, const std::optional<merge_plan>& groups,
              parameter_device where = parameter_device::cpu)
      : params_(parameters_of<T>(m, where)), groups_(tensor_groups(params_, groups)), layout_(layout),
        flat_(params_, layout_) {}

  // Zeroes every gradient in place (the flat layout's views stay).
  void zero_grad() {
    at::NoGradGuard no_grad;
    flat_.grads.zero_();
    for (parameter& p : params_) {
      if (layout_ == module_layout::flat) {
        p.tensor.mutable_grad() = flat_.grad_view(p);
      } else if (p.tensor.grad().defined()) {
        p.tensor.mutable_grad().zero_();
      }
    }
  }

  [[nodiscard]] const std::vector<parameter>& parameters() const noexcept { return params_; }
  // The tensors, ordered by name (the drivers' order).
  [[nodiscard]] const std::vector<tensor_group>& tensors() const noexcept { return groups_; }
  // The flat buffers (with the flat layout, the parameters' and gradients' storage). Writing
  // to flat_parameters() between steps sets the parameters (e.g. a broadcast from rank 0).
  [[nodiscard]] const at::Tensor& flat_parameters() const noexcept { return flat_.params; }
  [[nodiscard]] const at::Tensor& flat_gradients() const noexcept { return flat_.grads; }
  // Copies the flat parameters back into the module's tensors (per-parameter layout; with
  // the flat layout they are the same memory). Call after writing to flat_parameters().
  void sync_module() { detail_module::scatter(params_, flat_, layout_); }
  // Reads the module's parameters and gradients into the flat buffers (what a step does first).
  void sync_buffers() { detail_module::gather(params_, flat_, layout_); }

 protected:
  // Checkpoints keyed by tensor name: the name table, then the driver's own state.
  template <class Driver>
  void save_with(std::ostream& os, const Driver& d) const {
    detail_module::save_names(os, groups_);
    d.save_state(os);
  }
  template <class Driver>
  void load_with(std::istream& is, Driver& d) {
    detail_module::check_names(is, groups_);
    d.load_state(is);
  }

  std::span<T> param_span(const char* who) { return torch_views::as_span<T>(flat_.params, who, "parameters"); }
  std::span<T> grad_span(const char* who) { return torch_views::as_span<T>(flat_.grads, who, "gradients"); }

  std::vector<parameter> params_;
  std::vector<tensor_group> groups_;
  module_layout layout_;
  flat_buffers<T> flat_;
};

// sparsified_sgd over a module's parameters.
template <class Compressor, class Exchange, class Comm>
class module_sgd : public module_base<typename Compressor::value_type> {
  using base = module_base<typename Compressor::value_type>;

 public:
  using T = typename Compressor::value_type;
  using driver_type = sparsified_sgd<Compressor, Exchange, Comm>;

  module_sgd(torch::nn::Module& m, Comm& comm, Compressor c = {}, Exchange x = {},
             module_options options = {})
      : base(m, options.layout, options.groups),
        driver_(comm, detail_module::specs(this->groups_), std::move(c), std::move(x), options.sgd,
                options.schedule) {}

  // One step on every rank: each parameter's .grad() (zero where undefined) is compressed,
  // exchanged and averaged, and the parameters are updated in place.
  const step_stats& step() {
    this->sync_buffers();
    const step_stats& s = driver_.step(this->param_span("module_sgd::step"), this->grad_span("module_sgd::step"));
    this->sync_module();
    return s;
  }

  // Checkpoints keyed by tensor name: a module whose parameters were registered in another
  // order loads it; one with other parameters is refused, naming the first mismatch.
  void save(std::ostream& os) const { this->save_with(os, driver_); }
  void load(std::istream& is) { this->load_with(is, driver_); }

  [[nodiscard]] driver_type& driver() noexcept { return driver_; }
  [[nodiscard]] const driver_type& driver() const noexcept { return driver_; }

 private:
  driver_type driver_;
};

// periodic_averaging (PQASGD) over a module's parameters: local SGD steps, and every
// `period` steps the ranks average the quantized change of the model. The parameters must be
// equal on every rank before the first step (broadcast flat_parameters(), then sync_module()).
template <class Quantizer, class Exchange, class Comm, class T = float>
class module_averaging : public module_base<T> {
  using base = module_base<T>;

 public:
  using driver_type = periodic_averaging<Quantizer, Exchange, Comm, T>;

  module_averaging(torch::nn::Module& m, Comm& comm, Quantizer q = {}, Exchange x = {}, sgd_options sgd = {},
                   averaging_options avg = {}, module_layout layout = module_layout::flat,
                   const std::optional<merge_plan>& groups = {})
      : base(m, layout, groups),
        driver_(comm, detail_module::specs(this->groups_), std::move(q), std::move(x), sgd, avg) {}

  // A local step; an averaging round after every `period` of them.
  const step_stats& step() {
    this->sync_buffers();
    const step_stats& s = driver_.step(this->param_span("module_averaging::step"),
                                       this->grad_span("module_averaging::step"));
    this->sync_module();
    return s;
  }

  // An averaging round now unless the last step ended with one (e.g. before evaluating).
  void average() {
    if (driver_.just_averaged()) return;
    this->sync_buffers();
    driver_.average(this->param_span("module_averaging::average"));
    this->sync_module();
  }

  // Checkpoints keyed by tensor name, as module_sgd's (periodic_averaging's format: a
  // checkpoint moves between module_averaging and device_module_averaging).
  void save(std::ostream& os) const { this->save_with(os, driver_); }
  void load(std::istream& is) { this->load_with(is, driver_); }

  [[nodiscard]] driver_type& driver() noexcept { return driver_; }
  [[nodiscard]] const driver_type& driver() const noexcept { return driver_; }

 private:
  driver_type driver_;
};

namespace detail_module {

// module_lags's bookkeeping, shared with device_module_lags (torch/device_module.hpp): the
// densities by registration order, the release of tensors in one fixed order as the hooks
// report gradients, and finish_step's agreement on a missing gradient. `Driver` is
// layerwise_sgd or a device layerwise driver (ready, wait_exchanges, abandon_step, finish_step).
class lags_release {
 public:
  lags_release(const std::vector<tensor_group>& groups, std::size_t params)
      : groups_(&groups), group_of_(group_of_parameters(groups, params)), missing_(groups.size()),
        order_(registration_order(groups)) {
    std::reverse(order_.begin(), order_.end());  // the release order: reverse registration
  }

  // densities[i] for the i-th tensor in registration order, by tensor index.
  std::vector<double> by_name(std::span<const double> densities, const char* who) const {
    if (densities.size() != groups_->size()) {
      detail::throw_invalid_argument(who, "densities.size()", densities.size(),
                                     detail::concat(groups_->size(), " (one per tensor)"));
    }
    const std::vector<std::size_t> reg = registration_order(*groups_);
    std::vector<double> out(densities.size());
    for (std::size_t i = 0; i < reg.size(); ++i) out[reg[i]] = densities[i];
    return out;
  }

  // Before backward(): every tensor's gradients are awaited, begin() (the driver's
  // begin_step) runs, and the hooks release from now on.
  template <class Begin>
  void arm(Begin&& begin) {
    const std::lock_guard lock(mu_);
    for (std::size_t g = 0; g < groups_->size(); ++g) missing_[g] = (*groups_)[g].count;
    cursor_ = 0;
    armed_ = true;
    begin();
  }

  // A hook's report: releases, in the fixed order, every tensor whose gradients are complete.
  template <class Driver>
  void gradient_done(Driver& driver, std::size_t param) {
    const std::lock_guard lock(mu_);
    if (!armed_) return;  // a backward pass outside begin_step()/finish_step()
    const std::size_t g = group_of_[param];
    if (missing_[g] > 0) --missing_[g];
    while (cursor_ < order_.size() && missing_[order_[cursor_]] == 0) {
      driver.ready(order_[cursor_++]);
    }
  }

  // After backward(): every tensor must have been handed over. Before anything is applied, the
  // ranks agree (agree(mine): the largest of every rank's number) on whether every rank's
  // backward pass produced every gradient: if one did not, that rank still hands the missing
  // tensors over (zeros) so that the exchanges match, and then no rank applies any of the
  // step; the rank that missed one throws invalid_argument naming the parameter, the others
  // communicator_error naming the rank. A retry then applies the step once.
  template <class Driver, class Agree>
  decltype(auto) finish(Driver& driver, int rank, Agree&& agree, const char* who) {
    {
      const std::lock_guard lock(mu_);
      armed_ = false;
    }
    const bool missing = cursor_ != order_.size();
    const std::size_t first_missing = missing ? order_[cursor_] : 0;
    try {
      while (cursor_ < order_.size()) driver.ready(order_[cursor_++]);
    } catch (...) {
      driver.abandon_step();
      throw;
    }
    // The exchanges' own failures throw on every rank alike (finish_step() rethrows them); a
    // missing gradient is known to its rank only, so every rank says whether it missed one.
    // The communicator is free again once the exchanges are done.
    const bool exchanged = driver.wait_exchanges();
    double missed = missing ? static_cast<double>(rank + 1) : 0.0;
    if (exchanged) {
      try {
        missed = agree(missed);
      } catch (...) {
        driver.abandon_step();
        throw;
      }
    }
    if (missing) {
      driver.abandon_step();
      throw invalid_argument(detail::concat(
          "gradcomp::torch_module::", who, "::finish_step: the gradient of '",
          (*groups_)[first_missing].name,
          "' was not produced by the backward pass; every parameter must take part in the loss "
          "(no rank applied this step)"));
    }
    if (missed > 0.0) {
      driver.abandon_step();
      throw communicator_error(detail::concat(
          "gradcomp::torch_module::", who, "::finish_step: rank ", static_cast<int>(missed) - 1,
          "'s backward pass did not produce every gradient (its own error names the parameter); "
          "no rank applied this step"));
    }
    return driver.finish_step();
  }

 private:
  const std::vector<tensor_group>* groups_;
  std::vector<std::size_t> group_of_;
  std::vector<std::size_t> missing_;
  std::vector<std::size_t> order_;
  std::size_t cursor_ = 0;
  bool armed_ = false;
  std::mutex mu_;
};

}  // namespace detail_module

// layerwise_sgd (LAGS) over a module's parameters, driven by autograd. A step:
//
//     lags.begin_step();       // before backward()
//     loss.backward();         // hooks hand each tensor over as its gradient completes
//     lags.finish_step();      // waits for the exchanges in flight; parameters are updated
//
// Always the flat layout: the communication thread reads each tensor's gradient from the flat
// buffer while the backward pass goes on with earlier layers; finish_step() applies every
// update once all exchanges have succeeded, so the backward pass never sees a half-updated
// model and a failed step changes no parameter.
template <class Compressor, class Exchange, class Comm>
class module_lags : public module_base<typename Compressor::value_type> {
  using base = module_base<typename Compressor::value_type>;

 public:
  using T = typename Compressor::value_type;
  using driver_type = layerwise_sgd<Compressor, Exchange, Comm>;

  // densities[i] for the i-th tensor in registration order (parameters, or the plan's groups;
  // registration_order()): the order of lags_densities()'s layers.
  module_lags(torch::nn::Module& m, Comm& comm, std::span<const double> densities,
              Compressor c = {}, Exchange x = {}, sgd_options sgd = {},
              std::optional<merge_plan> groups = {})
      : base(m, module_layout::flat, groups),
        comm_(&comm),
        release_(this->groups_, this->params_.size()),
        driver_(comm, detail_module::specs(this->groups_),
                release_.by_name(densities, "torch_module::module_lags"), std::move(c),
                std::move(x), sgd),
        hooks_(
            this->params_, [this](std::size_t param) { release_.gradient_done(driver_, param); },
            "module_lags") {}

  module_lags(const module_lags&) = delete;
  module_lags& operator=(const module_lags&) = delete;

  // Before backward(): gradients are zeroed (in place) and the hooks armed.
  void begin_step() {
    this->sync_buffers();
    {
      at::NoGradGuard no_grad;
      this->flat_.grads.zero_();
    }
    release_.arm([this] {
      driver_.begin_step(this->param_span("module_lags"), this->grad_span("module_lags"));
    });
  }

  // After backward(): detail_module::lags_release::finish's agreement (one allreduce of one
  // number), then the step is applied on every rank or on none.
  const layerwise_stats& finish_step() {
    return release_.finish(
        driver_, comm_->rank(),
        [this](double mine) {
          double missed[1] = {mine};
          comm_->allreduce(std::span<double>(missed), reduce_op::max);
          return missed[0];
        },
        "module_lags");
  }

  [[nodiscard]] driver_type& driver() noexcept { return driver_; }
  [[nodiscard]] const driver_type& driver() const noexcept { return driver_; }

 private:
  Comm* comm_;
  detail_module::lags_release release_;
  driver_type driver_;
  // Last: removed (and silenced) before the members they call into go.
  detail_module::accumulator_hooks hooks_;
};

}  // namespace gradcomp::torch_module
