// libtorch_step_bench: the cost of gradcomp's bookkeeping in a LibTorch training loop. On the
// CNN of examples/libtorch (80,202 parameters), one rank, it times
//   - the optimizer step alone: torch::optim::SGD (momentum 0.9) against
//     torch_module::module_sgd with dense + identity + dense_allreduce (the same update), in
//     the flat and the per-parameter layout, and with top-k 0.01 + residual for scale;
//   - a whole training step (zero_grad, forward and backward of a batch of 32, step): the
//     same optimizers.
// The candidates run in alternating rounds of --steps steps within one run, so that drift
// of the machine's speed hits all alike; each reports the median over --rounds rounds of the
// mean step time, and its ratio to torch::optim::SGD. The last line is JSON.
//
//   libtorch_step_bench [--rounds 15] [--steps 200] [--threads 1]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/torch/module.hpp>

#include "../examples/libtorch/cnn.hpp"

namespace {

using namespace gradcomp;
namespace tm = gradcomp::torch_module;

struct candidate {
  std::string name;
  std::function<void()> step;  // one step
  std::vector<double> rounds;  // mean seconds per step, per round
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Alternating rounds; returns the medians.
void measure(std::vector<candidate>& cs, int rounds, int steps) {
  for (candidate& c : cs) {
    for (int i = 0; i < steps / 4 + 1; ++i) c.step();  // warm-up
  }
  for (int r = 0; r < rounds; ++r) {
    for (candidate& c : cs) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) c.step();
      c.rounds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps);
    }
  }
}

// Random gradients on every parameter, as a backward pass would leave them.
void fill_grads(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.mutable_grad() = torch::randn_like(p).mul_(1e-3);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 15, steps = 200, threads = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rounds") rounds = std::atoi(argv[i + 1]);
    else if (a == "--steps") steps = std::atoi(argv[i + 1]);
    else if (a == "--threads") threads = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: libtorch_step_bench [--rounds R] [--steps S] [--threads T]\n");
      return 2;
    }
  }
  if (rounds < 1 || steps < 1 || threads < 1) {
    std::fprintf(stderr, "libtorch_step_bench: --rounds, --steps and --threads must be >= 1\n");
    return 2;
  }
  at::set_num_threads(threads);
  torch::manual_seed(1);
  in_process_world world(1);
  in_process_comm comm = world.comm(0);
  const double lr = 0.01, momentum = 0.9;
  const sgd_options opt{.lr = lr, .momentum = momentum};
  using dense_c = compressor<dense, identity, no_feedback>;
  using topk_c = compressor<topk, identity, residual>;

  // One model per candidate (the flat layout re-homes a model's tensors).
  fmnist::CNN m_torch, m_flat, m_per, m_topk;
  torch::optim::SGD sgd(m_torch->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));
  tm::module_sgd<dense_c, dense_allreduce, in_process_comm> flat(*m_flat, comm, {}, {}, {.sgd = opt});
  tm::module_sgd<dense_c, dense_allreduce, in_process_comm> per(
      *m_per, comm, {}, {}, {.sgd = opt, .layout = tm::module_layout::per_parameter});
  tm::module_sgd<topk_c, sparse_allgather, in_process_comm> top(
      *m_topk, comm, {}, {}, {.sgd = opt, .schedule = density_schedule::constant(0.01)});
  for (torch::nn::Module* m : std::initializer_list<torch::nn::Module*>{&*m_torch, &*m_flat, &*m_per, &*m_topk}) {
    fill_grads(*m);
  }

  std::vector<torch::Tensor> initial;
  for (const auto& p : m_torch->parameters()) initial.push_back(p.detach().clone());

  std::vector<candidate> optimizer{
      {"torch::optim::SGD", [&] { sgd.step(); }, {}},
      {"module_sgd dense flat", [&] { flat.step(); }, {}},
      {"module_sgd dense per_parameter", [&] { per.step(); }, {}},
      {"module_sgd topk 0.01 flat", [&] { top.step(); }, {}},
  };
  measure(optimizer, rounds, steps);

  // The training steps start from the same parameters and cycle through the same 16 batches
  // (one batch over and over would drive the loss, and the backward pass's values, towards
  // zero, at a speed that depends on the model).
  {
    torch::NoGradGuard no_grad;
    for (fmnist::CNN* m : {&m_torch, &m_flat, &m_per, &m_topk}) {
      const auto to = (*m)->parameters();
      for (std::size_t i = 0; i < to.size(); ++i) to[i].copy_(initial[i]);
    }
  }
  std::vector<torch::Tensor> xs, ys;
  for (int b = 0; b < 16; ++b) {
    xs.push_back(torch::randn({32, 1, 28, 28}));
    ys.push_back(torch::randint(0, 10, {32}));
  }
  auto train = [&](fmnist::CNN& m, const std::function<void()>& zero, const std::function<void()>& step) {
    return [&m, &xs, &ys, zero, step, b = std::size_t{0}]() mutable {
      zero();
      torch::nn::functional::cross_entropy(m->forward(xs[b]), ys[b]).backward();
      step();
      b = (b + 1) % xs.size();
    };
  };
  std::vector<candidate> training{
      {"torch::optim::SGD", train(m_torch, [&] { sgd.zero_grad(); }, [&] { sgd.step(); }), {}},
      {"module_sgd dense flat", train(m_flat, [&] { flat.zero_grad(); }, [&] { flat.step(); }), {}},
      {"module_sgd dense per_parameter", train(m_per, [&] { per.zero_grad(); }, [&] { per.step(); }), {}},
      {"module_sgd topk 0.01 flat", train(m_topk, [&] { top.zero_grad(); }, [&] { top.step(); }), {}},
  };
  measure(training, std::max(3, rounds / 3), std::max(10, steps / 4));

  std::printf("CNN, 80,202 parameters, 1 rank, %d intra-op thread(s); median of per-round means\n", threads);
  std::string json = "{\"threads\": " + std::to_string(threads);
  for (auto* set : {&optimizer, &training}) {
    const bool opt_only = set == &optimizer;
    std::printf("%s\n", opt_only ? "optimizer step only:" : "training step (zero_grad, forward, backward, step; batch 32):");
    const double base = median((*set)[0].rounds);
    for (const candidate& c : *set) {
      const double t = median(c.rounds);
      std::printf("  %-32s %9.1f us  %5.2fx\n", c.name.c_str(), 1e6 * t, t / base);
      json += ", \"" + std::string(opt_only ? "step" : "train") + ": " + c.name + "\": " + std::to_string(1e6 * t);
    }
  }
  std::printf("%s}\n", json.c_str());
  return 0;
}
