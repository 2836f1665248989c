// gradcomp/torch/module.hpp: module_sgd over a torch::nn::Module equals torch::optim::SGD on
// averaged gradients (dense, identity, dense_allreduce), in both layouts; checkpoints are keyed
// by parameter name; module_lags, driven by autograd's hooks, starts exchanging before the
// backward pass ends and equals module_sgd bit for bit. Ranks are threads (in_process_comm).
#include <torch/torch.h>

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include "doctest_torch.hpp"

#include <sys/resource.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/torch/module.hpp>

#include "module_support.hpp"

namespace {

using namespace gradcomp;
namespace tm = gradcomp::torch_module;

using namespace gradcomp_test;

using dense_c = compressor<dense, identity, no_feedback>;

}  // namespace

TEST_CASE("module_sgd with dense, identity and dense_allreduce equals torch::optim::SGD on averaged gradients") {
  torch::manual_seed(3);
  const int in = 13, hidden = 17, ranks = 2, steps = 20;
  for (tm::module_layout layout : {tm::module_layout::flat, tm::module_layout::per_parameter}) {
    for (bool nesterov : {false, true}) {
      CAPTURE(static_cast<int>(layout));
      CAPTURE(nesterov);
      Net initial(in, hidden);
      const sgd_options opt{.lr = 0.05, .momentum = 0.9, .nesterov = nesterov, .weight_decay = 1e-3};
      // Reference: one model, torch::optim::SGD, fed the mean of the ranks' gradients.
      Net ref(in, hidden);
      copy_parameters(initial, ref);
      torch::optim::SGD sgd(ref->parameters(), torch::optim::SGDOptions(opt.lr)
                                                   .momentum(opt.momentum)
                                                   .nesterov(opt.nesterov)
                                                   .weight_decay(opt.weight_decay));
      train_on_mean_gradients(ref, sgd, ranks, steps, in);
      std::vector<Net> models = copies_of(initial, ranks, in, hidden);
      run_in_process(ranks, [&](in_process_comm& comm) {
        Net& m = models[static_cast<std::size_t>(comm.rank())];
        tm::module_sgd<dense_c, dense_allreduce, in_process_comm> o(
            *m, comm, {}, {}, tm::module_options{.sgd = opt, .layout = layout});
        for (int s = 0; s < steps; ++s) {
          o.zero_grad();
          auto [x, y] = batch(comm.rank(), s, in);
          torch::mse_loss(m->forward(x), y).backward();
          o.step();
        }
      });
      for (int r = 0; r < ranks; ++r) CHECK(max_relative_difference(models[static_cast<std::size_t>(r)], ref) < 1e-5);
      CHECK(same_bits(models[0], models[1]));
    }
  }
}

TEST_CASE("module_sgd: stable ids from names; the flat layout makes parameters and gradients views") {
  Net m(5, 4);
  run_in_process(1, [&](in_process_comm& comm) {
    tm::module_sgd<compressor<topk, identity, residual>, sparse_allgather, in_process_comm> o(*m, comm);
    REQUIRE(o.tensors().size() == 4);
    // Ordered by name: fc1.bias (4), fc1.weight (20), fc2.bias (3), fc2.weight (12).
    CHECK(o.tensors()[0].name == "fc1.bias");
    CHECK(o.tensors()[1].spec.id == tm::tensor_id_of("fc1.weight"));
    const float* base = o.flat_parameters().data_ptr<float>();
    CHECK(m->fc1->bias.data_ptr<float>() == base);
    CHECK(m->fc1->weight.data_ptr<float>() == base + 4);
    CHECK(m->fc2->bias.data_ptr<float>() == base + 24);
    auto [x, y] = batch(0, 0, 5);
    torch::mse_loss(m->forward(x), y).backward();
    CHECK(m->fc1->weight.grad().data_ptr<float>() == o.flat_gradients().data_ptr<float>() + 4);
    const auto before = m->fc1->weight.clone();
    o.step();
    CHECK(!torch::equal(before, m->fc1->weight));  // updated in place
  });
}

TEST_CASE("checkpoints are keyed by parameter name: another registration order loads, other parameters are refused") {
  const int in = 6, hidden = 5;
  using C = compressor<topk, identity, residual>;
  Net a(in, hidden), b(in, hidden, /*reversed=*/true);
  copy_parameters(a, b);
  std::stringstream saved;
  run_in_process(1, [&](in_process_comm& comm) {
    const tm::module_options o{.sgd = {.lr = 0.1, .momentum = 0.5}, .schedule = density_schedule::constant(0.2)};
    tm::module_sgd<C, sparse_allgather, in_process_comm> oa(*a, comm, {}, {}, o);
    tm::module_sgd<C, sparse_allgather, in_process_comm> ob(*b, comm, {}, {}, o);
    CHECK(a->parameters()[0].sizes() != b->parameters()[0].sizes());  // registered in another order
    for (int s = 0; s < 3; ++s) {
      oa.zero_grad();
      auto [x, y] = batch(0, s, in);
      torch::mse_loss(a->forward(x), y).backward();
      oa.step();
    }
    oa.save(saved);
    copy_parameters(a, b);
    ob.load(saved);
    for (int s = 3; s < 6; ++s) {
      auto [x, y] = batch(0, s, in);
      oa.zero_grad();
      torch::mse_loss(a->forward(x), y).backward();
      oa.step();
      ob.zero_grad();
      torch::mse_loss(b->forward(x), y).backward();
      ob.step();
    }
    CHECK(same_bits(a, b));

    // A model with other parameters: the first mismatch is named, nothing changes.
    Net c(in, hidden + 1);
    tm::module_sgd<C, sparse_allgather, in_process_comm> oc(*c, comm, {}, {}, o);
    std::stringstream again;
    oa.save(again);
    std::string what;
    try {
      oc.load(again);
    } catch (const invalid_argument& e) {
      what = e.what();
    }
    // The names match; the sizes do not.
    CHECK(what.find("tensor 'fc1.bias' has 5 elements in the checkpoint, 6 in this model") != std::string::npos);

    struct OtherImpl : torch::nn::Module {
      OtherImpl() { fc3 = register_module("fc3", torch::nn::Linear(6, 3)); }
      torch::nn::Linear fc3{nullptr};
    };
    auto other = std::make_shared<OtherImpl>();
    tm::module_sgd<C, sparse_allgather, in_process_comm> oo(*other, comm, {}, {}, o);
    std::stringstream third;
    oa.save(third);
    what.clear();
    try {
      oo.load(third);
    } catch (const invalid_argument& e) {
      what = e.what();
    }
    CHECK(what.find("the checkpoint's tensor 'fc1.bias' is not a tensor of this model") != std::string::npos);
  });
}

TEST_CASE("module_lags: autograd hooks hand tensors over during backward; equals module_sgd bit for bit") {
  torch::manual_seed(5);
  // A first layer whose weight gradient takes a while, so that the backward pass is still
  // computing it when the last layer's tensors are handed over.
  const int in = 2048, hidden = 2048, ranks = 2, steps = 3;
  Net initial(in, hidden);
  std::vector<Net> lags_models = copies_of(initial, ranks, in, hidden);
  std::vector<Net> sgd_models = copies_of(initial, ranks, in, hidden);
  using C = compressor<topk, identity, residual>;
  const sgd_options opt{.lr = 0.05};
  std::vector<int> started_during_backward(ranks, 0);
  run_in_process(ranks, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const std::vector<double> densities(4, 0.05);
    tm::module_lags<C, sparse_allgather, in_process_comm> lags(*lags_models[r], comm, densities, {}, {}, opt);
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = batch(comm.rank(), s, in);
      x = x.repeat({8, 1});
      y = y.repeat({8, 1});
      lags.begin_step();
      torch::mse_loss(lags_models[r]->forward(x), y).backward();
      const layerwise_stats& st = lags.finish_step();
      REQUIRE(st.layers.size() == 4);
      // The last layer's tensors went first.
      CHECK(st.layers[0].id == tm::tensor_id_of("fc2.bias"));
      // Handed over by the hooks during backward(), and (unless the thread was not scheduled
      // in time on a busy machine) taken up before it ended.
      CHECK(st.layers[0].ready < st.backward_seconds);
      if (st.layers[0].comm_begin < st.backward_seconds) ++started_during_backward[r];
    }
  });
  for (int r = 0; r < ranks; ++r) CHECK(started_during_backward[static_cast<std::size_t>(r)] >= 1);
  run_in_process(ranks, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    tm::module_sgd<C, sparse_allgather, in_process_comm> o(
        *sgd_models[r], comm, {}, {}, tm::module_options{.sgd = opt, .schedule = density_schedule::constant(0.05)});
    for (int s = 0; s < steps; ++s) {
      o.zero_grad();
      auto [x, y] = batch(comm.rank(), s, in);
      x = x.repeat({8, 1});
      y = y.repeat({8, 1});
      torch::mse_loss(sgd_models[r]->forward(x), y).backward();
      o.step();
    }
  });
  for (int r = 0; r < ranks; ++r) CHECK(same_bits(lags_models[static_cast<std::size_t>(r)], sgd_models[static_cast<std::size_t>(r)]));
}

TEST_CASE("module_lags: a parameter the loss did not reach is named") {
  Net m(4, 3);
  run_in_process(1, [&](in_process_comm& comm) {
    const std::vector<double> densities(4, 0.5);
    tm::module_lags<compressor<topk, identity, residual>, sparse_allgather, in_process_comm> lags(*m, comm, densities);
    lags.begin_step();
    auto [x, y] = batch(0, 0, 4);
    torch::mse_loss(m->fc1->forward(x).narrow(1, 0, 3), y).backward();  // fc2 unused
    std::string what;
    try {
      lags.finish_step();
    } catch (const invalid_argument& e) {
      what = e.what();
    }
    CHECK(what.find("'fc2.bias'") != std::string::npos);
  });
}

TEST_CASE("module_lags: a gradient missing on one rank fails the step on every rank, and none applies it") {
  // Rank 1's loss skips fc2 at step 1: before, rank 1 applied the step and then threw (a retry
  // applied it twice) while rank 0 applied it and went on.
  const int in = 6, hidden = 5, ranks = 2;
  Net initial(in, hidden);
  std::vector<Net> models = copies_of(initial, ranks, in, hidden);
  std::vector<Net> clean = copies_of(initial, ranks, in, hidden);
  using C = compressor<topk, identity, residual>;
  using L = tm::module_lags<C, sparse_allgather, in_process_comm>;
  const std::vector<double> densities(4, 0.5);
  std::vector<std::string> errors(ranks);
  std::vector<bool> unchanged(ranks, false);
  run_in_process(ranks, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    L lags(*models[r], comm, densities);
    auto step = [&](int s, bool full) {
      lags.begin_step();
      auto [x, y] = batch(comm.rank(), s, in);
      auto out = full ? models[r]->forward(x) : models[r]->fc1->forward(x).narrow(1, 0, 3);
      torch::mse_loss(out, y).backward();
      lags.finish_step();
    };
    step(0, true);
    Net before(in, hidden);
    copy_parameters(models[r], before);
    try {
      step(1, comm.rank() != 1);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
    unchanged[r] = same_bits(models[r], before);
    step(1, true);  // the retry applies step 1 once
    step(2, true);
  });
  CHECK(errors[1].find("the gradient of 'fc2.") != std::string::npos);
  CHECK(errors[1].find("no rank applied this step") != std::string::npos);
  CHECK(errors[0].find("rank 1's backward pass did not produce every gradient") != std::string::npos);
  CHECK(unchanged[0]);
  CHECK(unchanged[1]);
  run_in_process(ranks, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    L lags(*clean[r], comm, densities);
    for (int s = 0; s < 3; ++s) {
      lags.begin_step();
      auto [x, y] = batch(comm.rank(), s, in);
      torch::mse_loss(clean[r]->forward(x), y).backward();
      lags.finish_step();
    }
  });
  for (int r = 0; r < ranks; ++r) {
    CHECK(same_bits(models[static_cast<std::size_t>(r)], clean[static_cast<std::size_t>(r)]));
  }
}

TEST_CASE("module_lags takes densities in registration order, whatever the names' order") {
  // Registered fc2 first: registration order is fc2.weight, fc2.bias, fc1.weight, fc1.bias,
  // while the driver's tensors are ordered by name.
  Net m(6, 5, /*reversed=*/true);
  run_in_process(1, [&](in_process_comm& comm) {
    const std::vector<double> densities{0.1, 0.2, 0.3, 0.4};
    tm::module_lags<compressor<topk, identity, residual>, sparse_allgather, in_process_comm> lags(*m, comm, densities);
    const std::vector<std::size_t> reg = tm::registration_order(lags.tensors());
    REQUIRE(reg.size() == 4);
    CHECK(lags.tensors()[reg[0]].name == "fc2.weight");
    CHECK(lags.tensors()[reg[3]].name == "fc1.bias");
    lags.begin_step();
    auto [x, y] = batch(0, 0, 6);
    torch::mse_loss(m->forward(x), y).backward();
    const layerwise_stats& st = lags.finish_step();
    REQUIRE(st.layers.size() == 4);
    for (const layer_timing& t : st.layers) {
      for (std::size_t i = 0; i < reg.size(); ++i) {
        if (lags.tensors()[reg[i]].spec.id == t.id) CHECK(t.density == doctest::Approx(densities[i]));
      }
    }
    // The release order is the reverse of registration: fc1.bias first.
    CHECK(st.layers[0].id == tm::tensor_id_of("fc1.bias"));
    std::string what;
    try {
      const std::vector<double> three{0.1, 0.2, 0.3};
      tm::module_lags<compressor<topk, identity, residual>, sparse_allgather, in_process_comm> bad(*m, comm, three);
    } catch (const invalid_argument& e) {
      what = e.what();
    }
    CHECK(what.find("densities.size()") != std::string::npos);
  });
}

TEST_CASE("measure_backward: one non-negative time per tensor in registration order; hooks removed after") {
  torch::manual_seed(2);
  Net m(512, 512);
  // Held across the call: the accumulators measure_backward() hooked (a parameter holds its
  // own only weakly; a fresh one would have no hooks whatever happened).
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  for (const auto& p : m->parameters()) accumulators.push_back(torch::autograd::impl::grad_accumulator(p));
  int calls = 0;
  const std::vector<double> t = tm::measure_backward<float>(
      *m,
      [&] {
        ++calls;
        auto [x, y] = batch(0, calls, 512);
        return torch::mse_loss(m->forward(x.repeat({16, 1})), y.repeat({16, 1}));
      },
      5);
  CHECK(calls == 5);
  REQUIRE(t.size() == 4);
  double total = 0.0;
  for (const double v : t) {
    CHECK(v >= 0.0);
    total += v;
  }
  CHECK(total > 0.0);
  // No hook is left behind on the accumulators.
  for (std::size_t i = 0; i < accumulators.size(); ++i) {
    REQUIRE(accumulators[i]);
    CHECK(accumulators[i] == torch::autograd::impl::grad_accumulator(m->parameters()[i]));
    CHECK(accumulators[i]->post_hooks().empty());
  }
  // Merged groups: one time per group.
  const std::vector<double> g = tm::measure_backward<float>(
      *m, [&] { auto [x, y] = batch(0, 0, 512); return torch::mse_loss(m->forward(x), y); }, 2,
      merge_plan{.groups = {{0, 2}, {2, 2}}});
  CHECK(g.size() == 2);
  // A parameter the loss does not reach is named.
  std::string what;
  try {
    (void)tm::measure_backward<float>(*m, [&] { auto [x, y] = batch(0, 0, 512); return m->fc1->forward(x).sum(); }, 1);
  } catch (const invalid_argument& e) {
    what = e.what();
  }
  CHECK(what.find("'fc2.") != std::string::npos);
}

TEST_CASE("module_lags refuses a parameter without a gradient accumulator and leaves no hook behind") {
  Net m(4, 3);
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  for (const auto& p : m->parameters()) accumulators.push_back(torch::autograd::impl::grad_accumulator(p));
  m->fc2->bias.set_requires_grad(false);  // registered last: checked after the others
  run_in_process(1, [&](in_process_comm& comm) {
    const std::vector<double> densities(4, 0.5);
    std::string what;
    try {
      tm::module_lags<compressor<topk, identity, residual>, sparse_allgather, in_process_comm> lags(*m, comm, densities);
    } catch (const invalid_argument& e) {
      what = e.what();
    }
    CHECK(what.find("'fc2.bias' has no gradient accumulator") != std::string::npos);
  });
  for (std::size_t i = 0; i + 1 < accumulators.size(); ++i) CHECK(accumulators[i]->post_hooks().empty());
}

TEST_CASE("module_averaging with identity and period 1 equals torch::optim::SGD on averaged gradients") {
  torch::manual_seed(4);
  const int in = 11, hidden = 7, ranks = 3, steps = 12;
  Net initial(in, hidden);
  Net ref(in, hidden);
  copy_parameters(initial, ref);
  const double lr = 0.1;
  // Local momentum would differ from momentum on the average: plain SGD.
  torch::optim::SGD sgd(ref->parameters(), torch::optim::SGDOptions(lr));
  train_on_mean_gradients(ref, sgd, ranks, steps, in);
  for (tm::module_layout layout : {tm::module_layout::flat, tm::module_layout::per_parameter}) {
    CAPTURE(static_cast<int>(layout));
    std::vector<Net> models = copies_of(initial, ranks, in, hidden);
    run_in_process(ranks, [&](in_process_comm& comm) {
      Net& m = models[static_cast<std::size_t>(comm.rank())];
      tm::module_averaging<identity, sparse_allgather, in_process_comm> o(
          *m, comm, {}, {}, sgd_options{.lr = lr}, averaging_options{.period = 1}, layout);
      for (int s = 0; s < steps; ++s) {
        o.zero_grad();
        auto [x, y] = batch(comm.rank(), s, in);
        torch::mse_loss(m->forward(x), y).backward();
        o.step();
        CHECK(o.driver().just_averaged());
      }
      o.average();  // the last step averaged: nothing to do
      CHECK(o.driver().rounds_done() == static_cast<std::uint64_t>(steps));
    });
    for (int r = 0; r < ranks; ++r) CHECK(max_relative_difference(models[static_cast<std::size_t>(r)], ref) < 1e-5);
  }
}

TEST_CASE("module_averaging: a checkpoint keyed by name resumes bit for bit") {
  torch::manual_seed(9);
  const int in = 11, hidden = 7, ranks = 2;
  const sgd_options opt{.lr = 0.05, .momentum = 0.9, .nesterov = false, .weight_decay = 0.0, .seed = 3};
  const averaging_options avg{.period = 2, .subsets = 2, .error_feedback = true};
  using driver = tm::module_averaging<qsgd, sparse_allgather, in_process_comm>;
  Net initial(in, hidden);
  std::vector<Net> models = copies_of(initial, ranks, in, hidden);
  std::vector<Net> resumed = copies_of(initial, ranks, in, hidden);
  auto train = [&](Net& m, driver& o, int rank, int from, int to) {
    for (int s = from; s < to; ++s) {
      o.zero_grad();
      auto [x, y] = batch(rank, s, in);
      torch::mse_loss(m->forward(x), y).backward();
      o.step();
    }
  };
  run_in_process(ranks, [&](in_process_comm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    driver o(*models[r], comm, {}, {}, opt, avg);
    train(models[r], o, comm.rank(), 0, 5);  // the checkpoint holds a residual and momentum
    std::stringstream checkpoint;
    o.save(checkpoint);
    copy_parameters(models[r], resumed[r]);
    train(models[r], o, comm.rank(), 5, 9);
    driver again(*resumed[r], comm, {}, {}, opt, avg);
    again.load(checkpoint);
    train(resumed[r], again, comm.rank(), 5, 9);
    CHECK(again.driver().rounds_done() == o.driver().rounds_done());
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(same_bits(models[static_cast<std::size_t>(r)], resumed[static_cast<std::size_t>(r)]));
  }
}

// The name table's count is backed by the bytes that follow it: 12 bytes that claim 2^24
// tensors are refused as truncated before memory grows by anything like the count (before,
// the reader sized its tables from the count: about 640 MB).
TEST_CASE("checkpoint name table: a count the stream does not back costs no memory") {
  auto peak_mib = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_maxrss) / 1024.0;
  };
  std::stringstream bad;
  auto put32 = [&](std::uint32_t v) { bad.write(reinterpret_cast<const char*>(&v), sizeof v); };
  put32(tm::detail_module::names_magic);
  put32(1u << 24);
  put32(5);  // the first name's length, and nothing after it
  const std::vector<tm::tensor_group> groups{{"fc1.weight", 0, 1, {0, 10}, 0}};
  const double before = peak_mib();
  std::string what;
  try {
    tm::detail_module::check_names(bad, groups);
  } catch (const invalid_argument& e) {
    what = e.what();
  }
  CHECK(what.find("the checkpoint is truncated") != std::string::npos);
  CHECK(peak_mib() - before < 64.0);
}
