// Faults under MPI, where a rank cannot abort a collective for the others: run with
// mpiexec -n 2 and 4.
//  - Transactions: every rank's communicator throws at the same call N of a step (a fault
//    every rank sees, as a lost connection would), for every N the step reaches and every
//    driver: all ranks throw, their state is what it was before the step bit for bit, the job
//    goes on, and the retried step gives exactly the unfaulted result.
//  - Corruption in transit: one rank's message in call N of an exchange is corrupted (see
//    tests/support/fault_comm.hpp): whenever a rank can tell, every rank throws, and none hangs.
//  - mpi_comm's own edges: a failure inside sendrecv after the send was posted, or after the
//    incoming message was matched, leaves no request or message behind; and a rank that posts
//    a non-blocking collective and then waits on a peer does not deadlock.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/sparsified_sgd.hpp>

#include "../support/driver_cases.hpp"
#include "../support/fault_comm.hpp"

namespace {

using namespace gradcomp;
using gradcomp_test::fault_comm;
using gradcomp_test::fault_effect;
using gradcomp_test::fault_kind;
using comm_t = fault_comm<mpi_comm>;
namespace drv = gradcomp_test::drivers;
using driver_case = drv::driver_case<comm_t>;

constexpr int warmup_steps = 2;

// Whether every rank / any rank says yes (over MPI_COMM_WORLD, outside gradcomp).
bool all_ranks(bool mine) {
  int v = mine ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return v == 1;
}
bool any_rank(bool mine) {
  int v = mine ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return v == 1;
}

struct rank_setup {
  std::unique_ptr<mpi_comm> mpi;
  std::unique_ptr<comm_t> comm;
  std::shared_ptr<void> driver;
  std::vector<float> params;
};

rank_setup warmed_up(const driver_case& d) {
  rank_setup s;
  s.mpi = std::make_unique<mpi_comm>();
  s.comm = std::make_unique<comm_t>(*s.mpi);
  s.driver = d.make(*s.comm);
  s.params = gradcomp::reliability::gradient<float>(drv::total, 77);
  for (int step = 0; step < warmup_steps; ++step) {
    d.step(s.driver.get(), s.params, s.mpi->rank(), step);
  }
  return s;
}

drv::rank_state state_of(const driver_case& d, rank_setup& s) {
  drv::rank_state st;
  st.params = gradcomp::reliability::bytes_of(std::span<const float>(s.params));
  st.checkpoint = d.checkpoint(s.driver.get());
  st.steps = d.steps(s.driver.get());
  return st;
}

}  // namespace

TEST_CASE("MPI transactions: a fault at any collective on every rank changes nothing, and the "
          "retry gives the unfaulted result") {
  for (const driver_case& d : drv::all_cases<comm_t>()) {
    CAPTURE(d.name);
    rank_setup reference = warmed_up(d);
    const int rank = reference.mpi->rank();
    reference.comm->disarm();
    d.step(reference.driver.get(), reference.params, rank, warmup_steps);
    const std::size_t calls = reference.comm->calls();
    const drv::rank_state expected = state_of(d, reference);
    REQUIRE(all_ranks(calls > 0));

    for (std::size_t at = 0; at < calls; ++at) {
      CAPTURE(at);
      rank_setup s = warmed_up(d);
      const drv::rank_state before = state_of(d, s);
      s.comm->arm(fault_kind::throw_before, at);
      bool threw = false;
      try {
        d.step(s.driver.get(), s.params, rank, warmup_steps);
      } catch (const std::exception&) {
        threw = true;
      }
      CHECK(s.comm->effect() == fault_effect::thrown);
      CHECK(all_ranks(threw));
      CHECK(state_of(d, s) == before);
      s.comm->disarm();
      d.step(s.driver.get(), s.params, rank, warmup_steps);
      CHECK(state_of(d, s) == expected);
      CHECK(all_ranks(true));  // every rank got here: nothing hangs
    }
  }
}

TEST_CASE("MPI corruption in transit: one rank's corrupted message fails the exchange on every "
          "rank, or on none, and never hangs") {
  const sgd_options opt{.lr = 0.05, .seed = 3};
  using topk_res = compressor<topk, identity, residual>;
  const std::vector<driver_case> cases = {
      drv::sgd_case<comm_t>("sparse_allgather", topk_res{}, sparse_allgather{}, opt),
      drv::sgd_case<comm_t>("dense_allreduce", compressor<randomk, identity, residual>{},
                            dense_allreduce{}, opt),
      drv::sgd_case<comm_t>("gtopk (tree)", topk_res{}, gtopk{}, opt),
      drv::sgd_case<comm_t>("gtopk (exact)", topk_res{}, gtopk(gtopk_values::exact), opt),
      drv::sgd_case<comm_t>("topk_a2a", topk_res{}, topk_a2a{}, opt),
      drv::sgd_case<comm_t>("auto_exchange choosing gtopk", topk_res{},
                            drv::fixed_auto(exchange_bit(exchange_kind::gtopk)), opt),
      drv::sgd_case<comm_t>("auto_exchange choosing topk_a2a", topk_res{},
                            drv::fixed_auto(exchange_bit(exchange_kind::topk_a2a)), opt),
  };
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::size_t detected = 0;
  for (const driver_case& d : cases) {
    for (const int corrupter : {0, size - 1}) {
      CAPTURE(d.name);
      CAPTURE(corrupter);
      rank_setup probe = warmed_up(d);
      const int rank = probe.mpi->rank();
      probe.comm->disarm();
      d.step(probe.driver.get(), probe.params, rank, warmup_steps);
      std::size_t calls = probe.comm->calls();
      MPI_Bcast(&calls, sizeof calls, MPI_BYTE, corrupter, MPI_COMM_WORLD);
      for (std::size_t at = 0; at < calls; ++at) {
        CAPTURE(at);
        rank_setup s = warmed_up(d);
        const drv::rank_state before = state_of(d, s);
        if (rank == corrupter) s.comm->arm(fault_kind::corrupt, at);
        bool threw = false;
        try {
          d.step(s.driver.get(), s.params, rank, warmup_steps);
        } catch (const std::exception&) {
          threw = true;
        }
        // Whether the corrupted message was one a receiver can check.
        const bool structural = any_rank(rank == corrupter && s.comm->effect() == fault_effect::corrupted);
        if (structural) {
          CHECK(all_ranks(threw));
          ++detected;
        } else {
          CHECK(all_ranks(!threw));
        }
        if (threw) CHECK(state_of(d, s) == before);  // and a failed step changed nothing
        s.comm->disarm();
      }
    }
  }
  if (size > 1) CHECK(detected > 0);
}

TEST_CASE("mpi_comm::sendrecv: a failure after the send was posted waits for the send before the "
          "buffer goes") {
  mpi_comm comm;
  if (comm.size() < 2) return;
  const int r = comm.rank();
  // 4 MiB: past the eager limit, so the receiver reads the sender's buffer while it lies there.
  const std::size_t n = std::size_t{1} << 20;
  if (r == 0) {
    {
      std::vector<float> buffer(n);
      for (std::size_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(i);
      detail::fault_hook() = [](std::string_view where) {
        if (where == "mpi_comm::sendrecv: send posted") throw std::runtime_error("injected");
      };
      std::vector<float> none;
      CHECK_THROWS_AS(comm.sendrecv(std::span<const float>(buffer), 1, none, -1), std::runtime_error);
      detail::fault_hook() = nullptr;
      // Had the send still been pending, rank 1 would read this instead of 0, 1, 2, ...
      std::fill(buffer.begin(), buffer.end(), -1.0f);
    }
  } else if (r == 1) {
    std::vector<float> got;
    comm.sendrecv(std::span<const float>(), -1, got, 0);
    REQUIRE(got.size() == n);
    bool intact = true;
    for (std::size_t i = 0; i < n; ++i) intact = intact && got[i] == static_cast<float>(i);
    CHECK(intact);
  }
  comm.barrier();
}

TEST_CASE("mpi_comm::sendrecv: a failure before the incoming message is received leaves it whole "
          "for a later receive, and its sender is not left waiting") {
  mpi_comm comm;
  if (comm.size() < 2) return;
  const int r = comm.rank();
  const std::size_t n = std::size_t{1} << 20;
  if (r == 0) {
    std::vector<float> buffer(n);
    for (std::size_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(i % 1000) + 0.5f;
    std::vector<float> none;
    comm.sendrecv(std::span<const float>(buffer), 1, none, -1);  // returns once it is received
  } else if (r == 1) {
    detail::fault_hook() = [](std::string_view where) {
      if (where == "mpi_comm::sendrecv: size known") throw std::runtime_error("injected");
    };
    std::vector<float> got;
    CHECK_THROWS_AS(comm.sendrecv(std::span<const float>(), -1, got, 0), std::runtime_error);
    detail::fault_hook() = nullptr;
    comm.sendrecv(std::span<const float>(), -1, got, 0);  // the retry gets the whole message
    REQUIRE(got.size() == n);
    bool intact = true;
    for (std::size_t i = 0; i < n; ++i) intact = intact && got[i] == static_cast<float>(i % 1000) + 0.5f;
    CHECK(intact);
  }
  comm.barrier();
}

TEST_CASE("mpi_comm: a rank that posts a non-blocking collective and then waits on a peer does not "
          "deadlock (the communicators were duplicated up front)") {
  mpi_comm comm;  // fresh: its request communicators have never been used
  if (comm.size() < 2) return;
  const int r = comm.rank();
  std::vector<float> sum = {1.0f};
  std::vector<int> token;
  const int one[] = {42};
  if (r == 0) {
    // Posts first, then sends to rank 1, which waits for that before it posts.
    auto request = comm.iallreduce(std::span<float>(sum), reduce_op::sum);
    comm.sendrecv(std::span<const int>(one), 1, token, -1);
    request.wait();
  } else {
    if (r == 1) comm.sendrecv(std::span<const int>(), -1, token, 0);
    auto request = comm.iallreduce(std::span<float>(sum), reduce_op::sum);
    request.wait();
  }
  CHECK(sum[0] == static_cast<float>(comm.size()));
  if (r == 1) CHECK(token == std::vector<int>{42});
}
