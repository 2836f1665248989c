// sparsified_sgd<>: the SGD update rules, options and sizes checked before anything changes,
// statistics, P ranks against the reference, checkpoints, and the ranks' random streams.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/sparsified_sgd.hpp>

#include "support/data.hpp"
#include "support/solo_comm.hpp"

namespace {

using namespace gradcomp;

using gradcomp_test::solo_comm;

// Plain SGD with momentum, Nesterov and weight decay on fp32-rounded gradients (identity sends
// fp32 values, also for double gradients). Out of line: GCC 12.2 at -O3 computed this loop
// wrongly (by about 1e-8) when it was inlined next to the driver's step in the test case; clang,
// GCC at -O2, and GCC with -fno-tree-slp-vectorize compute it exactly.
[[gnu::noinline]] void reference_sgd_step(const std::vector<double>& g, double lr, double momentum,
                                          bool nesterov, double wd, std::vector<double>& ref,
                                          std::vector<double>& vel) {
  for (std::size_t i = 0; i < g.size(); ++i) {
    double d = static_cast<double>(static_cast<float>(g[i])) + wd * ref[i];
    vel[i] = momentum * vel[i] + d;
    d = nesterov ? d + momentum * vel[i] : vel[i];
    ref[i] -= lr * d;
  }
}

}  // namespace

TEST_CASE("sparsified_sgd: dense S-SGD on one rank is plain SGD (momentum, Nesterov, weight decay)") {
  for (bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    solo_comm comm;
    sgd_options opt;
    opt.lr = 0.1;
    opt.momentum = 0.9;
    opt.nesterov = nesterov;
    opt.weight_decay = 0.01;
    sparsified_sgd<compressor<dense, identity, no_feedback, double>, dense_allreduce, solo_comm> sgd(
        comm, {3, 4}, {}, {}, opt);
    std::vector<double> theta(7, 1.0), ref = theta, vel(7, 0.0);
    for (int step = 0; step < 5; ++step) {
      const auto g = gradcomp_test::make_input<double>(gradcomp_test::dist::normal, 7, static_cast<std::uint64_t>(step));
      sgd.step(theta, g);
      reference_sgd_step(g, 0.1, 0.9, nesterov, 0.01, ref, vel);
      for (std::size_t i = 0; i < 7; ++i) REQUIRE(theta[i] == doctest::Approx(ref[i]).epsilon(1e-12));
    }
  }
}

TEST_CASE("sparsified_sgd: bad options and sizes are rejected before anything changes") {
  solo_comm comm;
  using sgd_t = sparsified_sgd<compressor<topk, identity, residual>, sparse_allgather, solo_comm>;
  sgd_options opt;
  opt.lr = -1;
  CHECK_THROWS_AS(sgd_t(comm, {10}, {}, {}, opt), invalid_argument);
  opt = {};
  opt.momentum = 1.0;
  CHECK_THROWS_AS(sgd_t(comm, {10}, {}, {}, opt), invalid_argument);
  opt = {};
  opt.nesterov = true;
  CHECK_THROWS_AS(sgd_t(comm, {10}, {}, {}, opt), invalid_argument);
  opt = {};
  opt.momentum = 0.9;
  using dgc_t = sparsified_sgd<compressor<topk, identity, dgc_momentum>, sparse_allgather, solo_comm>;
  CHECK_THROWS_AS(dgc_t(comm, {10}, {}, {}, opt), invalid_argument);
  CHECK_THROWS_AS(sgd_t(comm, std::vector<tensor_spec>{{1, 5}, {1, 6}}, {}, {}, {}, density_schedule::constant(0.5)),
                  invalid_argument);

  sgd_t sgd(comm, {10, 20}, {}, {}, {}, density_schedule::constant(0.1));
  std::vector<float> theta(30, 1.0f);
  auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, 30, 3);
  std::vector<float> short_theta(29, 1.0f);
  CHECK_THROWS_AS(sgd.step(short_theta, g), invalid_argument);
  g[25] = NAN;
  try {
    sgd.step(theta, g);
    FAIL("no exception");
  } catch (const nonfinite_error& e) {
    CHECK(std::string(e.what()).find("tensor 1 holds nan at index 15") != std::string::npos);
  }
  CHECK(theta == std::vector<float>(30, 1.0f));
  CHECK(sgd.steps_done() == 0);
  for (float e : sgd.feedback_state(0).e) CHECK(e == 0.0f);
}

TEST_CASE("sparsified_sgd: statistics report selection, density and bytes per tensor") {
  solo_comm comm;
  sparsified_sgd<compressor<topk, identity, residual>, sparse_allgather, solo_comm> sgd(
      comm, {1000, 4000}, {}, {}, {}, density_schedule::constant(0.01));
  std::vector<float> theta(5000, 0.0f);
  const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, 5000, 4);
  const auto& s = sgd.step(theta, g);
  REQUIRE(s.tensors.size() == 2);
  CHECK(s.tensors[0].selected == 10);
  CHECK(s.tensors[1].selected == 40);
  CHECK(s.selected == 50);
  CHECK(s.density == doctest::Approx(0.01));
  CHECK(s.tensors[1].threshold > 0.0);
  // header + 8 bytes per (index, fp32 value)
  CHECK(s.tensors[0].bytes_sent > 80);
  CHECK(s.tensors[0].bytes_sent < 80 + 64);
  CHECK(s.bytes_sent == s.tensors[0].bytes_sent + s.tensors[1].bytes_sent);
  CHECK(s.seconds.select >= 0.0);
  CHECK(sgd.total_bytes_sent() == s.bytes_sent);
}

TEST_CASE("sparsified_sgd: P ranks agree and apply the reference averaged update") {
  const std::vector<std::size_t> layers{300, 1, 1200};
  const std::size_t n = 1501;
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    std::vector<std::vector<float>> params(static_cast<std::size_t>(ranks));
    std::vector<std::vector<float>> averaged(static_cast<std::size_t>(ranks));
    run_in_process(ranks, [&](in_process_comm& comm) {
      sgd_options opt;
      opt.lr = 0.5;
      opt.seed = 11;
      sparsified_sgd<compressor<topk, identity, residual>, sparse_allgather, in_process_comm> sgd(
          comm, layers, {}, {}, opt, density_schedule::constant(0.02));
      std::vector<float> theta(n, 0.0f);
      for (std::uint64_t step = 0; step < 3; ++step) {
        const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, n, 1000 * step + static_cast<std::uint64_t>(comm.rank()));
        sgd.step(theta, g);
      }
      params[static_cast<std::size_t>(comm.rank())] = theta;
      const auto avg = sgd.averaged_gradient();
      averaged[static_cast<std::size_t>(comm.rank())].assign(avg.begin(), avg.end());
    });
    // Single-process reference: each rank's compressor and residual, payloads summed in
    // rank order and divided by P, then theta -= lr * mean.
    std::vector<compressor<topk, identity, residual>> cs(static_cast<std::size_t>(ranks));
    std::vector<std::vector<residual::state<float>>> states(static_cast<std::size_t>(ranks));
    for (auto& per_rank : states) {
      for (std::size_t l : layers) per_rank.push_back(residual{}.make_state<float>(l));
    }
    std::vector<float> theta(n, 0.0f), mean(n);
    for (std::uint64_t step = 0; step < 3; ++step) {
      std::fill(mean.begin(), mean.end(), 0.0f);
      for (int r = 0; r < ranks; ++r) {
        const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, n, 1000 * step + static_cast<std::uint64_t>(r));
        std::size_t off = 0;
        for (std::size_t l = 0; l < layers.size(); ++l) {
          payload p;
          auto& c = cs[static_cast<std::size_t>(r)];
          c.compress(std::span<const float>(g).subspan(off, layers[l]), states[static_cast<std::size_t>(r)][l],
                     compress_context{0.02, call_id{11, step, static_cast<std::uint32_t>(l)}}, p);
          c.decompress(p, std::span<float>(mean).subspan(off, layers[l]), decompress_mode::accumulate);
          off += layers[l];
        }
      }
      for (float& x : mean) x /= static_cast<float>(ranks);
      for (std::size_t i = 0; i < n; ++i) theta[i] -= 0.5f * mean[i];
    }
    for (int r = 0; r < ranks; ++r) {
      REQUIRE(params[static_cast<std::size_t>(r)] == theta);
      REQUIRE(averaged[static_cast<std::size_t>(r)] == mean);
    }
  }
}

TEST_CASE("sparsified_sgd: checkpoints restore the feedback state exactly, keyed by tensor id") {
  solo_comm comm;
  using sgd_t = sparsified_sgd<compressor<topk, qsgd, dgc_momentum>, sparse_allgather, solo_comm>;
  const std::vector<tensor_spec> tensors{{7, 100}, {3, 250}};
  auto make = [&] { return sgd_t(comm, tensors, {}, {}, sgd_options{}, density_schedule::warmup(0.01, 2, 3)); };
  auto grad = [](std::uint64_t step) { return gradcomp_test::make_input<float>(gradcomp_test::dist::laplace, 350, step); };

  sgd_t a = make();
  std::vector<float> theta_a(350, 0.0f);
  for (std::uint64_t s = 0; s < 4; ++s) a.step(theta_a, grad(s));
  std::stringstream ckpt;
  a.save_state(ckpt);
  const std::string bytes = ckpt.str();
  std::vector<float> theta_b = theta_a;
  for (std::uint64_t s = 4; s < 8; ++s) a.step(theta_a, grad(s));

  sgd_t b = make();
  std::stringstream in(bytes);
  b.load_state(in);
  CHECK(b.steps_done() == 4);
  for (std::uint64_t s = 4; s < 8; ++s) b.step(theta_b, grad(s));
  CHECK(theta_a == theta_b);

  // Tensors listed in another order still match by id.
  sgd_t c(comm, std::vector<tensor_spec>{{3, 250}, {7, 100}}, {}, {}, sgd_options{}, density_schedule::constant(0.01));
  std::stringstream in2(bytes);
  CHECK_NOTHROW(c.load_state(in2));

  // Mismatches are rejected and change nothing.
  sgd_t d(comm, std::vector<tensor_spec>{{7, 100}, {3, 251}}, {}, {}, sgd_options{}, density_schedule::constant(0.01));
  std::stringstream in3(bytes);
  CHECK_THROWS_AS(d.load_state(in3), invalid_argument);
  CHECK(d.steps_done() == 0);
  for (std::size_t cut : {std::size_t{0}, std::size_t{3}, bytes.size() / 2, bytes.size() - 1}) {
    sgd_t e = make();
    std::stringstream truncated(bytes.substr(0, cut));
    CHECK_THROWS_AS(e.load_state(truncated), invalid_argument);
    CHECK(e.steps_done() == 0);
    for (double v : e.feedback_state(0).v) REQUIRE(v == 0.0);
  }
  using other_t = sparsified_sgd<compressor<topk, qsgd, residual>, sparse_allgather, solo_comm>;
  other_t f(comm, tensors, {}, {}, sgd_options{}, density_schedule::constant(0.01));
  std::stringstream in4(bytes);
  CHECK_THROWS_AS(f.load_state(in4), invalid_argument);  // another feedback policy
}

TEST_CASE("sparsified_sgd: ranks round independently (call_id::rank) but pick the same Random-k "
          "indices") {
  // Every rank has the same gradient. With one shared rounding stream the QSGD decodes would be
  // equal and their mean one rank's decode; with call_id::rank each rank rounds on its own, so
  // the mean is the reference below: rank r's payload drawn with call_id{seed, step, l, r}.
  const std::vector<std::size_t> layers{700, 301};
  const std::size_t n = 1001;
  const int ranks = 3;
  using comp_t = compressor<randomk, qsgd, no_feedback>;
  const qsgd q(3, 128);
  const auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::normal, n, 77);
  std::vector<std::vector<float>> averaged(ranks);
  std::vector<std::vector<std::uint32_t>> picked(ranks);
  run_in_process(ranks, [&](in_process_comm& comm) {
    sgd_options opt;
    opt.seed = 5;
    sparsified_sgd<comp_t, sparse_allgather, in_process_comm> sgd(
        comm, layers, comp_t({}, q), {}, opt, density_schedule::constant(0.25));
    std::vector<float> theta(n, 0.0f);
    sgd.step(theta, g);
    const auto avg = sgd.averaged_gradient();
    averaged[static_cast<std::size_t>(comm.rank())].assign(avg.begin(), avg.end());
  });
  std::vector<float> mean(n, 0.0f), rank0(n, 0.0f);
  for (int r = 0; r < ranks; ++r) {
    std::size_t off = 0;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      comp_t c({}, q);
      auto st = c.make_state(layers[l]);
      payload p;
      c.compress(std::span<const float>(g).subspan(off, layers[l]), st,
                 compress_context{0.25, call_id{5, 0, static_cast<std::uint32_t>(l),
                                                static_cast<std::uint32_t>(r)}},
                 p);
      if (l == 0) picked[static_cast<std::size_t>(r)] = p.indices;
      c.decompress(p, std::span<float>(mean).subspan(off, layers[l]), decompress_mode::accumulate);
      if (r == 0) {
        c.decompress(p, std::span<float>(rank0).subspan(off, layers[l]),
                     decompress_mode::accumulate);
      }
      off += layers[l];
    }
  }
  for (float& x : mean) x /= static_cast<float>(ranks);
  for (int r = 0; r < ranks; ++r) REQUIRE(averaged[static_cast<std::size_t>(r)] == mean);
  CHECK(picked[1] == picked[0]);  // Random-k: the same indices on every rank
  CHECK(picked[2] == picked[0]);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < n; ++i) differ += mean[i] != rank0[i];
  CHECK(differ > n / 20);  // the ranks' roundings differ (about half the sent coordinates)
}
