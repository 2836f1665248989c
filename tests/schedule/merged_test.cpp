// Merged-gradient groups: the planner on inputs whose answer is known, the groups as tensors,
// and a short training run over the groups whose loss falls.
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange/sparse_allgather.hpp>
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/quantize/identity.hpp>
#include <gradcomp/schedule/merged.hpp>
#include <gradcomp/select/topk.hpp>

#include "training.hpp"

using namespace gradcomp;

TEST_CASE("tiny layers on a high-latency link merge into one group") {
  const std::vector<std::size_t> sizes(6, 100);
  const std::vector<double> backward(6, 1e-5);  // 10 us each
  const merge_cost cost{link_model{1e-3, 1e-9}, 8, 0.01, 0.0};
  const merge_plan plan = plan_merged_groups(sizes, backward, cost);
  REQUIRE(plan.groups.size() == 1);
  CHECK(plan.groups[0].first == 0);
  CHECK(plan.groups[0].count == 6);
  CHECK(plan.predicted_seconds < plan.unmerged_seconds);
  // One start-up latency instead of six: 6e-5 s of backward, then 3 alpha.
  CHECK(plan.predicted_seconds == doctest::Approx(6e-5 + cost.seconds(600)));
  CHECK(plan.completes(0) == std::optional<std::size_t>(0));
  CHECK(!plan.completes(3).has_value());
}

TEST_CASE("merge_cost prices every byte: no burst between groups sent back to back") {
  link_model bursty{1e-4, 1e-9};
  bursty.burst_bytes = 1e6;
  const merge_cost paced{link_model{1e-4, 1e-9}, 4, 0.01, 1e-10};
  const merge_cost with_burst{bursty, 4, 0.01, 1e-10};
  for (std::size_t elements : {1, 100, 12345, 1 << 20}) {
    CAPTURE(elements);
    CHECK(with_burst.seconds(elements) == paced.seconds(elements));
  }
}

TEST_CASE("huge layers on a link without latency stay apart") {
  const std::vector<std::size_t> sizes(4, 10'000'000);
  const std::vector<double> backward(4, 0.05);
  const merge_cost cost{link_model{0.0, 1e-10}, 4, 0.001, 1e-10};
  const merge_plan plan = plan_merged_groups(sizes, backward, cost);
  REQUIRE(plan.groups.size() == 4);
  for (std::size_t g = 0; g < 4; ++g) {
    CHECK(plan.groups[g].first == g);
    CHECK(plan.groups[g].count == 1);
    CHECK(plan.completes(g) == std::optional<std::size_t>(g));
  }
  CHECK(plan.predicted_seconds == doctest::Approx(plan.unmerged_seconds));
}

TEST_CASE("only the small tail merges when the big first layer's backward is long") {
  // Backward runs 3, 2, 1, 0: three tiny layers, then a big layer with a long backward pass.
  const std::vector<std::size_t> sizes = {5'000'000, 100, 100, 100};
  const std::vector<double> backward = {0.02, 1e-6, 1e-6, 1e-6};
  const merge_cost cost{link_model{1e-3, 1e-9}, 4, 0.01, 0.0};
  const merge_plan plan = plan_merged_groups(sizes, backward, cost);
  REQUIRE(plan.groups.size() == 2);
  CHECK(plan.groups[0].first == 0);
  CHECK(plan.groups[0].count == 1);
  CHECK(plan.groups[1].first == 1);
  CHECK(plan.groups[1].count == 3);
  CHECK(plan.completes(1) == std::optional<std::size_t>(1));
}

TEST_CASE("merged_tensors turns groups into tensors of the flat buffer") {
  const std::vector<tensor_spec> layers = {{10, 5}, {11, 7}, {12, 3}, {13, 1}};
  merge_plan plan;
  plan.groups = {{0, 1}, {1, 3}};
  const auto t = merged_tensors(plan, layers);
  REQUIRE(t.size() == 2);
  CHECK(t[0].id == 10);
  CHECK(t[0].size == 5);
  CHECK(t[1].id == 11);
  CHECK(t[1].size == 11);
  plan.groups = {{0, 1}, {2, 2}};
  CHECK_THROWS_AS(merged_tensors(plan, layers), invalid_argument);
  plan.groups = {{0, 3}};
  CHECK_THROWS_AS(merged_tensors(plan, layers), invalid_argument);
  CHECK_THROWS_AS(plan_merged_groups(std::vector<std::size_t>{1, 2}, std::vector<double>{1.0},
                                     merge_cost{}),
                  invalid_argument);
  CHECK(plan_merged_groups({}, {}, merge_cost{}).groups.empty());
}

TEST_CASE("a short training run over merged groups on Fashion-MNIST lowers the loss") {
  using sgd_type = sparsified_sgd<compressor<topk, identity, residual>, sparse_allgather, in_process_comm>;
  const auto result = schedule_test::train(
      48,
      [](in_process_comm& comm, const fmnist::mlp& net) {
        const auto layers = schedule_test::layer_specs(net);
        std::vector<std::size_t> sizes;
        for (const auto& l : layers) sizes.push_back(l.size);
        // A latency-bound link merges the two small layers (and maybe all).
        const merge_plan plan = plan_merged_groups(
            sizes, std::vector<double>{2e-4, 2e-5, 1e-5}, merge_cost{link_model{1e-3, 1e-9}, 2, 0.05, 0.0});
        CHECK(plan.groups.size() < layers.size());
        const auto groups = merged_tensors(plan, layers);
        return std::make_unique<sgd_type>(comm, groups, compressor<topk, identity, residual>{},
                                          sparse_allgather{}, sgd_options{.lr = 0.05, .momentum = 0.9},
                                          density_schedule::constant(0.05));
      },
      [](sgd_type& sgd, fmnist::mlp& net, std::vector<float>& params, std::vector<float>& grads,
         const float* x, const std::uint8_t* y) {
        net.train_batch(params, x, y, schedule_test::batch, grads, [](std::size_t) {});
        sgd.step(params, grads);
      });
  MESSAGE("eval loss " << result.before << " -> " << result.after);
  CHECK(result.after < 0.7 * result.before);
}
