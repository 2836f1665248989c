// gradcomp._torch_ext's CUDA bindings: CudaEngine (cuda_engine.hpp, the hook's engine for CUDA
// buckets) and check_cuda_config, added to the module by torch_ext.cpp. A translation unit of
// its own, built only where GRADCOMP_TORCH_CUDA is defined (setup.py, where torch has CUDA;
// CMake's _torch_ext_cuda_check, which compiles it without linking wherever nvcc is), so that
// checking it does not compile the host engine's bindings again.
#ifndef GRADCOMP_TORCH_CUDA
#error "torch_ext_cuda.cpp is the CUDA part of _torch_ext: build it with GRADCOMP_TORCH_CUDA defined"
#endif

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include "cuda_engine.hpp"
#include "torch_ext_common.hpp"

namespace gradcomp_ext {

namespace {

// One rank's engine for CUDA buckets (cuda_engine.hpp), with Engine's Python interface.
class cuda_engine_py {
 public:
  cuda_engine_py(c10::intrusive_ptr<c10d::ProcessGroup> group, rt::engine_config config, int device)
      : engine_(std::move(group), std::move(config), device) {}

  py::dict run(std::int64_t bucket, const at::Tensor& grad, std::uint64_t step, double density,
               const std::vector<std::pair<std::string, std::size_t>>& labels) {
    return run_released(engine_, bucket, grad, step, density, labels);
  }

  void fail(std::int64_t bucket, std::uint64_t step, const std::string& message) {
    py::gil_scoped_release no_gil;
    engine_.fail(bucket, step, message);
  }

  gradcomp::torch_cuda::cuda_engine& get() { return engine_; }

 private:
  gradcomp::torch_cuda::cuda_engine engine_;
};

}  // namespace

void bind_cuda(py::module_& m) {
  py::class_<cuda_engine_py>(m, "CudaEngine")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, rt::engine_config, int>(),
           py::arg("process_group"), py::arg("config"), py::arg("device"))
      .def("set_stream", [](cuda_engine_py& e, std::uintptr_t s) { e.get().set_stream(s); },
           py::arg("stream"), "The CUDA stream (its handle) the next run() enqueues on.")
      .def("run", &cuda_engine_py::run, py::arg("bucket"), py::arg("grad"), py::arg("step"),
           py::arg("density"), py::arg("labels") = std::vector<std::pair<std::string, std::size_t>>{})
      .def("fail", &cuda_engine_py::fail, py::arg("bucket"), py::arg("step"), py::arg("message"))
      .def("state", [](cuda_engine_py& e, std::int64_t b) { return e.get().state(b); }, py::arg("bucket"))
      .def("set_state", [](cuda_engine_py& e, std::int64_t b, const std::vector<at::Tensor>& v) { e.get().set_state(b, v); },
           py::arg("bucket"), py::arg("buffers"))
      .def("clear", [](cuda_engine_py& e) { e.get().clear(); })
      .def("drop", [](cuda_engine_py& e, std::int64_t b) { e.get().drop(b); }, py::arg("bucket"))
      .def("commit", [](cuda_engine_py& e) { e.get().commit(); })
      .def("discard", [](cuda_engine_py& e) { e.get().discard(); })
      .def_property_readonly("buffer_count", [](cuda_engine_py& e) { return e.get().buffer_count(); })
      .def_property_readonly("rank", [](cuda_engine_py& e) { return e.get().rank(); })
      .def_property_readonly("size", [](cuda_engine_py& e) { return e.get().size(); });
  m.def("check_cuda_config", &gradcomp::torch_cuda::check_cuda_config, py::arg("config"),
        "Raises ValueError when CUDA buckets cannot run this configuration (it names what they run).");
}

}  // namespace gradcomp_ext
