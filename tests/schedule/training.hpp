// Short data-parallel training runs on a Fashion-MNIST subset, shared by the schedule tests:
// the example's reader and MLP (examples/mnist/), a smaller network, 2 workers, a few dozen
// steps, so that a run takes seconds under the sanitizers. A missing dataset fails the test
// with the reader's message naming the Debian package (CI installs it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/step.hpp>

#include "mnist/fashion_mnist.hpp"
#include "mnist/mlp.hpp"

namespace schedule_test {

inline constexpr std::size_t train_images = 2048;
inline constexpr std::size_t eval_images = 512;  // the first test images
inline constexpr std::size_t batch = 32;
inline constexpr int workers = 2;

inline const fmnist::fashion_mnist& data() {
  static const fmnist::fashion_mnist d = fmnist::load(fmnist::default_dir(), train_images, eval_images);
  return d;
}

inline fmnist::mlp make_net() { return fmnist::mlp({fmnist::pixels, 64, 32, fmnist::classes}); }

inline std::vector<gradcomp::tensor_spec> layer_specs(const fmnist::mlp& net) {
  std::vector<gradcomp::tensor_spec> specs;
  for (std::size_t l = 0; l < net.layers(); ++l) {
    specs.push_back({static_cast<std::uint32_t>(l), net.layer_size(l)});
  }
  return specs;
}

// Mean cross-entropy of params on the evaluation images.
inline double eval_loss(fmnist::mlp& net, std::span<const float> params) {
  const auto& t = data().test;
  const auto r = net.evaluate(params, t.images.data(), t.labels.data(), t.count);
  return r.loss_sum / static_cast<double>(t.count);
}

struct losses {
  double before = 0.0;
  double after = 0.0;
};

// Runs `steps` steps on every rank: rank r takes batches from its half of the subset.
// step(comm-bound state, net, params, grads, x, y) does the forward/backward pass and the
// schedule's communication and update; make(comm, net) builds the schedule's state once per
// rank. Returns rank 0's evaluation loss before and after.
template <class Make, class Step>
losses train(unsigned steps, Make make, Step step) {
  losses out;
  gradcomp::run_in_process(workers, [&](gradcomp::in_process_comm& comm) {
    fmnist::mlp net = make_net();
    std::vector<float> params(net.param_count()), grads(net.param_count());
    net.init(params, 42);
    auto state = make(comm, net);
    const double before = eval_loss(net, params);
    const auto& d = data().train;
    const std::size_t shard = d.count / workers;
    const std::size_t first = shard * static_cast<std::size_t>(comm.rank());
    for (unsigned s = 0; s < steps; ++s) {
      const std::size_t at = first + (s * batch) % (shard - batch + 1);
      step(*state, net, params, grads, d.images.data() + at * fmnist::pixels, d.labels.data() + at);
    }
    if (comm.rank() == 0) {
      out.before = before;
      out.after = eval_loss(net, params);
    }
  });
  return out;
}

}  // namespace schedule_test
