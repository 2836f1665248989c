// The CNN of examples/torch/train_ddp.py in LibTorch's torch::nn (80,202 parameters), shared by
// examples/libtorch/train_libtorch.cpp and bench/libtorch_step_bench.cpp.
#pragma once

#include <torch/torch.h>

namespace fmnist {

// The CNN of examples/torch/train_ddp.py: conv 1->16 5x5, max-pool 2, conv 16->32 5x5,
// max-pool 2, fc 512->128, fc 128->10.
struct CNNImpl : torch::nn::Module {
  CNNImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(1, 16, 5))),
        conv2(register_module("conv2", torch::nn::Conv2d(16, 32, 5))),
        fc1(register_module("fc1", torch::nn::Linear(512, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = torch::relu(fc1(x.flatten(1)));
    return fc2(x);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(CNN);

}  // namespace fmnist
