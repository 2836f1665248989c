// gradcomp_oracle: the test oracle of gradcomp.torch's hook, a Python module of the tests (not
// of the package): what P ranks of gradcomp's own in-process runtime produce for the same
// gradients. It uses pybind11 and NumPy only (no torch header), so it builds in seconds.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/runtime/bucket_engine.hpp>
#include <gradcomp/runtime/registry.hpp>

namespace py = pybind11;
namespace rt = gradcomp::runtime;

namespace {

using array = py::array_t<float, py::array::c_style | py::array::forcecast>;

// The engine's configuration from GradcompConfig.as_dict() (fields it does not know are the
// hook's own: overlap, start_iter).
rt::engine_config config_from(const py::dict& d) {
  rt::engine_config c;
  c.selector = d["selector"].cast<std::string>();
  c.quantizer = d["quantizer"].cast<std::string>();
  c.feedback = d["feedback"].cast<std::string>();
  c.exchange = d["exchange"].cast<std::string>();
  c.bits = d["bits"].cast<unsigned>();
  c.bucket_size = d["bucket_size"].cast<unsigned>();
  if (!d["threshold"].is_none()) c.threshold = d["threshold"].cast<double>();
  c.dgc_momentum = d["dgc_momentum"].cast<double>();
  c.dgc_clip_norm = d["dgc_clip_norm"].cast<double>();
  c.seed = d["seed"].cast<std::uint64_t>();
  c.density = d["density"].cast<double>();
  return c;
}

// grads[s][r] is rank r's bucket at step s; out[s][r] the averaged bucket rank r gets. Threads
// play the ranks; in_process_comm folds in rank order.
std::vector<std::vector<array>> reference(const py::dict& config, std::int64_t bucket,
                                          const std::vector<std::vector<array>>& grads,
                                          std::uint64_t first_step, double density) {
  const rt::engine_config c = config_from(config);
  if (grads.empty()) return {};
  const std::size_t ranks = grads.front().size();
  std::vector<std::vector<std::vector<float>>> data(grads.size());
  for (std::size_t s = 0; s < grads.size(); ++s) {
    if (grads[s].size() != ranks) throw std::invalid_argument("reference: every step needs one array per rank");
    for (const array& a : grads[s]) data[s].emplace_back(a.data(), a.data() + a.size());
  }
  {
    py::gil_scoped_release no_gil;
    gradcomp::run_in_process(static_cast<int>(ranks), [&](gradcomp::in_process_comm& comm) {
      rt::bucket_engine<gradcomp::in_process_comm> e(comm, c);
      const auto r = static_cast<std::size_t>(comm.rank());
      for (std::size_t s = 0; s < data.size(); ++s) {
        e.run(bucket, data[s][r], first_step + s, density);
        e.commit();
      }
    });
  }
  std::vector<std::vector<array>> out(data.size());
  for (std::size_t s = 0; s < data.size(); ++s) {
    for (const auto& v : data[s]) {
      array a(static_cast<py::ssize_t>(v.size()));
      std::copy(v.begin(), v.end(), a.mutable_data());
      out[s].push_back(std::move(a));
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(gradcomp_oracle, m) {
  m.doc() = "The in-process reference that gradcomp.torch's tests compare the hook with";
  m.def("reference", &reference, py::arg("config"), py::arg("bucket"), py::arg("grads"),
        py::arg("first_step"), py::arg("density"));
}
