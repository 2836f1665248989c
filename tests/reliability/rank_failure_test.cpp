// A mistake on one rank must not hang or corrupt the others: when a rank throws in the middle
// of sparsified_sgd::step, every other rank fails promptly with communicator_error naming the
// rank and the cause, run_in_process rethrows the original exception, and no rank's
// parameters are touched by the failed step.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <gradcomp/gradcomp.hpp>

#include "support.hpp"

namespace {

using namespace gradcomp;
using reliability::byte_snapshot;
using reliability::bytes_of;
using reliability::gradient;

// A hang is the failure looked for: a run that does not end in time stops the test binary with
// a message instead of blocking CI until its timeout.
template <class Fn>
void within_deadline(Fn&& fn) {
  auto done = std::async(std::launch::async, std::forward<Fn>(fn));
  if (done.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    std::fprintf(stderr, "rank_failure_test: a run did not finish within 30 s (deadlock)\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  done.get();
}

const std::vector<std::size_t> layers{300, 50, 700};
constexpr std::size_t total = 1050;
constexpr int ranks = 4;

// What one rank saw in the run.
struct outcome {
  std::string error = "none";  // dynamic type of the exception it ended with
  std::string what;
  std::uint64_t steps_done = 0;
  byte_snapshot params_before_failure;  // after the last successful step
  byte_snapshot params_at_end;
};

std::string kind_of(const std::exception& e) {
  if (dynamic_cast<const communicator_error*>(&e)) return "communicator_error";
  if (dynamic_cast<const nonfinite_error*>(&e)) return "nonfinite_error";
  if (dynamic_cast<const payload_error*>(&e)) return "payload_error";
  if (dynamic_cast<const gradcomp::invalid_argument*>(&e)) return "invalid_argument";
  if (dynamic_cast<const std::runtime_error*>(&e)) return "runtime_error";
  return "other";
}

// Runs `steps` steps of Sgd on every rank; make_sgd(comm) builds the rank's optimizer and
// grad_of(rank, step) its gradient. Returns each rank's outcome and what run_in_process threw.
template <class MakeSgd, class GradOf>
std::pair<std::vector<outcome>, std::string> train(MakeSgd make_sgd, GradOf grad_of, int steps) {
  std::vector<outcome> out(ranks);
  std::string thrown = "nothing";
  within_deadline([&] {
    try {
      run_in_process(ranks, [&](in_process_comm& comm) {
        auto& mine = out[static_cast<std::size_t>(comm.rank())];
        auto sgd = make_sgd(comm);
        std::vector<float> params(total, 0.5f);
        try {
          for (int s = 0; s < steps; ++s) {
            mine.params_before_failure = bytes_of(params);
            const std::vector<float> g = grad_of(comm.rank(), s);
            sgd.step(params, g);
          }
        } catch (const std::exception& e) {
          mine.error = kind_of(e);
          mine.what = e.what();
          mine.steps_done = sgd.steps_done();
          mine.params_at_end = bytes_of(params);
          throw;
        }
        mine.steps_done = sgd.steps_done();
        mine.params_at_end = bytes_of(params);
      });
    } catch (const std::exception& e) {
      thrown = kind_of(e) + ": " + e.what();
    }
  });
  return {std::move(out), thrown};
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A selector that throws on one rank for one tensor of one step, and is exact top-k otherwise.
struct failing_selector {
  int rank = -1;
  int fail_rank = -2;
  std::uint64_t fail_step = 0;
  std::uint32_t fail_tensor = 0;
  topk inner{};

  template <gradient_value T>
  selection_stats select(std::span<const T> g, const select_context& ctx,
                         std::vector<std::uint32_t>& indices) {
    if (rank == fail_rank && ctx.id.step == fail_step && ctx.id.tensor_id == fail_tensor) {
      throw std::runtime_error("failing_selector: injected failure");
    }
    return inner.select(g, ctx, indices);
  }
};
static_assert(gradcomp::selector<failing_selector>);

template <class Exchange, class Selector = topk>
using sgd_with =
    sparsified_sgd<compressor<Selector, identity, residual>, Exchange, in_process_comm>;

}  // namespace

TEST_CASE_TEMPLATE("rank failure: a NaN gradient on one rank mid-training fails every rank "
                   "promptly, parameters untouched",
                   X, sparse_allgather, dense_allreduce) {
  constexpr int failing = 2;
  constexpr int fail_step = 3;
  using selector_t = std::conditional_t<std::is_same_v<X, dense_allreduce>, randomk, topk>;
  auto make = [](in_process_comm& comm) {
    sgd_options opt;
    opt.lr = 0.1;
    opt.seed = 5;
    return sgd_with<X, selector_t>(comm, layers, {}, {}, opt, density_schedule::constant(0.05));
  };
  auto grad = [](int rank, int step) {
    auto g = gradient<float>(total, static_cast<std::uint64_t>(100 * step + rank));
    if (rank == failing && step == fail_step) g[total - 1] = std::numeric_limits<float>::quiet_NaN();
    return g;
  };
  const auto start = std::chrono::steady_clock::now();
  auto [seen, thrown] = train(make, grad, 6);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  CAPTURE(thrown);
  CHECK(contains(thrown, "nonfinite_error"));  // the original, not a consequence
  CHECK(seconds < 10.0);
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    const auto& o = seen[static_cast<std::size_t>(r)];
    CAPTURE(o.what);
    if (r == failing) {
      CHECK(o.error == "nonfinite_error");
      CHECK(contains(o.what, "tensor 2"));
    } else {
      CHECK(o.error == "communicator_error");
      CHECK(contains(o.what, "rank 2 failed"));
      CHECK(contains(o.what, "nonfinite"));
    }
    CHECK(o.steps_done == fail_step);
    CHECK(o.params_at_end == o.params_before_failure);
  }
  // Every rank applied the same updates until the failure.
  for (int r = 1; r < ranks; ++r) {
    CHECK(seen[static_cast<std::size_t>(r)].params_at_end == seen[0].params_at_end);
  }
}

TEST_CASE_TEMPLATE("rank failure: a policy that throws in the second tensor of a step fails every "
                   "rank, parameters untouched",
                   X, sparse_allgather) {
  constexpr int failing = 1;
  auto make = [](in_process_comm& comm) {
    failing_selector s;
    s.rank = comm.rank();
    s.fail_rank = failing;
    s.fail_step = 2;
    s.fail_tensor = 1;  // tensor 0 of step 2 has been exchanged by everyone already
    using C = compressor<failing_selector, identity, residual>;
    return sparsified_sgd<C, X, in_process_comm>(comm, layers, C(s), {}, sgd_options{},
                                                  density_schedule::constant(0.05));
  };
  auto grad = [](int rank, int step) {
    return gradient<float>(total, static_cast<std::uint64_t>(100 * step + rank));
  };
  auto [seen, thrown] = train(make, grad, 5);
  CAPTURE(thrown);
  CHECK(contains(thrown, "runtime_error: failing_selector: injected failure"));
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    const auto& o = seen[static_cast<std::size_t>(r)];
    CAPTURE(o.what);
    CHECK(o.error == (r == failing ? "runtime_error" : "communicator_error"));
    if (r != failing) CHECK(contains(o.what, "rank 1 failed: failing_selector: injected failure"));
    CHECK(o.steps_done == 2);
    CHECK(o.params_at_end == o.params_before_failure);
  }
}

TEST_CASE("rank failure: a rank that stops stepping early makes the others fail, not hang") {
  auto make = [](in_process_comm& comm) {
    return sgd_with<sparse_allgather>(comm, layers, {}, {}, sgd_options{},
                                      density_schedule::constant(0.05));
  };
  std::vector<std::string> what(ranks);
  std::string thrown = "nothing";
  within_deadline([&] {
    try {
      run_in_process(ranks, [&](in_process_comm& comm) {
        auto sgd = make(comm);
        std::vector<float> params(total, 0.0f);
        const int steps = comm.rank() == 0 ? 2 : 4;  // rank 0 leaves after two steps
        try {
          for (int s = 0; s < steps; ++s) {
            sgd.step(params, gradient<float>(total, static_cast<std::uint64_t>(s)));
          }
        } catch (const communicator_error& e) {
          what[static_cast<std::size_t>(comm.rank())] = e.what();
          throw;
        }
      });
    } catch (const communicator_error& e) {
      thrown = e.what();
    }
  });
  CHECK(contains(thrown, "rank 0 returned"));
  CHECK(what[0].empty());
  for (int r = 1; r < ranks; ++r) CHECK(contains(what[static_cast<std::size_t>(r)], "rank 0 returned"));
}

TEST_CASE("rank failure: ranks set up with different tensor sizes all fail, none hangs") {
  auto make = [](in_process_comm& comm) {
    // Same total, but rank 3 splits it differently: its payloads do not fit the others.
    const std::vector<std::size_t> mine =
        comm.rank() == 3 ? std::vector<std::size_t>{301, 49, 700} : layers;
    return sgd_with<sparse_allgather>(comm, mine, {}, {}, sgd_options{},
                                      density_schedule::constant(0.05));
  };
  auto grad = [](int rank, int step) {
    return gradient<float>(total, static_cast<std::uint64_t>(100 * step + rank));
  };
  auto [seen, thrown] = train(make, grad, 3);
  CAPTURE(thrown);
  CHECK(contains(thrown, "communicator_error"));
  for (const auto& o : seen) {
    CAPTURE(o.what);
    CHECK(o.error == "communicator_error");
    CHECK(o.steps_done == 0);
    CHECK(o.params_at_end == o.params_before_failure);
  }
}
