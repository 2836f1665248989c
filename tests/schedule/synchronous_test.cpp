// The schedule "none" of the Fashion-MNIST example: sparsified_sgd after the whole backward
// pass, top-k with residuals and DGC's momentum correction; a short run lowers the loss.
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange/sparse_allgather.hpp>
#include <gradcomp/feedback/dgc_momentum.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/quantize/identity.hpp>
#include <gradcomp/select/topk.hpp>
#include <gradcomp/step.hpp>

#include "training.hpp"

using namespace gradcomp;

namespace {

template <class Compressor>
schedule_test::losses run(unsigned steps, Compressor c, sgd_options opt, density_schedule ds) {
  using sgd_type = sparsified_sgd<Compressor, sparse_allgather, in_process_comm>;
  return schedule_test::train(
      steps,
      [&](in_process_comm& comm, const fmnist::mlp& net) {
        const std::vector<std::size_t> whole = {net.param_count()};  // one top-k over the model
        return std::make_unique<sgd_type>(comm, whole, c, sparse_allgather{}, opt, ds);
      },
      [](sgd_type& sgd, fmnist::mlp& net, std::vector<float>& params, std::vector<float>& grads,
         const float* x, const std::uint8_t* y) {
        net.train_batch(params, x, y, schedule_test::batch, grads, [](std::size_t) {});
        sgd.step(params, grads);
      });
}

}  // namespace

TEST_CASE("a short top-k + residual training run on Fashion-MNIST lowers the loss") {
  const auto r = run(48, compressor<topk, identity, residual>{}, sgd_options{.lr = 0.05, .momentum = 0.9},
                     density_schedule::constant(0.01));
  MESSAGE("eval loss " << r.before << " -> " << r.after);
  CHECK(r.after < 0.7 * r.before);
}

TEST_CASE("a short DGC training run (momentum correction, warm-up) on Fashion-MNIST lowers the loss") {
  const auto r = run(64, compressor<topk, identity, dgc_momentum>(topk{}, identity{}, dgc_momentum{.momentum = 0.9}),
                     sgd_options{.lr = 0.05}, density_schedule::warmup(0.01, 4, 6));
  MESSAGE("eval loss " << r.before << " -> " << r.after);
  CHECK(r.after < 0.7 * r.before);
}
