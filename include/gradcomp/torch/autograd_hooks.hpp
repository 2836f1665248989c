// gradcomp/torch/autograd_hooks.hpp: post-hooks on the parameters' gradient accumulators,
// which tell when each tensor's gradients are complete during the real backward pass
// (module_lags hands tensors over with them), and measure_backward(), which times the backward
// pass per tensor with the same hooks.
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

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <gradcomp/error.hpp>
#include <gradcomp/torch/module_layout.hpp>

namespace gradcomp::torch_module {

namespace detail_module {

// For each parameter, the index of the tensor (in `groups`) that holds it.
inline std::vector<std::size_t> group_of_parameters(const std::vector<tensor_group>& groups, std::size_t params) {
  std::vector<std::size_t> out(params);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (std::size_t i = groups[g].first; i < groups[g].first + groups[g].count; ++i) out[i] = g;
  }
  return out;
}

// A post-hook on a gradient accumulator: tells `on_done` (while it is set) that parameter
// `param`'s gradient is complete. The target outlives the hook's owner through a shared_ptr,
// so that a hook autograd still runs after the owner is gone does nothing.
struct hook_target {
  std::mutex mu;
  std::function<void(std::size_t)> on_done;
};

struct accumulator_hook final : torch::autograd::FunctionPostHook {
  accumulator_hook(std::shared_ptr<hook_target> target, std::size_t param)
      : target_(std::move(target)), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    const std::lock_guard lock(target_->mu);
    if (target_->on_done) target_->on_done(param_);
    return outputs;
  }
  std::shared_ptr<hook_target> target_;
  std::size_t param_;
};

// Hooks on every parameter's gradient accumulator, removed again when this goes (which must
// not happen while a backward pass runs: autograd reads the hook list without a lock). It
// keeps the accumulators alive (a parameter holds its own only weakly, and a new one has no
// hooks).
class accumulator_hooks {
 public:
  accumulator_hooks(const std::vector<parameter>& ps, std::function<void(std::size_t)> on_done, const char* who)
      : target_(std::make_shared<hook_target>()) {
    // Every accumulator first, so that a refusal leaves no hook behind.
    for (std::size_t i = 0; i < ps.size(); ++i) {
      std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(ps[i].tensor);
      if (!acc) {
        throw invalid_argument(detail::concat("gradcomp::torch_module::", who, ": parameter '", ps[i].name,
                                              "' has no gradient accumulator (requires_grad is false?)"));
      }
      accumulators_.push_back(std::move(acc));
    }
    target_->on_done = std::move(on_done);
    for (std::size_t i = 0; i < ps.size(); ++i) {
      keys_.push_back(accumulators_[i]->add_post_hook(std::make_unique<accumulator_hook>(target_, i)));
    }
  }
  accumulator_hooks(const accumulator_hooks&) = delete;
  accumulator_hooks& operator=(const accumulator_hooks&) = delete;
  ~accumulator_hooks() {
    {
      const std::lock_guard lock(target_->mu);
      target_->on_done = nullptr;
    }
    for (std::size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(keys_[i]);
  }

 private:
  std::shared_ptr<hook_target> target_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> keys_;
};

}  // namespace detail_module

// The backward pass's time per tensor on this rank, for lags_densities() and
// plan_merged_groups(). For each of `batches` batches, forward_loss() runs the forward pass
// and returns the loss, and backward() runs on it while hooks on the gradient accumulators note
// when each tensor's gradients are complete. A tensor's time runs from the completion of the
// tensor completed just before it (the first: from the call of backward()) to its own; the
// result is the median over the batches, in registration order (registration_order()). The
// gradients accumulate in .grad(): zero them afterwards. Every rank must plan with the same
// times: reduce the result with the maximum over ranks.
template <class T = float>
std::vector<double> measure_backward(torch::nn::Module& m, const std::function<at::Tensor()>& forward_loss,
                                     unsigned batches = 10, const std::optional<merge_plan>& plan = {}) {
  if (batches < 1) detail::throw_invalid_argument("torch_module::measure_backward", "batches", batches, ">= 1");
  std::vector<parameter> ps = parameters_of<T>(m);
  const std::vector<tensor_group> groups = tensor_groups(ps, plan);
  const std::vector<std::size_t> group_of = detail_module::group_of_parameters(groups, ps.size());
  using clock = std::chrono::steady_clock;
  std::vector<std::size_t> missing(groups.size());
  std::vector<clock::time_point> done(groups.size());
  detail_module::accumulator_hooks hooks(
      ps,
      [&](std::size_t param) {
        const std::size_t g = group_of[param];
        if (missing[g] > 0 && --missing[g] == 0) done[g] = clock::now();
      },
      "measure_backward");
  std::vector<std::vector<double>> samples(groups.size());
  for (unsigned b = 0; b < batches; ++b) {
    const at::Tensor loss = forward_loss();
    for (std::size_t g = 0; g < groups.size(); ++g) missing[g] = groups[g].count;
    const clock::time_point start = clock::now();
    loss.backward();
    std::vector<std::size_t> by_completion(groups.size());
    for (std::size_t g = 0; g < groups.size(); ++g) {
      if (missing[g] != 0) {
        throw invalid_argument(detail::concat("gradcomp::torch_module::measure_backward: the gradient of '",
                                              groups[g].name, "' was not produced by the backward pass"));
      }
      by_completion[g] = g;
    }
    std::sort(by_completion.begin(), by_completion.end(),
              [&](std::size_t x, std::size_t y) { return done[x] < done[y]; });
    clock::time_point previous = start;
    for (const std::size_t g : by_completion) {
      samples[g].push_back(std::chrono::duration<double>(done[g] - previous).count());
      previous = done[g];
    }
  }
  std::vector<double> out;
  for (const std::size_t g : registration_order(groups)) {
    std::vector<double>& s = samples[g];
    std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(s.size() / 2), s.end());
    out.push_back(s[s.size() / 2]);
  }
  return out;
}

}  // namespace gradcomp::torch_module
