// What both Fashion-MNIST examples do around their own model: the data-parallel epoch loop
// (train_epochs) and the lags / merged schedules' plan from the measured backward pass and the
// link (plan_pipeline), with the same output in both.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include <gradcomp/gradcomp.hpp>

#include "cli.hpp"
#include "policies.hpp"

namespace fmnist {

// The lags / merged schedules' plan: the link (measured, or --link-gbit), and either LAGS's
// densities per layer or the merged groups, each at --density.
struct pipeline_plan {
  gradcomp::link_model link;
  std::vector<double> densities;               // lags: per layer; merged: per group
  std::optional<gradcomp::merge_plan> groups;  // merged only
  double planned_overlap = -1.0;               // lags: lags_planned_overlap() of the plan
};

// sizes and backward per layer in forward order (backward: the same on every rank). Collective;
// rank 0 prints the plan.
template <class Compressor, class Comm>
pipeline_plan plan_pipeline(const train_options& o, Comm& comm, const Compressor& c,
                            const std::vector<std::size_t>& sizes, const std::vector<double>& backward) {
  using namespace gradcomp;
  pipeline_plan p;
  p.link = measure_link(comm);
  if (o.link_gbit > 0.0) p.link = link_model::from_gbit(o.link_gbit, o.link_latency_us * 1e-6);
  if (o.schedule == "lags") {
    p.densities = lags_densities(sizes, backward, p.link, comm.size(), o.density);
    p.planned_overlap = lags_planned_overlap(sizes, backward, p.link, comm.size(), p.densities);
  } else {
    const double per_element =
        selection_seconds_per_element(c, *std::max_element(sizes.begin(), sizes.end()), o, comm);
    p.groups = plan_merged_groups(sizes, backward, merge_cost{p.link, comm.size(), o.density, per_element});
    p.densities.assign(p.groups->groups.size(), o.density);
    if (comm.rank() == 0) {
      std::printf("merged: %zu groups (modelled %.3g ms, %.3g ms unmerged):", p.groups->groups.size(),
                  1e3 * p.groups->predicted_seconds, 1e3 * p.groups->unmerged_seconds);
      for (const auto& g : p.groups->groups) std::printf(" [%zu..%zu]", g.first, g.first + g.count - 1);
      std::printf("\n");
    }
  }
  if (comm.rank() == 0) {
    std::printf("%s: link alpha %.3g us, beta %.3g ns/byte (%s); backward ms per layer:", o.schedule.c_str(),
                1e6 * p.link.alpha, 1e9 * p.link.beta, o.link_gbit > 0.0 ? "given" : "measured");
    for (const double b : backward) std::printf(" %.3f", 1e3 * b);
    std::printf("; densities:");
    for (const double d : p.densities) std::printf(" %.4g", d);
    std::printf("\n");
    if (p.planned_overlap >= 0.0) {
      std::printf("lags: planned overlap %.3f (the share of the modelled exchanges before the end of "
                  "the backward pass; the JSON's overlap is the measured one)\n",
                  p.planned_overlap);
    }
    std::fflush(stdout);
  }
  return p;
}

// One rank's training: --epochs epochs over `examples` training images, the same permutation
// per epoch on every rank, rank r taking the r-th shard in batches of --batch.
//   step(indices)  trains on the batch of those --batch image indices; returns
//                  {loss summed over the batch, correct predictions}
//   epoch_end()    readies the model for evaluation (e.g. a last averaging round)
//   test()         the test accuracy (collective)
// schedule gives bytes_sent() (this rank's, in bytes) and overlap() (< 0: none). Rank 0 prints
// a line per epoch, and with --evals-per-epoch E > 1 an "eval" line E times per epoch: the
// steps, the training seconds so far without the time the evaluations took, the test accuracy
// and the bytes sent (mid-epoch evaluations test each rank's model as it is; under pqasgd the
// ranks' models then differ by the steps since the last average).
template <class Comm, class Schedule, class Step, class EpochEnd, class Test>
outcome train_epochs(Comm& comm, const train_options& o, std::size_t examples, std::size_t parameters,
                     Schedule& schedule, Step&& step, EpochEnd&& epoch_end, Test&& test) {
  using gradcomp::reduce_op;
  const auto start = std::chrono::steady_clock::now();
  const auto rank = static_cast<std::size_t>(comm.rank());
  const std::size_t shard = examples / static_cast<std::size_t>(comm.size());
  const std::size_t steps_per_epoch = shard / o.batch;
  outcome out;
  std::vector<std::int64_t> order(examples);
  double eval_seconds = 0.0;  // time spent in evaluations, kept out of the eval lines' clock
  const std::size_t eval_every =
      o.evals_per_epoch > 1 ? std::max<std::size_t>(1, steps_per_epoch / o.evals_per_epoch) : 0;
  auto eval_line = [&](std::size_t steps, double accuracy, double seconds_before) {
    double bytes = static_cast<double>(schedule.bytes_sent());
    comm.allreduce(std::span<double>(&bytes, 1), reduce_op::sum);
    if (comm.rank() == 0) {
      std::printf("eval step %zu  train_seconds %.2f  test_acc %.4f  bytes_sent %.0f\n", steps,
                  seconds_before - eval_seconds, accuracy, bytes / static_cast<double>(comm.size()));
      std::fflush(stdout);
    }
  };
  auto since_start = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (unsigned epoch = 0; epoch < o.epochs; ++epoch) {
    std::iota(order.begin(), order.end(), std::int64_t{0});
    std::shuffle(order.begin(), order.end(), std::mt19937_64(o.seed * 1000003u + epoch));
    double sums[3] = {0.0, 0.0, 0.0};  // loss, correct, examples
    for (std::size_t s = 0; s < steps_per_epoch; ++s) {
      const std::pair<double, double> r =
          step(std::span<const std::int64_t>(order.data() + rank * shard + s * o.batch, o.batch));
      sums[0] += r.first;
      sums[1] += r.second;
      sums[2] += static_cast<double>(o.batch);
      if (eval_every && (s + 1) % eval_every == 0 && s + 1 < steps_per_epoch &&
          (s + 1) / eval_every < o.evals_per_epoch) {
        const double t0 = since_start();
        const double accuracy = test();
        eval_line(epoch * steps_per_epoch + s + 1, accuracy, t0);
        eval_seconds += since_start() - t0;
      }
    }
    epoch_end();
    comm.allreduce(std::span<double>(sums), reduce_op::sum);
    out.loss = sums[0] / sums[2];
    out.train_accuracy = sums[1] / sums[2];
    const double t_test = since_start();
    out.test_accuracy = test();
    out.steps = (epoch + 1) * steps_per_epoch;
    if (eval_every) {
      eval_line(out.steps, out.test_accuracy, t_test);
      eval_seconds += since_start() - t_test;
    }
    double bytes = static_cast<double>(schedule.bytes_sent());
    comm.allreduce(std::span<double>(&bytes, 1), reduce_op::sum);
    out.bytes_sent = bytes / static_cast<double>(comm.size());
    out.dense_bytes = 4.0 * static_cast<double>(parameters) * static_cast<double>(out.steps);
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (comm.rank() == 0) print_epoch(epoch + 1, o, out);
  }
  out.overlap = schedule.overlap();
  if (out.overlap >= 0.0) {
    comm.allreduce(std::span<double>(&out.overlap, 1), reduce_op::sum);
    out.overlap /= comm.size();
  }
  return out;
}

}  // namespace fmnist
