// LAGS-SGD: the density formula, equivalence with sparsified_sgd, communication that starts
// while the backward pass is still running, misuse, and a short training run whose loss falls.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange/sparse_allgather.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/quantize/identity.hpp>
#include <gradcomp/schedule/layerwise.hpp>
#include <gradcomp/select/topk.hpp>

#include "training.hpp"

namespace {

using namespace gradcomp;
using topk_compressor = compressor<topk, identity, residual>;
using lags = layerwise_sgd<topk_compressor, sparse_allgather, in_process_comm>;

// A gradient that differs per rank, step and coordinate.
float grad_value(int rank, int step, std::size_t i) {
  return std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(step) +
                  0.7f * static_cast<float>(rank)) *
         (1.0f + static_cast<float>(i % 7));
}

}  // namespace

TEST_CASE("lags_densities follows rho_l = (t_comp_l - log2(P) alpha) / (2 (P-1) beta m_l)") {
  const std::vector<std::size_t> sizes = {1000000, 10000, 100};
  const std::vector<double> backward = {4e-3, 2e-3, 1e-3};
  const link_model link{1e-4, 1e-9};
  const auto rho = lags_densities(sizes, backward, link, 4, 0.001);
  REQUIRE(rho.size() == 3);
  CHECK(rho[0] == 0.001);  // nothing left to hide behind
  // Layer 1 hides behind layer 0's 4 ms: (4e-3 - 2e-4) / (2 * 3 * 1e-9 * 40000) > 1.
  CHECK(rho[1] == 1.0);
  CHECK(rho[2] == 1.0);

  // A slow link: the formula's value, unclamped.
  const link_model slow{1e-4, 1e-6};
  const auto r2 = lags_densities(sizes, backward, slow, 4, 1e-4);
  CHECK(r2[1] == doctest::Approx((4e-3 - 2e-4) / (2.0 * 3.0 * 1e-6 * 40000.0)));
  CHECK(r2[2] == doctest::Approx((2e-3 - 2e-4) / (2.0 * 3.0 * 1e-6 * 400.0)).epsilon(1e-9));
  // Latency larger than the computation: rho_min.
  const auto r3 = lags_densities(sizes, backward, link_model{1.0, 1e-9}, 4, 0.01);
  CHECK(r3 == std::vector<double>{0.01, 0.01, 0.01});
  // One rank sends nothing: dense.
  CHECK(lags_densities(sizes, backward, slow, 1, 0.01) == std::vector<double>{1.0, 1.0, 1.0});

  CHECK_THROWS_AS(lags_densities(sizes, std::vector<double>{1.0}, link, 4, 0.01), invalid_argument);
  CHECK_THROWS_AS(lags_densities(sizes, backward, link, 4, 0.0), invalid_argument);
  CHECK_THROWS_AS(lags_densities(sizes, backward, link_model{-1.0, 0.0}, 4, 0.01), invalid_argument);
}

TEST_CASE("lags_planned_overlap: the share of the modelled exchanges that ends before the backward pass") {
  const link_model link{1e-4, 1e-9};
  const auto cost_with = [](std::size_t n, double rho, int p, const link_model& l) {
    return std::log2(static_cast<double>(p)) * l.alpha +
           2.0 * (p - 1) * l.beta * 4.0 * static_cast<double>(n) * rho;
  };
  const auto cost = [&](std::size_t n, double rho, int p) { return cost_with(n, rho, p, link); };
  // The plan lags_densities makes hides every layer but the first: the overlap is the share
  // of the other layers' exchanges.
  const std::vector<std::size_t> sizes = {1000000, 10000, 100};
  const std::vector<double> backward = {4e-3, 2e-3, 1e-3};
  const auto rho = lags_densities(sizes, backward, link, 4, 0.001);
  const double c0 = cost(sizes[0], rho[0], 4), c1 = cost(sizes[1], rho[1], 4), c2 = cost(sizes[2], rho[2], 4);
  CHECK(lags_planned_overlap(sizes, backward, link, 4, rho) == doctest::Approx((c1 + c2) / (c0 + c1 + c2)));

  // By hand, P = 2, no latency, rho 1: an exchange of n elements takes 8 n ns.
  const link_model beta_only{0.0, 1e-9};
  const std::vector<std::size_t> two = {1000, 1000};
  const std::vector<double> b2 = {1e-3, 1e-3};
  const double per_layer = 2.0 * 1.0 * 1e-9 * 4000.0;  // 8 us
  const std::vector<double> d2 = {1.0, 1.0};
  // Both 8 us exchanges fit: layer 1 (ready at 1 ms) is hidden, layer 0 (ready at 2 ms, the
  // end of the backward pass) not.
  CHECK(lags_planned_overlap(two, b2, beta_only, 2, d2) == doctest::Approx(0.5));
  // Layer 1 375 times larger: its exchange runs from 1 ms to 4 ms, 1 ms of it before the end
  // of the backward pass; layer 0 queues behind it, from 4 ms: not hidden.
  const std::vector<std::size_t> big = {1000, 375000};
  const double c_big = 375.0 * per_layer;
  CHECK(lags_planned_overlap(big, b2, beta_only, 2, d2) == doctest::Approx(1e-3 / (c_big + per_layer)));
  // Nothing computed while exchanging: nothing hidden; one rank: nothing exchanged.
  CHECK(lags_planned_overlap(two, std::vector<double>{0.0, 0.0}, link, 2, d2) == 0.0);
  CHECK(lags_planned_overlap(two, b2, link, 1, d2) == 0.0);
  CHECK_THROWS_AS(lags_planned_overlap(two, std::vector<double>{1.0}, link, 2, d2), invalid_argument);
  CHECK_THROWS_AS(lags_planned_overlap(two, b2, link, 2, std::vector<double>{1.0}), invalid_argument);
  CHECK_THROWS_AS(lags_planned_overlap(two, b2, link, 0, d2), invalid_argument);
  CHECK_THROWS_AS(lags_planned_overlap(two, b2, link_model{-1.0, 0.0}, 2, d2), invalid_argument);
  CHECK_THROWS_AS(lags_planned_overlap(two, std::vector<double>{1e-3, -1e-3}, link, 2, d2), invalid_argument);
  CHECK_THROWS_AS(lags_planned_overlap(two, b2, link, 2, std::vector<double>{1.0, 0.0}), invalid_argument);

  // A tight plan (a slow link): layer 2's exchange queues behind layer 1's only if it outlasts
  // layer 1's wait, and the first layer's is never hidden. Checked against a step-by-step
  // timeline written out here.
  const link_model slow{2e-5, 8e-8};
  const auto tight = lags_densities(sizes, backward, slow, 4, 0.001);
  double ready = 0.0, free_at = 0.0, busy = 0.0, hidden = 0.0;
  const double end = backward[0] + backward[1] + backward[2];
  for (int j = 2; j >= 0; --j) {
    ready += backward[static_cast<std::size_t>(j)];
    const double c = cost_with(sizes[static_cast<std::size_t>(j)], tight[static_cast<std::size_t>(j)], 4, slow);
    const double begin = std::max(ready, free_at);
    free_at = begin + c;
    busy += c;
    hidden += std::max(0.0, std::min(free_at, end) - begin);
  }
  CHECK(lags_planned_overlap(sizes, backward, slow, 4, tight) == doctest::Approx(hidden / busy));
  CHECK(hidden / busy > 0.0);
  CHECK(hidden / busy < 1.0);
}

TEST_CASE("layerwise_sgd gives bit for bit what sparsified_sgd gives with the same densities") {
  const std::vector<tensor_spec> specs = {{0, 300}, {1, 50}, {2, 7}};
  const std::vector<double> densities = {0.05, 0.2, 1.0};
  const std::size_t n = 357;
  std::vector<std::vector<float>> pipelined(2), reference(2);
  run_in_process(2, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const sgd_options opt{.lr = 0.1, .momentum = 0.9};
    lags sgd(comm, specs, densities, {}, {}, opt);
    std::vector<float> params(n, 0.5f), grads(n);
    for (int step = 0; step < 5; ++step) {
      for (std::size_t i = 0; i < n; ++i) grads[i] = grad_value(comm.rank(), step, i);
      sgd.begin_step(params, grads);
      for (std::size_t t = specs.size(); t-- > 0;) sgd.ready(t);  // as a backward pass would
      const layerwise_stats& s = sgd.finish_step();
      CHECK(s.layers.size() == 3);
      CHECK(s.step.n == n);
      CHECK(s.step.selected == 15 + 10 + 7);
    }
    pipelined[r] = params;

    // The same, one optimizer per tensor run in the same order by this thread.
    std::vector<std::unique_ptr<sparsified_sgd<topk_compressor, sparse_allgather, in_process_comm>>> per;
    for (std::size_t t = 0; t < specs.size(); ++t) {
      per.push_back(std::make_unique<sparsified_sgd<topk_compressor, sparse_allgather, in_process_comm>>(
          comm, std::span<const tensor_spec>(&specs[t], 1), topk_compressor{}, sparse_allgather{}, opt,
          density_schedule::constant(densities[t])));
    }
    std::vector<float> p2(n, 0.5f), g2(n);
    const std::size_t offsets[] = {0, 300, 350};
    for (int step = 0; step < 5; ++step) {
      for (std::size_t i = 0; i < n; ++i) g2[i] = grad_value(comm.rank(), step, i);
      for (std::size_t t = specs.size(); t-- > 0;) {
        per[t]->step(std::span<float>(p2).subspan(offsets[t], specs[t].size),
                     std::span<const float>(g2).subspan(offsets[t], specs[t].size));
      }
    }
    reference[r] = p2;
  });
  CHECK(pipelined[0] == reference[0]);
  CHECK(pipelined[1] == reference[1]);
  CHECK(pipelined[0] == pipelined[1]);
}

TEST_CASE("with a slow backward pass, the last layer's exchange starts before the backward pass ends") {
  // Three layers whose backward takes 40 ms each; the exchanges are tiny.
  const std::vector<tensor_spec> specs = {{0, 2000}, {1, 500}, {2, 100}};
  const std::vector<double> densities = {0.01, 0.05, 0.5};
  const std::size_t n = 2600;
  std::vector<layerwise_stats> stats(2);
  run_in_process(2, [&](in_process_comm& comm) {
    lags sgd(comm, specs, densities, {}, {}, sgd_options{.lr = 0.01});
    std::vector<float> params(n, 0.0f), grads(n, 0.0f);
    const std::size_t offsets[] = {0, 2000, 2500};
    for (int step = 0; step < 2; ++step) {
      sgd.begin_step(params, grads);
      for (std::size_t t = specs.size(); t-- > 0;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(40));
        for (std::size_t i = 0; i < specs[t].size; ++i) {
          grads[offsets[t] + i] = grad_value(comm.rank(), step, offsets[t] + i);
        }
        sgd.ready(t);
      }
      stats[static_cast<std::size_t>(comm.rank())] = sgd.finish_step();
    }
  });
  for (const layerwise_stats& s : stats) {
    REQUIRE(s.layers.size() == 3);
    CHECK(s.layers[0].id == 2);  // the last layer went first
    CHECK(s.layers[0].comm_begin >= s.layers[0].ready);
    // The backward pass still had two 40 ms layers to go when layer 2's exchange began.
    CHECK(s.layers[0].comm_begin < s.backward_seconds);
    CHECK(s.layers[1].comm_begin < s.backward_seconds);
    CHECK(s.backward_seconds >= 0.12);
    CHECK(s.overlapped_seconds > 0.0);
    CHECK(s.overlap > 0.0);
    CHECK(s.overlap <= 1.0);
    CHECK(s.communication_seconds >= s.overlapped_seconds);
  }
}

TEST_CASE("layerwise_sgd rejects misuse") {
  const std::vector<tensor_spec> specs = {{0, 10}, {1, 5}};
  run_in_process(1, [&](in_process_comm& comm) {
    CHECK_THROWS_AS(lags(comm, specs, std::vector<double>{0.1}), invalid_argument);
    const std::vector<tensor_spec> dup = {{3, 10}, {3, 5}};
    CHECK_THROWS_AS(lags(comm, dup, std::vector<double>{0.1, 0.1}), invalid_argument);

    lags sgd(comm, specs, std::vector<double>{0.5, 0.5}, {}, {}, sgd_options{.lr = 0.1});
    std::vector<float> params(15, 0.0f), grads(15, 1.0f), small(3, 0.0f);
    CHECK_THROWS_AS(sgd.ready(0), invalid_argument);          // no step begun
    CHECK_THROWS_AS(sgd.begin_step(small, grads), invalid_argument);
    sgd.begin_step(params, grads);
    CHECK_THROWS_AS(sgd.begin_step(params, grads), invalid_argument);  // still in a step
    CHECK_THROWS_AS(sgd.ready(2), invalid_argument);
    sgd.ready(1);
    CHECK_THROWS_AS(sgd.ready(1), invalid_argument);          // twice in one step
    CHECK(sgd.wait_exchanges());
    CHECK_THROWS_WITH_AS(sgd.ready(0), doctest::Contains("after wait_exchanges()"),
                         invalid_argument);                     // after the wait
    CHECK_THROWS_AS(sgd.finish_step(), invalid_argument);     // tensor 0 never made ready
    // A full step afterwards works.
    sgd.begin_step(params, grads);
    sgd.ready(1);
    sgd.ready(0);
    const layerwise_stats& s = sgd.finish_step();
    CHECK(s.step.n == 15);
    CHECK(params[0] != 0.0f);
  });
}

TEST_CASE("a short LAGS training run on Fashion-MNIST lowers the loss") {
  const auto result = schedule_test::train(
      48,
      [](in_process_comm& comm, const fmnist::mlp& net) {
        const auto specs = schedule_test::layer_specs(net);
        // Per-layer densities as lags_densities gives them on a slow link.
        const std::vector<double> densities = {0.02, 0.2, 1.0};
        return std::make_unique<lags>(comm, specs, densities, topk_compressor{}, sparse_allgather{},
                                      sgd_options{.lr = 0.05, .momentum = 0.9});
      },
      [](lags& sgd, fmnist::mlp& net, std::vector<float>& params, std::vector<float>& grads,
         const float* x, const std::uint8_t* y) {
        sgd.begin_step(params, grads);
        net.train_batch(params, x, y, schedule_test::batch, grads, [&](std::size_t l) { sgd.ready(l); });
        sgd.finish_step();
      });
  MESSAGE("eval loss " << result.before << " -> " << result.after);
  CHECK(result.after < 0.7 * result.before);
}
