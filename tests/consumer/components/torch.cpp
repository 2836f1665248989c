// gradcomp::torch alone builds a LibTorch training step: module_sgd over a torch::nn::Linear
// on one in-process rank.
#include <cstdio>

#include <torch/torch.h>

#include <gradcomp/gradcomp.hpp>
#include <gradcomp/torch/module.hpp>

int main() {
  using namespace gradcomp;
  torch::manual_seed(0);
  torch::nn::Linear model(8, 1);
  int failures = 0;
  run_in_process(1, [&](in_process_comm& comm) {
    torch_module::module_sgd<compressor<topk, identity, residual>, sparse_allgather,
                             in_process_comm>
        opt(*model, comm, {}, {},
            {.sgd = {.lr = 0.1}, .schedule = density_schedule::constant(0.5)});
    const torch::Tensor x = torch::randn({32, 8}), y = torch::randn({32, 1});
    const torch::Tensor before = torch::mse_loss(model->forward(x), y).detach();
    for (int step = 0; step < 20; ++step) {
      opt.zero_grad();
      torch::mse_loss(model->forward(x), y).backward();
      opt.step();
    }
    const torch::Tensor after = torch::mse_loss(model->forward(x), y).detach();
    std::printf("gradcomp::torch: loss %.4f -> %.4f\n", before.item<float>(), after.item<float>());
    failures += after.item<float>() < before.item<float>() ? 0 : 1;
  });
  return failures;
}
