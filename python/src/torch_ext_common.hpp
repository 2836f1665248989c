// python/src/torch_ext_common.hpp: what the two translation units of gradcomp._torch_ext share:
// torch_ext.cpp (the module, the host engine) and torch_ext_cuda.cpp (the CUDA engine's
// bindings, built where torch has CUDA): a bucket's statistics as a dict, and an engine's run()
// with the GIL released.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/extension.h>

#include <gradcomp/runtime/bucket_engine.hpp>

namespace gradcomp_ext {

namespace py = pybind11;
namespace rt = gradcomp::runtime;

// A bucket's statistics as the dict the hook's stats() keeps.
inline py::dict to_dict(const gradcomp::tensor_stats& s) {
  py::dict d;
  d["bucket"] = static_cast<std::int64_t>(s.id);
  d["n"] = s.n;
  d["selected"] = s.selected;
  d["density"] = s.density;
  d["threshold"] = s.threshold;
  d["contraction"] = s.contraction;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  d["restored"] = s.restored;
  d["exchange"] = std::string(s.exchange);
  py::dict sec;
  sec["accumulate"] = s.accumulate_seconds;
  sec["select"] = s.select_seconds;
  sec["encode"] = s.encode_seconds;
  sec["exchange"] = s.exchange_seconds;
  d["seconds"] = sec;
  return d;
}

// (name, element count) pairs from Python as the engines' labels.
inline std::vector<rt::tensor_label> named_labels(const std::vector<std::pair<std::string, std::size_t>>& labels) {
  std::vector<rt::tensor_label> named;
  named.reserve(labels.size());
  for (const auto& [name, size] : labels) named.push_back({name, size});
  return named;
}

// An engine's run() (the host's bucket_engine, or the CUDA engine) with the GIL released,
// its statistics as a dict. `labels`: (name, element count) of each parameter of the bucket,
// in order, so that the refusal of a non-finite gradient names the parameter on every rank.
template <class Engine, class Grad>
py::dict run_released(Engine& e, std::int64_t bucket, const Grad& grad, std::uint64_t step,
                      double density, const std::vector<std::pair<std::string, std::size_t>>& labels) {
  const std::vector<rt::tensor_label> named = named_labels(labels);
  gradcomp::tensor_stats st;
  {
    py::gil_scoped_release no_gil;
    st = e.run(bucket, grad, step, density, named);
  }
  py::dict d = to_dict(st);
  d["skipped"] = e.skipped();
  return d;
}

#ifdef GRADCOMP_TORCH_CUDA
// CudaEngine and check_cuda_config (torch_ext_cuda.cpp), added to the module m.
void bind_cuda(py::module_& m);
#endif

}  // namespace gradcomp_ext
