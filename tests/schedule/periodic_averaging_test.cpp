// PQASGD: local steps without communication, averaging rounds every p steps that leave the
// ranks equal, rotating slices for sparse parameter averaging, error feedback on the change,
// and short training runs whose loss falls.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange/sparse_allgather.hpp>
#include <gradcomp/quantize/identity.hpp>
#include <gradcomp/quantize/qsgd.hpp>
#include <gradcomp/quantize/scaled_sign.hpp>
#include <gradcomp/schedule/periodic_averaging.hpp>

#include "training.hpp"

using namespace gradcomp;

namespace {

float grad_value(int rank, int step, std::size_t i) {
  return std::cos(0.11f * static_cast<float>(i) * static_cast<float>(rank + 1) +
                  0.5f * static_cast<float>(step)) +
         0.25f * static_cast<float>(rank);
}

}  // namespace

TEST_CASE("fp32 averaging every step is synchronous SGD; rounds happen every p steps only") {
  const std::vector<tensor_spec> specs = {{0, 40}, {1, 9}};
  const std::size_t n = 49;
  std::vector<std::vector<float>> finals(3);
  std::vector<std::vector<std::size_t>> sent(3);
  run_in_process(3, [&](in_process_comm& comm) {
    const sgd_options opt{.lr = 0.1};
    periodic_averaging<identity, sparse_allgather, in_process_comm> every(comm, specs, {}, {}, opt,
                                                                          averaging_options{.period = 1});
    std::vector<float> params(n, 1.0f), expect(n, 1.0f), grads(n), mean(n);
    for (int step = 0; step < 4; ++step) {
      for (std::size_t i = 0; i < n; ++i) grads[i] = grad_value(comm.rank(), step, i);
      every.step(params, grads);
      // S-SGD: theta -= lr * mean over ranks of the gradients.
      for (std::size_t i = 0; i < n; ++i) {
        mean[i] = (grad_value(0, step, i) + grad_value(1, step, i) + grad_value(2, step, i)) / 3.0f;
        expect[i] -= 0.1f * mean[i];
      }
      for (std::size_t i = 0; i < n; ++i) REQUIRE(params[i] == doctest::Approx(expect[i]).epsilon(1e-5));
    }
    CHECK(every.rounds_done() == 4);

    periodic_averaging<identity, sparse_allgather, in_process_comm> p3(comm, specs, {}, {}, opt,
                                                                       averaging_options{.period = 3});
    std::vector<float> q(n, 1.0f);
    const auto r = static_cast<std::size_t>(comm.rank());
    for (int step = 0; step < 6; ++step) {
      for (std::size_t i = 0; i < n; ++i) grads[i] = grad_value(comm.rank(), step, i);
      sent[r].push_back(p3.step(q, grads).bytes_sent);
      CHECK(p3.just_averaged() == (step % 3 == 2));
    }
    finals[r] = q;
  });
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(sent[r][0] == 0);
    CHECK(sent[r][1] == 0);
    CHECK(sent[r][2] > 0);
    CHECK(sent[r][3] == 0);
    CHECK(sent[r][5] > 0);
  }
  CHECK(finals[0] == finals[1]);  // the last step was a round: the ranks agree
  CHECK(finals[1] == finals[2]);
}

TEST_CASE("sparse parameter averaging rotates over the slices") {
  const std::vector<tensor_spec> specs = {{0, 30}, {1, 2}};  // tensor 1: slice 2 of 3 is empty
  const std::size_t n = 32;
  std::vector<std::vector<float>> after(2);
  std::vector<std::size_t> averaged(2);
  run_in_process(2, [&](in_process_comm& comm) {
    periodic_averaging<identity, sparse_allgather, in_process_comm> avg(
        comm, specs, {}, {}, sgd_options{.lr = 0.5}, averaging_options{.period = 1, .subsets = 3});
    std::vector<float> params(n, 0.0f), grads(n);
    for (std::size_t i = 0; i < n; ++i) grads[i] = 1.0f + static_cast<float>(comm.rank());
    const step_stats& s = avg.step(params, grads);  // round 0: slice 0 of each tensor
    averaged[static_cast<std::size_t>(comm.rank())] = s.selected;
    after[static_cast<std::size_t>(comm.rank())] = params;
  });
  CHECK(averaged[0] == 10 + 1);  // [0, 10) of tensor 0, [0, 1) of tensor 1
  for (std::size_t i = 0; i < n; ++i) {
    const bool in_slice = i < 10 || i == 30;
    if (in_slice) {
      CHECK(after[0][i] == after[1][i]);
      CHECK(after[0][i] == doctest::Approx(-0.75f));  // mean of -0.5 and -1.0
    } else {
      CHECK(after[0][i] == doctest::Approx(-0.5f));  // local progress kept
      CHECK(after[1][i] == doctest::Approx(-1.0f));
    }
  }
}

TEST_CASE("error feedback keeps what quantizing the change lost") {
  const std::vector<tensor_spec> specs = {{0, 1000}};
  std::vector<double> gap(2);
  run_in_process(2, [&](in_process_comm& comm) {
    // scaled_sign sends sign * mean|d|: biased, so without feedback the averaged model drifts
    // from the true mean; with feedback the drift stays bounded by one round's error.
    for (const bool feedback : {true, false}) {
      periodic_averaging<scaled_sign, sparse_allgather, in_process_comm> avg(
          comm, specs, scaled_sign{}, {}, sgd_options{.lr = 0.01},
          averaging_options{.period = 2, .error_feedback = feedback});
      std::vector<float> params(1000, 0.0f), grads(1000);
      std::vector<double> exact(1000, 0.0);  // what fp32 averaging would give
      for (int step = 0; step < 40; ++step) {
        for (std::size_t i = 0; i < 1000; ++i) {
          grads[i] = static_cast<float>(i % 10) * 0.1f + 0.05f * static_cast<float>(comm.rank());
          exact[i] -= 0.01 * (static_cast<double>(i % 10) * 0.1 + 0.025);
        }
        avg.step(params, grads);
      }
      double err = 0.0;
      for (std::size_t i = 0; i < 1000; ++i) err += std::fabs(params[i] - exact[i]);
      if (comm.rank() == 0) gap[feedback ? 0 : 1] = err / 1000.0;
    }
  });
  MESSAGE("mean |theta - exact|: with feedback " << gap[0] << ", without " << gap[1]);
  CHECK(gap[0] < 0.25 * gap[1]);
}

TEST_CASE("rejects bad options and sizes") {
  const std::vector<tensor_spec> specs = {{0, 4}};
  run_in_process(1, [&](in_process_comm& comm) {
    using avg = periodic_averaging<identity, sparse_allgather, in_process_comm>;
    CHECK_THROWS_AS(avg(comm, specs, {}, {}, {}, averaging_options{.period = 0}), invalid_argument);
    CHECK_THROWS_AS(avg(comm, specs, {}, {}, {}, averaging_options{.subsets = 0}), invalid_argument);
    CHECK_THROWS_AS(avg(comm, specs, {}, {}, sgd_options{.lr = 0.0}), invalid_argument);
    avg a(comm, specs);
    std::vector<float> p(4, 0.0f), g(3, 0.0f), nan(4, std::nanf(""));
    CHECK_THROWS_AS(a.step(p, g), invalid_argument);
    CHECK_THROWS_AS(a.step(p, nan), nonfinite_error);
    CHECK(a.steps_done() == 0);
  });
}

TEST_CASE("short PQASGD training runs on Fashion-MNIST lower the loss") {
  SUBCASE("2-bit QSGD, p = 4, no error feedback") {
    using avg = periodic_averaging<qsgd, sparse_allgather, in_process_comm>;
    const auto result = schedule_test::train(
        48,
        [](in_process_comm& comm, const fmnist::mlp& net) {
          return std::make_unique<avg>(comm, schedule_test::layer_specs(net), qsgd::with_bits(2),
                                       sparse_allgather{}, sgd_options{.lr = 0.05, .momentum = 0.9},
                                       averaging_options{.period = 4, .error_feedback = false});
        },
        [](avg& a, fmnist::mlp& net, std::vector<float>& params, std::vector<float>& grads,
           const float* x, const std::uint8_t* y) {
          net.train_batch(params, x, y, schedule_test::batch, grads, [](std::size_t) {});
          a.step(params, grads);
        });
    MESSAGE("eval loss " << result.before << " -> " << result.after);
    CHECK(result.after < 0.7 * result.before);
  }
  SUBCASE("1-bit scaled sign, p = 4, error feedback") {
    using avg = periodic_averaging<scaled_sign, sparse_allgather, in_process_comm>;
    const auto result = schedule_test::train(
        48,
        [](in_process_comm& comm, const fmnist::mlp& net) {
          return std::make_unique<avg>(comm, schedule_test::layer_specs(net), scaled_sign(512),
                                       sparse_allgather{}, sgd_options{.lr = 0.05, .momentum = 0.9},
                                       averaging_options{.period = 4});
        },
        [](avg& a, fmnist::mlp& net, std::vector<float>& params, std::vector<float>& grads,
           const float* x, const std::uint8_t* y) {
          net.train_batch(params, x, y, schedule_test::batch, grads, [](std::size_t) {});
          a.step(params, grads);
        });
    MESSAGE("eval loss " << result.before << " -> " << result.after);
    CHECK(result.after < 0.7 * result.before);
  }
}
