// gradcomp/torch/module_layout.hpp: a torch::nn::Module's parameters as gradcomp tensors (ids
// from their names, groups of a merge plan, the order by name), the flat buffers that hold
// their values and gradients, and the checkpoint's name table. For torch/module.hpp's drivers.
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
#include <gradcomp/schedule/merged.hpp>
#include <gradcomp/sgd.hpp>
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

// Where a module's parameters must be: on the CPU (the host drivers), or all on one CUDA
// device (device_module_sgd, torch/device_module.hpp).
enum class parameter_device { cpu, cuda };

// Why t cannot be a parameter on `where` (of dtype T, dense, contiguous; on the CPU, or on a
// CUDA device, the same as `first`'s where first is defined), or an empty string.
template <class T>
std::string why_not_parameter(const at::Tensor& t, parameter_device where, const at::Tensor& first) {
  if (where == parameter_device::cpu) {
    auto why = torch_views::why_not_viewable<T>(t.contiguous());
    if (why.empty() && !t.is_contiguous()) why = "the tensor must be contiguous";
    return why;
  }
  if (!t.defined()) return "the tensor is undefined";
  if (t.layout() != c10::kStrided) return "only dense (strided) tensors can be parameters";
  if (!t.is_cuda()) return "a CUDA tensor is needed here";
  if (first.defined() && t.device() != first.device()) {
    return detail::concat("every parameter must be on one device, the first's (",
                          first.device().str(), ")");
  }
  if (t.scalar_type() != torch_views::scalar_type_of<T>()) {
    return detail::concat("the dtype must be ", c10::toString(torch_views::scalar_type_of<T>()));
  }
  if (!t.is_contiguous()) return "the tensor must be contiguous";
  return {};
}

// The module's parameters (recursively, in registration order), checked: of dtype T, dense,
// contiguous, on the CPU (or all on one CUDA device), at least one.
template <class T>
std::vector<parameter> parameters_of(torch::nn::Module& m,
                                     parameter_device where = parameter_device::cpu) {
  std::vector<parameter> out;
  std::size_t offset = 0;
  for (const auto& item : m.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    const at::Tensor none;
    if (auto why = why_not_parameter<T>(t, where, out.empty() ? none : out.front().tensor);
        !why.empty()) {
      throw invalid_argument(detail::concat(
          "gradcomp::torch_module: parameter '", item.key(), "' is ", torch_views::describe(t),
          "; allowed: contiguous ", c10::toString(torch_views::scalar_type_of<T>()),
          where == parameter_device::cpu ? " CPU tensors" : " tensors on one CUDA device",
          " with the strided layout (", why, ")"));
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
    // On the parameters' device (parameters_of put them all on one).
    const auto options = at::TensorOptions()
                             .dtype(torch_views::scalar_type_of<T>())
                             .device(ps.front().tensor.device());
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

}  // namespace gradcomp::torch_module
