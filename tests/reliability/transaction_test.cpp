// A failed step changes nothing: fault injection into every collective a step makes.
//
// For every driver (sparsified_sgd with every exchange, layerwise_sgd, periodic_averaging),
// P = 2 and 4 in-process ranks, and every call N that one step makes on a rank, that rank's
// communicator throws at its N-th call (and fails the in-process world, as a rank that dies
// would). Then every rank must have thrown, and its state (parameters, velocity, every
// feedback buffer, the step counter: the driver's checkpoint bytes) must equal its state
// before the step bit for bit; re-running the step without the fault on a fresh world must
// give exactly what an unfaulted run gives.
// ctest-labels: threads
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/schedule.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/sparsified_sgd.hpp>

#include "support.hpp"
#include "../support/driver_cases.hpp"
#include "../support/fault_comm.hpp"

namespace {

using namespace gradcomp;
using gradcomp_test::fault_comm;
using gradcomp_test::fault_kind;
using comm_t = fault_comm<in_process_comm>;
using driver_case = gradcomp_test::drivers::driver_case<comm_t>;
using gradcomp_test::drivers::gradient_of;
using gradcomp_test::drivers::total;
using gradcomp_test::drivers::rank_state;

// Runs body(rank, comm) on P threads over a fresh world. A rank that throws keeps its exception
// (returned) and fails the world, so that the others stop waiting for it.
template <class Body>
std::vector<std::exception_ptr> run_world(int P, Body&& body) {
  in_process_world world(P);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(P));
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      in_process_comm comm = world.comm(r);
      try {
        body(r, comm, world);
        world.rank_done(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        world.abort(r, "failed");
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

bool all_threw(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors) {
    if (!e) return false;
  }
  return true;
}
bool none_threw(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors) {
    if (e) return false;
  }
  return true;
}

constexpr int warmup_steps = 2;

// P drivers with their communicators and parameters, after warmup_steps unfaulted steps.
struct ranks_t {
  std::vector<std::unique_ptr<comm_t>> comms;
  std::vector<std::shared_ptr<void>> drivers;
  std::vector<std::vector<float>> params;
};

ranks_t warmed_up(const driver_case& d, int P) {
  ranks_t rk;
  in_process_world first(P);  // the drivers' constructors need a communicator to point at
  std::vector<in_process_comm> handles;
  for (int r = 0; r < P; ++r) handles.push_back(first.comm(r));
  for (int r = 0; r < P; ++r) {
    rk.comms.push_back(std::make_unique<comm_t>(handles[static_cast<std::size_t>(r)]));
    rk.drivers.push_back(d.make(*rk.comms.back()));
    rk.params.push_back(reliability::gradient<float>(total, 77));  // the same on every rank
  }
  for (int step = 0; step < warmup_steps; ++step) {
    const auto errors = run_world(P, [&](int r, in_process_comm& comm, in_process_world&) {
      rk.comms[static_cast<std::size_t>(r)]->rebind(comm);
      d.step(rk.drivers[static_cast<std::size_t>(r)].get(), rk.params[static_cast<std::size_t>(r)], r,
             step);
    });
    REQUIRE(none_threw(errors));
  }
  return rk;
}

rank_state state_of(const driver_case& d, ranks_t& rk, int r) {
  rank_state s;
  const auto& p = rk.params[static_cast<std::size_t>(r)];
  s.params = reliability::bytes_of(std::span<const float>(p));
  s.checkpoint = d.checkpoint(rk.drivers[static_cast<std::size_t>(r)].get());
  s.steps = d.steps(rk.drivers[static_cast<std::size_t>(r)].get());
  return s;
}

// One step on a fresh world; rank `faulty` (if >= 0) fails at its call number `at`. Returns
// each rank's exception, and the calls each rank made (when nothing was armed).
std::vector<std::exception_ptr> one_step(const driver_case& d, ranks_t& rk, int P, int faulty,
                                         std::size_t at, std::vector<std::size_t>* calls = nullptr,
                                         gradcomp_test::fault_effect* effect = nullptr) {
  auto errors = run_world(P, [&](int r, in_process_comm& comm, in_process_world& world) {
    comm_t& c = *rk.comms[static_cast<std::size_t>(r)];
    c.rebind(comm);
    c.on_throw = [&world, r](std::string_view what) { world.abort(r, what); };
    if (r == faulty) {
      c.arm(fault_kind::throw_before, at);
    } else {
      c.disarm();
    }
    d.step(rk.drivers[static_cast<std::size_t>(r)].get(), rk.params[static_cast<std::size_t>(r)], r,
           warmup_steps);
  });
  if (calls) {
    calls->clear();
    for (auto& c : rk.comms) calls->push_back(c->calls());
  }
  if (effect && faulty >= 0) *effect = rk.comms[static_cast<std::size_t>(faulty)]->effect();
  for (auto& c : rk.comms) c->disarm();
  return errors;
}

}  // namespace

TEST_CASE("transactions: a step that fails at any collective on one rank changes nothing on any "
          "rank, and its retry gives the unfaulted result") {
  for (const driver_case& d : gradcomp_test::drivers::all_cases<comm_t>()) {
    for (const int P : {2, 4}) {
      CAPTURE(d.name);
      CAPTURE(P);
      // The unfaulted step: its result, and the calls it makes on each rank.
      ranks_t reference = warmed_up(d, P);
      std::vector<std::size_t> calls;
      REQUIRE(none_threw(one_step(d, reference, P, -1, 0, &calls)));
      std::vector<rank_state> expected;
      for (int r = 0; r < P; ++r) expected.push_back(state_of(d, reference, r));
      REQUIRE(calls[0] > 0);

      std::size_t faults = 0;
      for (const int faulty : {0, P - 1}) {
        for (std::size_t at = 0; at < calls[static_cast<std::size_t>(faulty)]; ++at) {
          CAPTURE(faulty);
          CAPTURE(at);
          ranks_t rk = warmed_up(d, P);
          std::vector<rank_state> before;
          for (int r = 0; r < P; ++r) before.push_back(state_of(d, rk, r));

          gradcomp_test::fault_effect effect{};
          const auto errors = one_step(d, rk, P, faulty, at, nullptr, &effect);
          REQUIRE(effect == gradcomp_test::fault_effect::thrown);
          REQUIRE(all_threw(errors));
          for (int r = 0; r < P; ++r) {
            CAPTURE(r);
            CHECK(state_of(d, rk, r) == before[static_cast<std::size_t>(r)]);
          }

          REQUIRE(none_threw(one_step(d, rk, P, -1, 0)));
          for (int r = 0; r < P; ++r) {
            CAPTURE(r);
            CHECK(state_of(d, rk, r) == expected[static_cast<std::size_t>(r)]);
          }
          ++faults;
        }
      }
      CHECK(faults >= 2);
    }
  }
}

TEST_CASE("transactions: a bad gradient or a refused argument changes nothing either") {
  for (const driver_case& d : gradcomp_test::drivers::all_cases<comm_t>()) {
    CAPTURE(d.name);
    const int P = 2;
    ranks_t rk = warmed_up(d, P);
    std::vector<rank_state> before;
    for (int r = 0; r < P; ++r) before.push_back(state_of(d, rk, r));
    // One rank's parameters of the wrong size: it refuses before any collective, and the other
    // rank, left waiting in the first collective, fails when the world does.
    const auto errors = run_world(P, [&](int r, in_process_comm& comm, in_process_world&) {
      rk.comms[static_cast<std::size_t>(r)]->rebind(comm);
      std::vector<float>& params = rk.params[static_cast<std::size_t>(r)];
      if (r == 1) {
        std::vector<float> wrong(params.size() + 1);
        d.step(rk.drivers[1].get(), wrong, r, warmup_steps);
      } else {
        d.step(rk.drivers[0].get(), params, r, warmup_steps);
      }
    });
    CHECK(all_threw(errors));
    for (int r = 0; r < P; ++r) CHECK(state_of(d, rk, r) == before[static_cast<std::size_t>(r)]);
  }
}
