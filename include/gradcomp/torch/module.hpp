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

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <gradcomp/error.hpp>
#include <gradcomp/detail/checkpoint.hpp>
#include <gradcomp/schedule/layerwise.hpp>
#include <gradcomp/schedule/merged.hpp>
#include <gradcomp/schedule/periodic_averaging.hpp>
#include <gradcomp/sparsified_sgd.hpp>
#include <gradcomp/torch/tensor.hpp>

namespace gradcomp::torch_module {

// A parameter's stable tensor id: FNV-1a (32-bit) of its name.
constexpr std::uint32_t tensor_id_of(std::string_view name) noexcept {
  std::uint32_t h = 2166136261u;
  for (const char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 16777619u;
  }
  return h;
}

struct parameter {
  std::string name;
  at::Tensor tensor;
  std::size_t offset = 0;  // in the flat order (registration order)
  std::size_t size = 0;
};

// One gradcomp tensor: a parameter, or a group of consecutive ones.
struct tensor_group {
  std::string name;  // the parameter's name, or the names joined by '+'
  std::size_t first = 0;
  std::size_t count = 1;
  tensor_spec spec{};
  std::size_t offset = 0;
};

enum class module_layout {
  flat,           // parameters and gradients become views into two contiguous buffers
  per_parameter,  // the module's tensors stay as they are; steps copy through scratch buffers
};

// The module's parameters (recursively, in registration order), checked: of dtype T, dense,
// on the CPU, at least one.
template <class T>
std::vector<parameter> parameters_of(torch::nn::Module& m) {
  std::vector<parameter> out;
  std::size_t offset = 0;
  for (const auto& item : m.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (auto why = torch_views::why_not_viewable<T>(t.contiguous()); !why.empty() || !t.is_contiguous()) {
      throw invalid_argument(detail::concat(
          "gradcomp::torch_module: parameter '", item.key(), "' is ", torch_views::describe(t),
          "; allowed: contiguous ", c10::toString(torch_views::scalar_type_of<T>()),
          " CPU tensors with the strided layout", why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
    }
    out.push_back(parameter{item.key(), t, offset, static_cast<std::size_t>(t.numel())});
    offset += static_cast<std::size_t>(t.numel());
  }
  if (out.empty()) {
    throw invalid_argument("gradcomp::torch_module: the module has no parameters");
  }
  return out;
}

// Tensors for the drivers: one per parameter, or the groups of a merge plan (layers = the
// parameters in registration order). Ids come from the names; a collision is refused. The
// tensors are ordered by name, and the parameters' offsets in the flat buffers follow that
// order (a group's parameters stay together, in registration order): the drivers' state and
// checkpoints then do not depend on the order in which the module registered its parameters.
inline std::vector<tensor_group> tensor_groups(std::vector<parameter>& ps,
                                               const std::optional<merge_plan>& plan) {
  std::vector<tensor_group> out;
  auto add = [&](std::size_t first, std::size_t count) {
    tensor_group g;
    g.first = first;
    g.count = count;
    for (std::size_t i = first; i < first + count; ++i) {
      g.name += (i == first ? "" : "+") + ps[i].name;
      g.spec.size += ps[i].size;
    }
    g.spec.id = tensor_id_of(g.name);
    for (const tensor_group& h : out) {
      if (h.spec.id == g.spec.id) {
        throw invalid_argument(detail::concat("gradcomp::torch_module: the names '", h.name, "' and '",
                                              g.name, "' hash to the same tensor id ", g.spec.id,
                                              "; rename one"));
      }
    }
    out.push_back(g);
  };
  if (!plan) {
    for (std::size_t i = 0; i < ps.size(); ++i) add(i, 1);
  } else {
    std::size_t next = 0;
    for (const layer_group& g : plan->groups) {
      if (g.first != next || g.count == 0 || g.first + g.count > ps.size()) {
        detail::throw_invalid_argument("torch_module", "merge plan", detail::concat("group at ", g.first, " of ", g.count),
                                       detail::concat("consecutive groups covering the ", ps.size(), " parameters"));
      }
      add(g.first, g.count);
      next = g.first + g.count;
    }
    if (next != ps.size()) {
      detail::throw_invalid_argument("torch_module", "merge plan", detail::concat("covers ", next, " parameters"),
                                     detail::concat("all ", ps.size()));
    }
  }
  std::sort(out.begin(), out.end(), [](const tensor_group& a, const tensor_group& b) { return a.name < b.name; });
  std::size_t offset = 0;
  for (tensor_group& g : out) {
    g.offset = offset;
    for (std::size_t i = g.first; i < g.first + g.count; ++i) {
      ps[i].offset = offset;
      offset += ps[i].size;
    }
  }
  return out;
}

// Flat buffers for parameters and gradients. With module_layout::flat every parameter's data
// and .grad() are made views into them (values kept); otherwise they are scratch.
template <class T>
struct flat_buffers {
  at::Tensor params;
  at::Tensor grads;

  flat_buffers(std::vector<parameter>& ps, module_layout layout) {
    std::size_t total = 0;
    for (const parameter& p : ps) total = std::max(total, p.offset + p.size);
    const auto options = at::TensorOptions().dtype(torch_views::scalar_type_of<T>());
    params = at::empty({static_cast<std::int64_t>(total)}, options);
    grads = at::zeros({static_cast<std::int64_t>(total)}, options);
    for (parameter& p : ps) {
      params.narrow(0, static_cast<std::int64_t>(p.offset), static_cast<std::int64_t>(p.size))
          .copy_(p.tensor.detach().reshape({-1}));
      if (layout != module_layout::flat) continue;
      at::NoGradGuard no_grad;
      at::Tensor data = params.narrow(0, static_cast<std::int64_t>(p.offset), static_cast<std::int64_t>(p.size))
                            .view(p.tensor.sizes());
      if (p.tensor.grad().defined()) {
        grads.narrow(0, static_cast<std::int64_t>(p.offset), static_cast<std::int64_t>(p.size))
            .copy_(p.tensor.grad().reshape({-1}));
      }
      p.tensor.set_data(data);
      p.tensor.mutable_grad() = grad_view(p);
    }
  }

  at::Tensor grad_view(const parameter& p) const {
    return grads.narrow(0, static_cast<std::int64_t>(p.offset), static_cast<std::int64_t>(p.size))
        .view(p.tensor.sizes());
  }
  at::Tensor param_view(const parameter& p) const {
    return params.narrow(0, static_cast<std::int64_t>(p.offset), static_cast<std::int64_t>(p.size))
        .view(p.tensor.sizes());
  }
};

namespace detail_module {

inline std::vector<tensor_spec> specs(const std::vector<tensor_group>& groups) {
  std::vector<tensor_spec> out;
  for (const tensor_group& g : groups) out.push_back(g.spec);
  return out;
}

// Brings the flat buffers up to date with the module before a step: with the flat layout only
// what the user replaced (a .grad() that autograd or the user re-created, parameters loaded by
// assignment) is copied back; with the per-parameter layout everything is gathered.
template <class T>
void gather(std::vector<parameter>& ps, flat_buffers<T>& flat, module_layout layout) {
  at::NoGradGuard no_grad;
  for (parameter& p : ps) {
    at::Tensor pv = flat.param_view(p);
    at::Tensor gv = flat.grad_view(p);
    if (layout == module_layout::per_parameter || p.tensor.data_ptr() != pv.data_ptr()) {
      pv.copy_(p.tensor.detach());
      if (layout == module_layout::flat) p.tensor.set_data(pv);
    }
    const at::Tensor& g = p.tensor.grad();
    if (!g.defined()) {
      gv.zero_();  // a parameter the loss did not reach has a zero gradient
      if (layout == module_layout::flat) p.tensor.mutable_grad() = gv;
    } else if (layout == module_layout::per_parameter || g.data_ptr() != gv.data_ptr()) {
      gv.copy_(g);
      if (layout == module_layout::flat) p.tensor.mutable_grad() = gv;
    }
  }
}

template <class T>
void scatter(std::vector<parameter>& ps, flat_buffers<T>& flat, module_layout layout) {
  if (layout == module_layout::flat) return;  // the parameters are the flat buffer
  at::NoGradGuard no_grad;
  for (parameter& p : ps) p.tensor.detach().copy_(flat.param_view(p));
}

// The checkpoint's name table: magic, count, then per tensor its name and size; then the
// driver's own checkpoint (keyed by id).
inline constexpr std::uint32_t names_magic = 0x4e4d4347;  // "GCMN"

inline constexpr std::string_view names_driver = "torch_module";

inline void save_names(std::ostream& os, const std::vector<tensor_group>& groups) {
  detail::put(os, names_magic);
  detail::put(os, static_cast<std::uint32_t>(groups.size()));
  for (const tensor_group& g : groups) {
    detail::put(os, static_cast<std::uint32_t>(g.name.size()));
    os.write(g.name.data(), static_cast<std::streamsize>(g.name.size()));
    detail::put(os, static_cast<std::uint64_t>(g.spec.size));
  }
}

// Reads the name table and checks it against ours as sets (order is free: the driver's
// checkpoint is keyed by id); the first mismatch is named. Memory grows only with the entries
// actually read (at most one name of 2^16 bytes ahead of them), so a count that the stream
// does not back is found truncated before it costs anything.
inline void check_names(std::istream& is, const std::vector<tensor_group>& groups) {
  auto fail = [](const std::string& why) { detail::fail_load(names_driver, why); };
  if (detail::get<std::uint32_t>(is, names_driver) != names_magic) {
    fail("not a gradcomp module checkpoint (bad magic)");
  }
  const auto count = detail::get<std::uint32_t>(is, names_driver);
  std::vector<std::string> names;
  std::vector<std::uint64_t> sizes;
  for (std::uint32_t i = 0; i < count; ++i) {
    const auto len = detail::get<std::uint32_t>(is, names_driver);
    if (len > (1u << 16)) fail(detail::concat("a tensor name of ", len, " bytes"));
    std::string name(len, '\0');
    if (!is.read(name.data(), static_cast<std::streamsize>(len))) fail("the checkpoint is truncated");
    names.push_back(std::move(name));
    sizes.push_back(detail::get<std::uint64_t>(is, names_driver));
  }
  for (std::uint32_t i = 0; i < count; ++i) {
    const auto g = std::find_if(groups.begin(), groups.end(), [&](const tensor_group& t) { return t.name == names[i]; });
    if (g == groups.end()) {
      fail(detail::concat("the checkpoint's tensor '", names[i], "' is not a tensor of this model"));
    }
    if (g->spec.size != sizes[i]) {
      fail(detail::concat("tensor '", names[i], "' has ", sizes[i], " elements in the checkpoint, ",
                          g->spec.size, " in this model"));
    }
  }
  for (const tensor_group& g : groups) {
    if (std::find(names.begin(), names.end(), g.name) == names.end()) {
      fail(detail::concat("this model's tensor '", g.name, "' is not in the checkpoint"));
    }
  }
}

}  // namespace detail_module

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
  module_base(torch::nn::Module& m, module_layout layout, const std::optional<merge_plan>& groups)
      : params_(parameters_of<T>(m)), groups_(tensor_groups(params_, groups)), layout_(layout),
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
  void save(std::ostream& os) const {
    detail_module::save_names(os, this->groups_);
    driver_.save_state(os);
  }
  void load(std::istream& is) {
    detail_module::check_names(is, this->groups_);
    driver_.load_state(is);
  }

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

  [[nodiscard]] driver_type& driver() noexcept { return driver_; }
  [[nodiscard]] const driver_type& driver() const noexcept { return driver_; }

 private:
  driver_type driver_;
};

// The tensors' indices (into a tensors() vector, which is ordered by name) in registration
// order, i.e. by their first parameter: the order in which module_lags takes densities and
// measure_backward() reports times, and for a sequential model the order of its layers.
inline std::vector<std::size_t> registration_order(const std::vector<tensor_group>& groups) {
  std::vector<std::size_t> order(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) order[g] = g;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return groups[a].first < groups[b].first; });
  return order;
}

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
  module_lags(torch::nn::Module& m, Comm& comm, std::span<const double> densities, Compressor c = {},
              Exchange x = {}, sgd_options sgd = {}, std::optional<merge_plan> groups = {})
      : base(m, module_layout::flat, groups),
        driver_(comm, detail_module::specs(this->groups_), by_name(densities), std::move(c), std::move(x), sgd),
        hooks_(this->params_, [this](std::size_t param) { gradient_done(param); }, "module_lags") {
    group_of_ = detail_module::group_of_parameters(this->groups_, this->params_.size());
    missing_.resize(this->groups_.size());
    // The release order: the reverse of registration.
    order_ = registration_order(this->groups_);
    std::reverse(order_.begin(), order_.end());
  }

  module_lags(const module_lags&) = delete;
  module_lags& operator=(const module_lags&) = delete;

  // Before backward(): gradients are zeroed (in place) and the hooks armed.
  void begin_step() {
    this->sync_buffers();
    {
      at::NoGradGuard no_grad;
      this->flat_.grads.zero_();
    }
    const std::lock_guard lock(mu_);
    for (std::size_t g = 0; g < this->groups_.size(); ++g) missing_[g] = this->groups_[g].count;
    cursor_ = 0;
    armed_ = true;
    driver_.begin_step(this->param_span("module_lags"), this->grad_span("module_lags"));
  }

  // After backward(): every tensor must have been handed over.
  const layerwise_stats& finish_step() {
    {
      const std::lock_guard lock(mu_);
      armed_ = false;
    }
    if (cursor_ != order_.size()) {
      // Hand the rest over so the driver's step can end, then report which gradient is missing.
      const std::size_t g = order_[cursor_];
      try {
        while (cursor_ < order_.size()) driver_.ready(order_[cursor_++]);
        driver_.finish_step();
      } catch (...) {
      }
      throw invalid_argument(detail::concat(
          "gradcomp::torch_module::module_lags::finish_step: the gradient of '", this->groups_[g].name,
          "' was not produced by the backward pass; every parameter must take part in the loss"));
    }
    return driver_.finish_step();
  }

  [[nodiscard]] driver_type& driver() noexcept { return driver_; }
  [[nodiscard]] const driver_type& driver() const noexcept { return driver_; }

 private:
  std::vector<double> by_name(std::span<const double> densities) const {
    if (densities.size() != this->groups_.size()) {
      detail::throw_invalid_argument("torch_module::module_lags", "densities.size()", densities.size(),
                                     detail::concat(this->groups_.size(), " (one per tensor)"));
    }
    const std::vector<std::size_t> reg = registration_order(this->groups_);
    std::vector<double> out(densities.size());
    for (std::size_t i = 0; i < reg.size(); ++i) out[reg[i]] = densities[i];
    return out;
  }

  // Called by the hooks (under the hook target's lock).
  void gradient_done(std::size_t param) {
    const std::lock_guard lock(mu_);
    if (!armed_) return;  // a backward pass outside begin_step()/finish_step()
    const std::size_t g = group_of_[param];
    if (missing_[g] > 0) --missing_[g];
    // Release, in the fixed order, every tensor whose gradients are all complete.
    while (cursor_ < order_.size() && missing_[order_[cursor_]] == 0) {
      driver_.ready(order_[cursor_++]);
    }
  }

  driver_type driver_;
  std::vector<std::size_t> group_of_;
  std::vector<std::size_t> missing_;
  std::vector<std::size_t> order_;
  std::size_t cursor_ = 0;
  bool armed_ = false;
  std::mutex mu_;
  // Last: removed (and silenced) before the members they call into go.
  detail_module::accumulator_hooks hooks_;
};

}  // namespace gradcomp::torch_module
