// gradcomp/torch/device_module.hpp: device_module_sgd, device_module_averaging and
// device_module_lags over a torch::nn::Module on a CUDA device.
// Without a GPU (or with a torch that has no CUDA, as Debian's) only the refusals run, and the
// program exits 77 (skipped). With one: given the same gradients, device_module_sgd with
// top-k equals module_sgd on the CPU bit for bit at P = 2, in both layouts, and its checkpoint
// moves to the CPU driver; dense SGD on CUDA equals torch::optim::SGD on CUDA on averaged
// gradients over 20 steps; device_module_averaging (PQASGD, qsgd codes) equals
// module_averaging on the CPU bit for bit, and its checkpoint moves to the CPU driver;
// device_module_lags equals module_lags on the CPU bit for bit through autograd's hooks (on a
// loss linear in the parameters, whose gradients are exact on either device), and a gradient
// missing on one rank fails the step on every rank. Ranks are threads (in_process_comm; the
// device drivers' exchange over cuda::staged_comm on it, their kernels from
// module_sgd_cuda_drivers.cu).
#include <torch/torch.h>

#define DOCTEST_CONFIG_IMPLEMENT
#include "doctest_torch.hpp"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/torch/device_module.hpp>
#include <gradcomp/torch/module.hpp>

#include "module_sgd_cuda_drivers.hpp"
#include "module_support.hpp"

namespace {

using namespace gradcomp;
namespace tm = gradcomp::torch_module;

using namespace gradcomp_test;

bool have_cuda() {
  int devices = 0;
  return torch::cuda::is_available() && cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
}

// A rank's communicator stream: non-blocking, so that nothing orders it with torch's (the
// legacy default stream here) but the device modules' events.
struct stream_t {
  cudaStream_t s = nullptr;
  stream_t() {
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
      throw std::runtime_error("cudaStreamCreateWithFlags failed");
    }
  }
  stream_t(const stream_t&) = delete;
  stream_t& operator=(const stream_t&) = delete;
  ~stream_t() { cudaStreamDestroy(s); }
};

// `ranks` copies of initial on the CUDA device.
std::vector<Net> cuda_copies_of(Net& initial, int ranks, int in, int hidden) {
  std::vector<Net> out = copies_of(initial, ranks, in, hidden);
  for (Net& m : out) m->to(torch::kCUDA);
  return out;
}

// The CPU model's gradients, bit for bit, on the device model (by parameter name).
void copy_gradients(Net& cpu, Net& cuda) {
  auto from = cpu->named_parameters();
  for (auto& p : cuda->named_parameters()) {
    p.value().mutable_grad() = from[p.key()].grad().to(torch::kCUDA);
  }
}

}  // namespace

TEST_CASE("device_module_sgd refuses a module that is not on one CUDA device, naming the parameter, before its factory is called") {
  Net m(5, 4);  // on the CPU
  std::vector<torch::Tensor> before;
  std::vector<const float*> pointers;
  for (const auto& p : m->parameters()) {
    before.push_back(p.detach().clone());
    pointers.push_back(p.data_ptr<float>());
  }
  bool called = false;
  const cuda::device_driver_factory make = [&called](std::span<const tensor_spec>) {
    called = true;
    return std::unique_ptr<cuda::device_step_driver>();
  };
  std::string what;
  try {
    tm::device_module_sgd o(*m, make);
  } catch (const invalid_argument& e) {
    what = e.what();
  }
  CAPTURE(what);
  CHECK(what.find("parameter 'fc1.weight' is dtype Float, device cpu") != std::string::npos);
  CHECK(what.find("tensors on one CUDA device") != std::string::npos);
  CHECK(what.find("a CUDA tensor is needed here") != std::string::npos);
  CHECK(!called);
  // The module is as it was: the same storage (not views of a flat buffer), the same values.
  for (std::size_t i = 0; i < before.size(); ++i) {
    CHECK(m->parameters()[i].data_ptr<float>() == pointers[i]);
    CHECK(torch::equal(m->parameters()[i], before[i]));
  }
}

TEST_CASE("device_module_sgd with top-k equals module_sgd on the CPU bit for bit, given the same gradients, P = 2 (step and graph_step)") {
  if (!have_cuda()) return;
  torch::manual_seed(7);
  const int in = 13, hidden = 17, ranks = 2, steps = 20;
  const sgd_options opt{.lr = 0.05, .momentum = 0.9, .nesterov = false, .weight_decay = 1e-3};
  const double density = 0.1;
  for (const auto& config : {std::pair{tm::module_layout::flat, false},
                             std::pair{tm::module_layout::per_parameter, false},
                             std::pair{tm::module_layout::flat, true},
                             std::pair{tm::module_layout::per_parameter, true}}) {
    const tm::module_layout layout = config.first;
    const bool graph = config.second;  // stepped by graph_step (uncaptured over staged_comm)
    CAPTURE(static_cast<int>(layout));
    CAPTURE(graph);
    Net initial(in, hidden);
    std::vector<Net> host = copies_of(initial, ranks, in, hidden);
    std::vector<Net> dev = cuda_copies_of(initial, ranks, in, hidden);
    std::vector<std::string> checkpoints(ranks);
    run_in_process(ranks, [&](in_process_comm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      stream_t stream;
      tm::module_sgd<compressor<topk, identity, residual>, sparse_allgather, in_process_comm> h(
          *host[r], comm, {}, {},
          tm::module_options{.sgd = opt, .schedule = density_schedule::constant(density), .layout = layout});
      tm::device_module_sgd d(*dev[r], gradcomp_test::topk_driver(comm, stream.s, opt, density, graph), layout);
      for (int s = 0; s < steps; ++s) {
        h.zero_grad();
        auto [x, y] = batch(comm.rank(), s, in);
        torch::mse_loss(host[r]->forward(x), y).backward();
        copy_gradients(host[r], dev[r]);
        h.step();
        d.step(nullptr);  // torch's current stream: the legacy default stream here
      }
      std::ostringstream os;
      d.save(os);
      checkpoints[r] = os.str();
    });
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      CHECK(same_bits(host[static_cast<std::size_t>(r)], dev[static_cast<std::size_t>(r)]));
    }
    // The device driver's checkpoint loads into the CPU driver, whose next step is then the
    // device driver's.
    run_in_process(ranks, [&](in_process_comm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      stream_t stream;
      Net fresh(in, hidden);
      copy_parameters(dev[r], fresh);  // to the CPU
      tm::module_sgd<compressor<topk, identity, residual>, sparse_allgather, in_process_comm> h(
          *fresh, comm, {}, {},
          tm::module_options{.sgd = opt, .schedule = density_schedule::constant(density), .layout = layout});
      std::istringstream is(checkpoints[r]);
      h.load(is);
      tm::device_module_sgd d(*dev[r], gradcomp_test::topk_driver(comm, stream.s, opt, density, graph), layout);
      std::istringstream again(checkpoints[r]);
      d.load(again);
      h.zero_grad();
      auto [x, y] = batch(comm.rank(), steps, in);
      torch::mse_loss(fresh->forward(x), y).backward();
      copy_gradients(fresh, dev[r]);
      h.step();
      d.step(nullptr);
      CHECK(same_bits(fresh, dev[r]));
    });
  }
}

TEST_CASE("device_module_sgd with dense SGD on CUDA equals torch::optim::SGD on CUDA over 20 steps") {
  if (!have_cuda()) return;
  torch::manual_seed(3);
  const int in = 13, hidden = 17, ranks = 2, steps = 20;
  for (bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    const sgd_options opt{.lr = 0.05, .momentum = 0.9, .nesterov = nesterov, .weight_decay = 1e-3};
    Net initial(in, hidden);
    Net ref(in, hidden);
    copy_parameters(initial, ref);
    ref->to(torch::kCUDA);
    torch::optim::SGD sgd(ref->parameters(), torch::optim::SGDOptions(opt.lr)
                                                 .momentum(opt.momentum)
                                                 .nesterov(opt.nesterov)
                                                 .weight_decay(opt.weight_decay));
    // The reference: the mean of the ranks' gradients, on CUDA.
    train_on_mean_gradients(ref, sgd, ranks, steps, in, torch::kCUDA);
    std::vector<Net> models = cuda_copies_of(initial, ranks, in, hidden);
    run_in_process(ranks, [&](in_process_comm& comm) {
      Net& m = models[static_cast<std::size_t>(comm.rank())];
      stream_t stream;
      tm::device_module_sgd o(*m, gradcomp_test::dense_driver(comm, stream.s, opt));
      for (int s = 0; s < steps; ++s) {
        o.zero_grad();
        auto [x, y] = batch(comm.rank(), s, in);
        torch::mse_loss(m->forward(x.to(torch::kCUDA)), y.to(torch::kCUDA)).backward();
        o.step(nullptr);
      }
      CHECK(o.driver().steps_done() == static_cast<std::uint64_t>(steps));
    });
    for (int r = 0; r < ranks; ++r) CHECK(max_relative_difference(models[static_cast<std::size_t>(r)], ref) < 1e-5);
    CHECK(same_bits(models[0], models[1]));
  }
}

TEST_CASE("device_module_averaging refuses a module that is not on one CUDA device, and an empty factory") {
  Net m(5, 4);  // on the CPU
  bool called = false;
  const cuda::averaging_driver_factory make = [&called](std::span<const tensor_spec>) {
    called = true;
    return std::unique_ptr<cuda::device_averaging_driver>();
  };
  CHECK_THROWS_WITH_AS(tm::device_module_averaging(*m, make),
                       doctest::Contains("parameter 'fc1.weight' is dtype Float, device cpu"),
                       invalid_argument);
  CHECK(!called);
  if (!have_cuda()) return;
  m->to(torch::kCUDA);
  CHECK_THROWS_WITH_AS(tm::device_module_averaging(*m, cuda::averaging_driver_factory()),
                       doctest::Contains("an empty factory"), invalid_argument);
  CHECK_THROWS_WITH_AS(tm::device_module_averaging(*m, make),
                       doctest::Contains("a factory that returned no driver"), invalid_argument);
}

TEST_CASE("device_module_lags refuses a module that is not on one CUDA device, an empty factory and densities of another count") {
  Net m(5, 4);  // on the CPU
  bool called = false;
  const cuda::layerwise_driver_factory make = [&called](std::span<const tensor_spec>,
                                                        std::span<const double>) {
    called = true;
    return std::unique_ptr<cuda::device_layerwise_driver>();
  };
  const std::vector<double> densities(4, 0.5);  // fc1 and fc2: weight and bias each
  CHECK_THROWS_WITH_AS(tm::device_module_lags(*m, make, densities),
                       doctest::Contains("parameter 'fc1.weight' is dtype Float, device cpu"),
                       invalid_argument);
  CHECK(!called);
  if (!have_cuda()) return;
  m->to(torch::kCUDA);
  CHECK_THROWS_WITH_AS(tm::device_module_lags(*m, cuda::layerwise_driver_factory(), densities),
                       doctest::Contains("an empty factory"), invalid_argument);
  CHECK_THROWS_WITH_AS(tm::device_module_lags(*m, make, std::vector<double>(3, 0.5)),
                       doctest::Contains("densities.size()"), invalid_argument);
  CHECK(!called);
  CHECK_THROWS_WITH_AS(tm::device_module_lags(*m, make, densities),
                       doctest::Contains("a factory that returned no driver"), invalid_argument);
  CHECK(called);
}

TEST_CASE("device_module_averaging equals module_averaging on the CPU bit for bit, given the same gradients, P = 2") {
  if (!have_cuda()) return;
  torch::manual_seed(11);
  const int in = 13, hidden = 17, ranks = 2, steps = 11;  // the last round after the 9th step
  const sgd_options opt{.lr = 0.05, .momentum = 0.9, .nesterov = true, .weight_decay = 1e-3, .seed = 5};
  const averaging_options avg{.period = 3, .subsets = 2, .error_feedback = true};
  Net initial(in, hidden);
  std::vector<Net> host = copies_of(initial, ranks, in, hidden);
  std::vector<Net> dev = cuda_copies_of(initial, ranks, in, hidden);
  std::vector<std::string> checkpoints(ranks);
  run_in_process(ranks, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    stream_t stream;
    tm::module_averaging<qsgd, sparse_allgather, in_process_comm> h(*host[r], comm, {}, {}, opt, avg);
    tm::device_module_averaging d(*dev[r], gradcomp_test::averaging_driver(comm, stream.s, opt, avg));
    for (int s = 0; s < steps; ++s) {
      h.zero_grad();
      auto [x, y] = batch(comm.rank(), s, in);
      torch::mse_loss(host[r]->forward(x), y).backward();
      copy_gradients(host[r], dev[r]);
      h.step();
      d.step(nullptr);
    }
    CHECK(d.driver().rounds_done() == h.driver().rounds_done());
    // A round now (the last step had none): the next slice.
    h.average();
    d.average(nullptr);
    std::ostringstream hs, ds;
    h.save(hs);
    d.save(ds);
    CHECK(hs.str() == ds.str());
    checkpoints[r] = ds.str();
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(same_bits(host[static_cast<std::size_t>(r)], dev[static_cast<std::size_t>(r)]));
  }
  // The device checkpoint loads into the CPU driver; both go on as one.
  run_in_process(ranks, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    stream_t stream;
    Net fresh(in, hidden);
    copy_parameters(dev[r], fresh);  // to the CPU
    tm::module_averaging<qsgd, sparse_allgather, in_process_comm> h(*fresh, comm, {}, {}, opt, avg);
    std::istringstream is(checkpoints[r]);
    h.load(is);
    tm::device_module_averaging d(*dev[r], gradcomp_test::averaging_driver(comm, stream.s, opt, avg));
    std::istringstream again(checkpoints[r]);
    d.load(again);
    for (int s = steps; s < steps + 3; ++s) {
      h.zero_grad();
      auto [x, y] = batch(comm.rank(), s, in);
      torch::mse_loss(fresh->forward(x), y).backward();
      copy_gradients(fresh, dev[r]);
      h.step();
      d.step(nullptr);
    }
    CHECK(same_bits(fresh, dev[r]));
  });
}

namespace {

// Two parameters whose loss is linear in them: loss = sum(a * xa) + sum(b * xb), so that the
// gradients are xa and xb exactly on either device (multiples of 1/8: every sum is exact), and
// LAGS on CUDA can be compared with LAGS on the CPU bit for bit through autograd's own hooks.
struct LinearLossImpl : torch::nn::Module {
  LinearLossImpl() {
    a = register_parameter("a", torch::linspace(-1.0, 1.0, 5));
    b = register_parameter("b", torch::linspace(0.5, -0.5, 12).reshape({3, 4}));
  }
  // Rank r's loss at step s; without `a` where full is false (its gradient is then missing).
  torch::Tensor loss(int rank, int step, bool full = true) {
    auto eighths = [&](std::int64_t n, int salt) {
      auto i = torch::arange(n, torch::kFloat32);
      return torch::round(torch::sin(i * 1.7 + rank * 3.1 + step * 0.7 + salt) * 8.0) / 8.0;
    };
    const auto device = b.device();
    torch::Tensor out = (b * eighths(12, 2).reshape({3, 4}).to(device)).sum();
    if (full) out = out + (a * eighths(5, 1).to(device)).sum();
    return out;
  }
  torch::Tensor a, b;
};
TORCH_MODULE(LinearLoss);

bool same_values(LinearLoss& x, LinearLoss& y) {
  return torch::equal(x->a.detach().cpu(), y->a.detach().cpu()) &&
         torch::equal(x->b.detach().cpu(), y->b.detach().cpu());
}

}  // namespace

TEST_CASE("device_module_lags equals module_lags on the CPU bit for bit through autograd's hooks, P = 2; a missing gradient fails the step on every rank") {
  if (!have_cuda()) return;
  const int ranks = 2, steps = 6;
  const sgd_options opt{.lr = 0.05, .momentum = 0.9, .nesterov = false, .weight_decay = 0.0};
  const std::vector<double> densities{0.4, 0.25};  // a, then b: registration order
  std::vector<LinearLoss> host, dev;
  for (int r = 0; r < ranks; ++r) {
    host.emplace_back();
    dev.emplace_back();
    dev.back()->to(torch::kCUDA);
  }
  std::vector<std::string> errors(ranks);
  std::vector<bool> unchanged(ranks, false);
  run_in_process(ranks, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    stream_t stream;
    tm::module_lags<compressor<topk, identity, residual>, sparse_allgather, in_process_comm> h(
        *host[r], comm, densities, {}, {}, opt);
    tm::device_module_lags d(*dev[r], gradcomp_test::lags_driver(comm, stream.s, opt), densities);
    for (int s = 0; s < steps; ++s) {
      h.begin_step();
      host[r]->loss(comm.rank(), s).backward();
      h.finish_step();
      d.begin_step(nullptr);  // torch's current stream: the legacy default stream here
      dev[r]->loss(comm.rank(), s).backward();
      const layerwise_stats& st = d.finish_step();
      CHECK(st.layers.size() == 2);
      for (const layer_timing& l : st.layers) {  // the events' order
        CHECK(l.ready <= st.backward_seconds);
        CHECK(l.comm_begin >= l.ready);
        CHECK(l.comm_end >= l.comm_begin);
      }
    }
    CHECK(same_values(host[r], dev[r]));
    // Rank 1's loss skips `a`: every rank throws, none applies the step.
    const torch::Tensor a = dev[r]->a.detach().cpu(), b = dev[r]->b.detach().cpu();
    try {
      d.begin_step(nullptr);
      dev[r]->loss(comm.rank(), steps, comm.rank() != 1).backward();
      d.finish_step();
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
    unchanged[r] = torch::equal(dev[r]->a.detach().cpu(), a) && torch::equal(dev[r]->b.detach().cpu(), b);
    // The retry is the host's step.
    h.begin_step();
    host[r]->loss(comm.rank(), steps).backward();
    h.finish_step();
    d.begin_step(nullptr);
    dev[r]->loss(comm.rank(), steps).backward();
    d.finish_step();
    CHECK(same_values(host[r], dev[r]));
    CHECK(d.driver().steps_done() == static_cast<std::uint64_t>(steps + 1));
  });
  CHECK(errors[1].find("the gradient of 'a'") != std::string::npos);
  CHECK(errors[1].find("no rank applied this step") != std::string::npos);
  CHECK(errors[0].find("rank 1's backward pass did not produce every gradient") != std::string::npos);
  CHECK(unchanged[0]);
  CHECK(unchanged[1]);
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (rc != 0 || context.shouldExit()) return rc;
  if (!have_cuda()) {
    std::printf("SKIPPED: no CUDA device or a torch without CUDA (torch::cuda::is_available() is "
                "false); only the refusals ran\n");
    return 77;
  }
  return 0;
}
