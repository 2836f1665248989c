// gradcomp._torch_ext: the C++ side of gradcomp.torch. It takes torch.distributed's Python
// ProcessGroup as c10::intrusive_ptr<c10d::ProcessGroup> (torch's own pybind holder type),
// runs gradcomp's compressor and exchanges over it (process_group_comm). The GIL is released
// while a bucket is compressed and exchanged, so that DDP's backward pass goes on meanwhile.
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include <gradcomp/config.hpp>
#include <gradcomp/runtime/bucket_engine.hpp>
#include <gradcomp/runtime/registry.hpp>
#include <gradcomp/torch/process_group.hpp>
#include <gradcomp/torch/tensor.hpp>

#include "torch_ext_common.hpp"  // to_dict, run_released; bind_cuda where GRADCOMP_TORCH_CUDA is defined

namespace py = pybind11;
namespace rt = gradcomp::runtime;

namespace {

using gradcomp_ext::run_released;

std::vector<at::Tensor> copies(const std::vector<std::span<float>>& buffers) {
  std::vector<at::Tensor> out;
  for (const auto& b : buffers) {
    at::Tensor t = at::empty({static_cast<std::int64_t>(b.size())}, at::kFloat);
    std::copy(b.begin(), b.end(), t.data_ptr<float>());
    out.push_back(t);
  }
  return out;
}

// One rank's engine over a process group.
class engine {
 public:
  engine(c10::intrusive_ptr<c10d::ProcessGroup> group, rt::engine_config config)
      : comm_(std::move(group)), engine_(comm_, std::move(config)) {}

  py::dict run(std::int64_t bucket, const at::Tensor& grad, std::uint64_t step, double density,
               const std::vector<std::pair<std::string, std::size_t>>& labels) {
    const std::span<float> g = gradcomp::torch_views::as_span<float>(grad, "gradcomp_hook", "bucket");
    return run_released(engine_, bucket, g, step, density, labels);
  }

  // The caller's own part of the bucket failed: every rank learns it (bucket_engine::fail).
  void fail(std::int64_t bucket, std::uint64_t step, const std::string& message) {
    py::gil_scoped_release no_gil;
    engine_.fail(bucket, step, message);
  }

  std::vector<at::Tensor> state(std::int64_t bucket) { return copies(engine_.feedback().buffers(bucket)); }

  void set_state(std::int64_t bucket, const std::vector<at::Tensor>& buffers) {
    auto& fb = engine_.feedback();
    if (buffers.size() != fb.buffer_count()) {
      gradcomp::detail::throw_invalid_argument(
          "engine.set_state", "len(buffers)", buffers.size(),
          gradcomp::detail::concat(fb.buffer_count(), " (the feedback's buffer count)"));
    }
    std::size_t n = 0;
    std::vector<std::span<float>> views;
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      views.push_back(gradcomp::torch_views::as_span<float>(buffers[i], "engine.set_state",
                                                            gradcomp::detail::concat("buffers[", i, "]")));
      if (i == 0) n = views.back().size();
      if (views.back().size() != n) {
        gradcomp::detail::throw_invalid_argument("engine.set_state", "buffers sizes",
                                                 views.back().size(),
                                                 gradcomp::detail::concat("all equal (", n, ")"));
      }
    }
    if (views.empty()) return;
    auto dest = fb.reset(bucket, n);
    for (std::size_t i = 0; i < views.size(); ++i) std::copy(views[i].begin(), views[i].end(), dest[i].begin());
  }

  void clear() { engine_.feedback().clear(); }
  void drop(std::int64_t bucket) { engine_.feedback().drop(bucket); }
  void commit() { engine_.commit(); }
  void discard() { engine_.discard(); }
  [[nodiscard]] std::size_t buffer_count() { return engine_.feedback().buffer_count(); }
  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int size() const { return comm_.size(); }

 private:
  gradcomp::process_group_comm comm_;
  rt::bucket_engine<gradcomp::process_group_comm> engine_;
};

// Fails a torch.futures.Future with a std::runtime_error(message) set on its C++ side. DDP reads
// the hook's future there: a Python exception set with set_exception() is a value that is not a
// Tensor to it ("Unable to cast ..."), and one raised from a then() callback comes out as "Got
// the following error when running the callback: <type>: <message> At: <traceback>". This one
// comes out of backward() as RuntimeError(message), nothing added. A future already completed
// is left as it is.
void fail_future(py::handle future, const std::string& message) {
  const c10::intrusive_ptr<c10::ivalue::Future> fut =
      torch::jit::toIValue(future, c10::FutureType::create(c10::PyObjectType::get())).toFuture();
  py::gil_scoped_release no_gil;  // the future's callbacks take the GIL themselves
  fut->setErrorIfNeeded(std::make_exception_ptr(std::runtime_error(message)));
}

}  // namespace

PYBIND11_MODULE(_torch_ext, m) {
  m.doc() = "gradcomp's compressors and exchanges over torch.distributed process groups";
  m.attr("version") = gradcomp::detail::concat(GRADCOMP_VERSION_MAJOR, ".", GRADCOMP_VERSION_MINOR, ".", GRADCOMP_VERSION_PATCH);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const gradcomp::nonfinite_error& e) {
      PyErr_SetString(PyExc_FloatingPointError, e.what());
    } catch (const gradcomp::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const gradcomp::payload_error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  py::class_<rt::engine_config>(m, "EngineConfig")
      .def(py::init<>())
      .def_readwrite("selector", &rt::engine_config::selector)
      .def_readwrite("quantizer", &rt::engine_config::quantizer)
      .def_readwrite("feedback", &rt::engine_config::feedback)
      .def_readwrite("exchange", &rt::engine_config::exchange)
      .def_readwrite("bits", &rt::engine_config::bits)
      .def_readwrite("bucket_size", &rt::engine_config::bucket_size)
      .def_readwrite("threshold", &rt::engine_config::threshold)
      .def_readwrite("dgc_momentum", &rt::engine_config::dgc_momentum)
      .def_readwrite("dgc_clip_norm", &rt::engine_config::dgc_clip_norm)
      .def_readwrite("seed", &rt::engine_config::seed)
      .def_readwrite("density", &rt::engine_config::density)
      .def_readwrite("warmup_epochs", &rt::engine_config::warmup_epochs)
      .def_readwrite("steps_per_epoch", &rt::engine_config::steps_per_epoch)
      .def_readwrite("skip_nonfinite", &rt::engine_config::skip_nonfinite)
      .def("density_at", [](const rt::engine_config& c, std::uint64_t step) { return c.schedule().at(step); },
           py::arg("step"), "The density at a step: the schedule's warm-up, then density.");

  m.def("check_config", &rt::check_config, py::arg("config"),
        "Raises ValueError when the names, their combination or a parameter are not valid.");

  py::class_<engine>(m, "Engine")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, rt::engine_config>(),
           py::arg("process_group"), py::arg("config"))
      .def("run", &engine::run, py::arg("bucket"), py::arg("grad"), py::arg("step"),
           py::arg("density"), py::arg("labels") = std::vector<std::pair<std::string, std::size_t>>{})
      .def("fail", &engine::fail, py::arg("bucket"), py::arg("step"), py::arg("message"),
           "Takes part in the bucket's agreement as failed with `message`, so that every rank "
           "raises at once, and raises ValueError(message) here.")
      .def("state", &engine::state, py::arg("bucket"))
      .def("set_state", &engine::set_state, py::arg("bucket"), py::arg("buffers"))
      .def("clear", &engine::clear)
      .def("drop", &engine::drop, py::arg("bucket"),
           "Forgets bucket `bucket`'s feedback state, committed and staged, and frees it.")
      .def("commit", &engine::commit,
           "Keeps the new feedback state of every bucket run since the last commit or discard.")
      .def("discard", &engine::discard,
           "Forgets it: every bucket's feedback state is what the last commit left.")
      .def_property_readonly("buffer_count", &engine::buffer_count)
      .def_property_readonly("rank", &engine::rank)
      .def_property_readonly("size", &engine::size);

#ifdef GRADCOMP_TORCH_CUDA
  m.attr("HAS_CUDA") = true;
  gradcomp_ext::bind_cuda(m);
#else
  m.attr("HAS_CUDA") = false;
#endif

  m.def("fail_future", &fail_future, py::arg("future"), py::arg("message"),
        "Fails `future` (a torch.futures.Future) with RuntimeError(message) on its C++ side.");

  m.def("buffer_count", [](const rt::engine_config& c) { return rt::make_compress_half(c)->buffer_count(); },
        py::arg("config"), "The feedback buffers a bucket keeps under this configuration.");

  // The registry's vocabulary (runtime/registry.hpp), which gradcomp.torch offers as its own.
  auto names = [](const auto& list) {
    py::tuple t(std::size(list));
    for (std::size_t i = 0; i < std::size(list); ++i) t[i] = py::str(std::string(list[i]));
    return t;
  };
  m.attr("SELECTORS") = names(rt::selector_names);
  m.attr("QUANTIZERS") = names(rt::quantizer_names);
  m.attr("FEEDBACKS") = names(rt::feedback_names);
  m.attr("EXCHANGES") = names(rt::exchange_names);
}
