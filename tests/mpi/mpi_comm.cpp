// mpi_comm under mpiexec -n 1..4, against sequential references that every rank computes from
// all ranks' (seeded) inputs: the rank-order allreduce is bit for bit the fold in rank order,
// the native one the same on every rank and within rounding of it; the variable-size
// collectives, broadcast, sendrecv and the non-blocking forms; bad arguments.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/detail/exchange_common.hpp>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/exchange/cost_model.hpp>

#include "../support/comm_properties.hpp"

namespace {

using namespace gradcomp;
using gradcomp_test::comm_properties::check_rank_order;
using gradcomp_test::comm_properties::input;
using gradcomp_test::comm_properties::rank_order_all_ops;
using gradcomp_test::comm_properties::same_bytes;

}  // namespace

TEST_CASE("mpi_comm models the communicator concept and offers point to point") {
  static_assert(communicator<mpi_comm>);
  static_assert(point_to_point<mpi_comm, std::byte>);
  mpi_comm comm;
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CHECK(comm.size() == size);
  CHECK(comm.native() != MPI_COMM_WORLD);  // a duplicate: our messages never match the user's
}

TEST_CASE("rank-order allreduce is the sequential fold over ranks, bit for bit") {
  mpi_comm comm;
  gradcomp_test::comm_properties::rank_order_allreduce(comm);
  SUBCASE("chunked: small rounds change nothing") {
    mpi_comm chunked(MPI_COMM_WORLD, mpi_options{.chunk_elements = 7});
    rank_order_all_ops<float>(chunked, 6);
    rank_order_all_ops<half>(chunked, 7);
  }
}

TEST_CASE("native allreduce: the same on every rank, within rounding of the rank-order sum") {
  mpi_comm comm(MPI_COMM_WORLD, mpi_options{.reduction = mpi_reduction::native});
  mpi_comm exact;
  const std::size_t n = 4099;
  SUBCASE("float sum") {
    auto data = input<float>(comm.rank(), n, 11);
    comm.allreduce(std::span<float>(data), reduce_op::sum);
    std::vector<float> all;
    std::vector<std::size_t> counts;
    exact.allgatherv(std::span<const float>(data), all, counts);  // every rank's result
    for (int r = 0; r < comm.size(); ++r) {
      CHECK(std::memcmp(all.data() + static_cast<std::size_t>(r) * n, data.data(), n * sizeof(float)) == 0);
    }
    std::vector<double> sum(n, 0.0), mag(n, 0.0);
    for (int r = 0; r < comm.size(); ++r) {
      const auto x = input<float>(r, n, 11);
      for (std::size_t i = 0; i < n; ++i) {
        sum[i] += x[i];
        mag[i] += std::fabs(x[i]);
      }
    }
    std::size_t off = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (std::fabs(data[i] - sum[i]) > 1e-6 * mag[i] + 1e-30) ++off;
    }
    CHECK(off == 0);
  }
  SUBCASE("max, min and integer sums are exact") {
    check_rank_order<std::int64_t>(comm, n, reduce_op::sum, 12);
    check_rank_order<double>(comm, n, reduce_op::max, 13);
    check_rank_order<float>(comm, n, reduce_op::min, 14);
  }
  SUBCASE("half and bfloat16 through user-defined MPI ops") {
    // max takes one of the inputs, so it is exact; a bfloat16 sum in MPI's order is within a
    // few roundings (2^-9 relative each) of the float sum.
    auto h = input<half>(comm.rank(), n, 15);
    comm.allreduce(std::span<half>(h), reduce_op::max);
    auto want = input<half>(0, n, 15);
    for (int r = 1; r < comm.size(); ++r) {
      const auto x = input<half>(r, n, 15);
      detail::combine(want.data(), x.data(), n, reduce_op::max);
    }
    CHECK(same_bytes(h, want));
    auto b = input<bfloat16>(comm.rank(), n, 16);
    comm.allreduce(std::span<bfloat16>(b), reduce_op::sum);
    std::vector<float> sum(n, 0.0f);
    for (int r = 0; r < comm.size(); ++r) {
      const auto x = input<bfloat16>(r, n, 16);
      for (std::size_t i = 0; i < n; ++i) sum[i] += static_cast<float>(x[i]);
    }
    std::size_t off = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (std::fabs(static_cast<float>(b[i]) - sum[i]) > 0.25f + 0.02f * std::fabs(sum[i])) ++off;
    }
    CHECK(off == 0);
  }
}

TEST_CASE("allgatherv, allgather, alltoallv, broadcast and barrier") {
  mpi_comm comm;
  gradcomp_test::comm_properties::variable_collectives(comm);
}

TEST_CASE("non-blocking collectives overlap with computation and complete in any order") {
  mpi_comm comm;
  const int me = comm.rank(), p = comm.size();
  auto a = input<float>(me, 50000, 31);
  auto b = input<half>(me, 999, 32);
  const auto send = input<double>(me, static_cast<std::size_t>(me + 1), 33);
  std::vector<double> gathered;
  std::vector<std::size_t> counts;
  mpi_request ra = comm.iallreduce(std::span<float>(a), reduce_op::sum);
  mpi_request rb = comm.iallreduce(std::span<half>(b), reduce_op::min);
  mpi_request rg = comm.iallgatherv<double>(send, gathered, counts);
  mpi_request rbar = comm.ibarrier();
  // Computation while the collectives progress (driven by test()).
  double busy = 0.0;
  int polls = 0;
  while (!(ra.test() & rb.test() & rg.test() & rbar.test())) {
    for (int i = 0; i < 1000; ++i) busy += std::sqrt(static_cast<double>(i + polls));
    ++polls;
  }
  CHECK(busy >= 0.0);
  CHECK(ra.done());
  rg.wait();  // already done: a no-op
  auto want_a = input<float>(0, 50000, 31);
  auto want_b = input<half>(0, 999, 32);
  for (int r = 1; r < p; ++r) {
    const auto xa = input<float>(r, 50000, 31);
    const auto xb = input<half>(r, 999, 32);
    detail::combine(want_a.data(), xa.data(), want_a.size(), reduce_op::sum);
    detail::combine(want_b.data(), xb.data(), want_b.size(), reduce_op::min);
  }
  CHECK(same_bytes(a, want_a));
  CHECK(same_bytes(b, want_b));
  CHECK(gathered.size() == static_cast<std::size_t>(p * (p + 1) / 2));

  // A request destroyed before completion is waited for, not abandoned.
  auto c = input<double>(me, 100, 34);
  { mpi_request rc = comm.iallreduce(std::span<double>(c), reduce_op::max); }
  auto want_c = input<double>(0, 100, 34);
  for (int r = 1; r < p; ++r) {
    const auto x = input<double>(r, 100, 34);
    detail::combine(want_c.data(), x.data(), 100, reduce_op::max);
  }
  CHECK(same_bytes(c, want_c));
  auto d = input<float>(me, 10, 35);
  mpi_request moved = comm.ibroadcast(std::span<float>(d), 0);
  mpi_request other = std::move(moved);
  other.wait();
  CHECK(same_bytes(d, input<float>(0, 10, 35)));
}

TEST_CASE("rank-order allreduce: scratch kept between calls, of any size, type and overlap") {
  // The scratch buffers are reused: sizes that grow and shrink, types in turn, two requests of
  // one type in flight at once, chunked and not; every result the fold in rank order.
  int me = 0, p = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  auto fold = [&](auto zero, std::size_t n, std::uint64_t seed, reduce_op op) {
    using T = decltype(zero);
    auto want = input<T>(0, n, seed);
    for (int r = 1; r < p; ++r) {
      const auto x = input<T>(r, n, seed);
      detail::combine(want.data(), x.data(), n, op);
    }
    return want;
  };
  for (std::size_t chunk : {std::size_t{1} << 24, std::size_t{1000}}) {
    CAPTURE(chunk);
    mpi_comm comm(MPI_COMM_WORLD, mpi_options{.chunk_elements = chunk});
    std::uint64_t seed = 40;
    for (std::size_t n : {std::size_t{5000}, std::size_t{1}, std::size_t{0}, std::size_t{70001},
                          std::size_t{333}, std::size_t{70001}}) {
      CAPTURE(n);
      auto a = input<float>(me, n, ++seed);
      comm.allreduce(std::span<float>(a), reduce_op::sum);
      CHECK(same_bytes(a, fold(0.0f, n, seed, reduce_op::sum)));
      auto b = input<double>(me, n + 3, ++seed);
      comm.allreduce(std::span<double>(b), reduce_op::max);
      CHECK(same_bytes(b, fold(0.0, n + 3, seed, reduce_op::max)));
    }
    auto x = input<float>(me, 9000, 50);
    auto y = input<float>(me, 12000, 51);
    mpi_request rx = comm.iallreduce(std::span<float>(x), reduce_op::sum);
    mpi_request ry = comm.iallreduce(std::span<float>(y), reduce_op::min);
    ry.wait();
    rx.wait();
    CHECK(same_bytes(x, fold(0.0f, 9000, 50, reduce_op::sum)));
    CHECK(same_bytes(y, fold(0.0f, 12000, 51, reduce_op::min)));
  }
}

TEST_CASE("bad arguments throw invalid_argument before any message") {
  mpi_comm comm;
  gradcomp_test::comm_properties::bad_arguments(comm);
  CHECK_THROWS_AS(mpi_comm(MPI_COMM_WORLD, mpi_options{.chunk_elements = 0}), invalid_argument);
  comm.barrier();
}

TEST_CASE("measure_link: a ping-pong between rank 0 and the last rank, agreed everywhere") {
  mpi_comm comm;
  link_probe probe;
  probe.ring_beta = -1.0;  // overwritten on every rank count
  const link_model l = measure_link(
      comm,
      link_measure_options{.small_repeats = 10, .large_repeats = 3,
                           .local_elements = std::size_t{1} << 18,
                           .local_large_elements = std::size_t{1} << 21,
                           .ring_max_bytes = std::size_t{4} << 20},
      &probe);
  double mine[3] = {l.alpha, l.beta, l.burst_bytes};
  std::vector<double> all;
  std::vector<std::size_t> counts;
  comm.allgatherv(std::span<const double>(mine), all, counts);
  for (int r = 0; r < comm.size(); ++r) {
    CHECK(all[3 * static_cast<std::size_t>(r)] == l.alpha);
    CHECK(all[3 * static_cast<std::size_t>(r) + 1] == l.beta);
    CHECK(all[3 * static_cast<std::size_t>(r) + 2] == l.burst_bytes);
  }
  // The burst: within what its ping-pongs sent, 0 for one rank.
  CHECK(l.burst_bytes >= 0.0);
  CHECK(l.burst_bytes <= static_cast<double>(link_measure_options{}.burst_max_bytes));
  if (comm.size() == 1) CHECK(l.burst_bytes == 0.0);
  // The model takes the larger of the ping-pong's and the ring's values; the local work's
  // costs are measured.
  CHECK(l.alpha == std::max(probe.pingpong_alpha, probe.ring_alpha));
  CHECK(l.beta == std::max(probe.pingpong_beta, probe.ring_beta));
  CHECK(l.pair_alpha == probe.pingpong_alpha);
  CHECK(l.pair_beta == probe.pingpong_beta);
  CHECK(l.gamma > 0.0);
  CHECK(l.scatter > 0.0);
  CHECK(l.merge + l.merge_log > 0.0);
  CHECK(l.gamma_large > 0.0);
  CHECK(l.scatter_large > 0.0);
  CHECK(l.large_elements == std::size_t{1} << 21);
  if (comm.size() > 1) {
    CHECK(probe.pingpong_alpha > 0.0);
    CHECK(probe.ring_alpha > 0.0);
    CHECK(probe.ring_beta > 0.0);  // every rank sending 4 MiB at most: not free
    CHECK(probe.ring_beta < 1e-7);
    CHECK(l.alpha > 0.0);
    CHECK(l.alpha < 0.05);  // shared memory on one machine: microseconds, ms if oversubscribed
    CHECK(l.beta < 1e-7);   // more than 10 MB/s
    // The allreduce timed on the ring's largest message (1 MiB grown 4x while quick, at most
    // 4 MiB), not free, and the model's dense_beta.
    CHECK((probe.allreduce_bytes == std::size_t{1} << 20 || probe.allreduce_bytes == std::size_t{4} << 20));
    CHECK(l.dense_beta == probe.allreduce_beta);
    CHECK(l.dense_beta > 0.0);
    CHECK(l.dense_beta < 1e-7);
  } else {
    CHECK(l.alpha == 0.0);
    CHECK(probe.ring_beta == 0.0);  // no link: the probe is zeroed
    CHECK(probe.allreduce_bytes == 0);
    CHECK(l.dense_beta == 0.0);
  }
  if (comm.rank() == 0) {
    MESSAGE("P=" << comm.size() << ": alpha = " << l.alpha * 1e6 << " us, beta = " << l.beta * 1e9
                 << " ns/byte (" << (l.beta > 0 ? 1e-9 / l.beta : 0.0) << " GB/s), burst = "
                 << l.burst_bytes << " bytes");
  }
  // Without the burst's ping-pongs: 0, and the rest still measured.
  const link_model off = measure_link(
      comm, link_measure_options{.small_repeats = 3, .large_repeats = 2,
                                 .local_elements = std::size_t{1} << 14, .local_large_elements = 0,
                                 .burst_max_bytes = 0});
  CHECK(off.burst_bytes == 0.0);
  if (comm.size() > 1) CHECK(off.pair_beta > 0.0);
}
