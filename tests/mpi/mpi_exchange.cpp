// Every exchange over mpi_comm under mpiexec -n 1..4: each rank's output equals the
// single-process reference built from all P payloads, bit for bit (mpi_comm's default
// rank-order reduction); a P-rank MPI training run equals the P-thread in-process one; and a
// rank that passes another tensor size makes every rank throw, with no hang.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/exchange.hpp>
#include <gradcomp/feedback.hpp>
#include <gradcomp/quantize.hpp>
#include <gradcomp/select.hpp>
#include <gradcomp/step.hpp>

#include "../support/exchange_properties.hpp"

namespace {

using namespace gradcomp;
namespace gt = gradcomp_test;
namespace props = gradcomp_test::exchange_properties;

}  // namespace

TEST_CASE("every exchange over MPI equals the single-process reference") {
  mpi_comm comm;
  props::every_exchange_equals_reference(comm);
}

TEST_CASE("a P-rank MPI run of sparsified_sgd equals the P-thread in-process run") {
  mpi_comm comm;
  props::training_equals_in_process(comm);
}

TEST_CASE("auto_exchange over MPI: measured link, the same choice on every rank") {
  mpi_comm comm;
  using S = compressor<topk, identity, residual>;
  auto_options o;
  o.measure = link_measure_options{.small_repeats = 5, .large_repeats = 2};
  sparsified_sgd<S, auto_exchange, mpi_comm> sgd(comm, {20000, 100}, {}, auto_exchange(o),
                                                 sgd_options{.lr = 0.01}, density_schedule::constant(0.01));
  std::vector<float> params(sgd.size(), 0.0f);
  const auto g = gt::make_input<float>(gt::dist::normal, sgd.size(), static_cast<std::uint64_t>(comm.rank()));
  const step_stats& s = sgd.step(params, g);
  std::vector<std::uint32_t> mine;
  for (const auto& t : s.tensors) mine.push_back(static_cast<std::uint32_t>(t.exchange.size() * 16 + t.exchange[0]));
  std::vector<std::uint32_t> all;
  std::vector<std::size_t> counts;
  comm.allgatherv(std::span<const std::uint32_t>(mine), all, counts);
  for (std::size_t i = 0; i < all.size(); ++i) CHECK(all[i] == mine[i % mine.size()]);
  if (comm.rank() == 0) {
    for (const auto& t : s.tensors) {
      MESSAGE("P=" << comm.size() << " n=" << t.n << ": chose " << std::string(t.exchange) << ", predicted "
                   << t.predicted_seconds * 1e6 << " us, measured " << t.exchange_seconds * 1e6 << " us");
    }
  }
}

TEST_CASE("a rank with another tensor size makes every rank throw, none hangs") {
  mpi_comm comm;
  props::disagreeing_size_throws_everywhere(comm);
}
