// The small model and the helpers tests/torch/module_sgd.cpp and module_sgd_cuda.cpp share:
// a two-layer net whose parameters can be registered in either order, each rank's batches, a
// reference trained by a torch optimizer on the ranks' mean gradients, and comparisons of
// parameters on either device. Include after LibTorch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace gradcomp_test {

struct NetImpl : torch::nn::Module {
  NetImpl(int in, int hidden, bool reversed = false) {
    // The same parameters and names, registered in either order.
    if (reversed) {
      fc2 = register_module("fc2", torch::nn::Linear(hidden, 3));
      fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
    } else {
      fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
      fc2 = register_module("fc2", torch::nn::Linear(hidden, 3));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

// Rank r's batch at step s, on the CPU: the same on every thread that asks.
inline std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step, int in) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(1000 * step + rank + 1));
  auto x = at::randn({8, in}, gen);
  auto y = at::randn({8, 3}, gen).pow(3);
  return {x, y};
}

// The reference: one model and a torch optimizer, stepped `steps` times on the mean of the
// `ranks` ranks' gradients at each step (the batches moved to `device`, the model's).
inline void train_on_mean_gradients(Net& ref, torch::optim::Optimizer& opt, int ranks, int steps,
                                    int in, torch::Device device = torch::kCPU) {
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> sum;
    for (int r = 0; r < ranks; ++r) {
      ref->zero_grad();
      auto [x, y] = batch(r, s, in);
      torch::mse_loss(ref->forward(x.to(device)), y.to(device)).backward();
      auto ps = ref->parameters();
      for (std::size_t i = 0; i < ps.size(); ++i) {
        if (r == 0) sum.push_back(ps[i].grad().clone());
        else sum[i] += ps[i].grad();
      }
    }
    auto ps = ref->parameters();
    for (std::size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = sum[i] / ranks;
    opt.step();
  }
}

// to's parameters = from's (on either device).
inline void copy_parameters(Net& from, Net& to) {
  torch::NoGradGuard no_grad;
  auto src = from->named_parameters();
  for (auto& p : to->named_parameters()) p.value().copy_(src[p.key()]);
}

// `ranks` models of the shape (in, hidden) with `initial`'s parameters.
inline std::vector<Net> copies_of(Net& initial, int ranks, int in, int hidden) {
  std::vector<Net> out;
  for (int r = 0; r < ranks; ++r) {
    out.emplace_back(in, hidden);
    copy_parameters(initial, out.back());
  }
  return out;
}

// The largest difference of a parameter of a and b relative to b's largest magnitude (on
// either device).
inline double max_relative_difference(Net& a, Net& b) {
  double worst = 0.0;
  auto pb = b->named_parameters();
  for (auto& p : a->named_parameters()) {
    const auto q = pb[p.key()].cpu();
    const double scale = q.abs().max().item<double>() + 1e-12;
    worst = std::max(worst, (p.value().cpu() - q).abs().max().item<double>() / scale);
  }
  return worst;
}

// a's parameters bit for bit b's (on either device).
inline bool same_bits(Net& a, Net& b) {
  auto pb = b->named_parameters();
  for (auto& p : a->named_parameters()) {
    if (!torch::equal(p.value().cpu(), pb[p.key()].cpu())) return false;
  }
  return true;
}

}  // namespace gradcomp_test
