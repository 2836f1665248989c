// Properties every gradcomp communicator must have, checked against sequential references
// that every rank computes from all ranks' (seeded) inputs: allreduce is the rank-order fold,
// bit for bit; the variable-size collectives, with zero-sized contributions on some or all
// ranks; broadcast from every root; sendrecv where the communicator offers it; bad arguments.
// Shared by the MPI tests (tests/mpi/mpi_comm.cpp) and the torch.distributed process-group
// tests (tests/torch/process_group_comm.cpp), so both communicators pass the same checks.
// Every rank must call each function, in the same order.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <gradcomp/comm/in_process.hpp>
#include <gradcomp/concepts.hpp>
#include <gradcomp/detail/exchange_common.hpp>
#include <gradcomp/detail/float16.hpp>
#include <gradcomp/error.hpp>

namespace gradcomp_test::comm_properties {

using namespace gradcomp;

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Rank r's input for a collective: the same on every rank that computes it.
template <class T>
std::vector<T> input(int rank, std::size_t n, std::uint64_t salt) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t bits = mix(salt * 1000003u + static_cast<std::uint64_t>(rank) * 7919u + i);
    const double u = static_cast<double>(bits >> 11) * 0x1.0p-53 * 2.0 - 1.0;  // [-1, 1)
    if constexpr (std::is_integral_v<T>) {
      v[i] = static_cast<T>(static_cast<std::int64_t>(bits % 2001) - 1000);
    } else if constexpr (std::is_floating_point_v<T>) {
      v[i] = static_cast<T>(u * std::ldexp(1.0, static_cast<int>(bits % 9)));  // several binades
    } else {
      v[i] = T(static_cast<float>(u * 8.0));
    }
  }
  return v;
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T, class Comm>
void check_rank_order(Comm& comm, std::size_t n, reduce_op op, std::uint64_t salt) {
  auto data = input<T>(comm.rank(), n, salt);
  comm.allreduce(std::span<T>(data), op);
  auto want = input<T>(0, n, salt);
  for (int r = 1; r < comm.size(); ++r) {
    const auto x = input<T>(r, n, salt);
    gradcomp::detail::combine(want.data(), x.data(), n, op);
  }
  CHECK(same_bytes(data, want));
}

template <class T, class Comm>
void rank_order_all_ops(Comm& comm, std::uint64_t salt) {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{1000}, std::size_t{100003}}) {
    for (reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
      CAPTURE(n);
      CAPTURE(static_cast<int>(op));
      check_rank_order<T, Comm>(comm, n, op, salt + n);
    }
  }
}


// Rank-order allreduce of every element type and operation the exchanges use.
template <class Comm>
void rank_order_allreduce(Comm& comm) {
  SUBCASE("float") { rank_order_all_ops<float>(comm, 1); }
  SUBCASE("double") { rank_order_all_ops<double>(comm, 2); }
  SUBCASE("int32") { rank_order_all_ops<std::int32_t>(comm, 3); }
  SUBCASE("half") { rank_order_all_ops<half>(comm, 4); }
  SUBCASE("bfloat16") { rank_order_all_ops<bfloat16>(comm, 5); }
}

template <class Comm>
void variable_collectives(Comm& comm) {
  const int p = comm.size(), me = comm.rank();
  SUBCASE("allgatherv: counts differ per rank, zero included") {
    const std::size_t mine = static_cast<std::size_t>(me % 3) * 5;  // rank 0 sends nothing
    const auto send = input<double>(me, mine, 21);
    std::vector<double> recv;
    std::vector<std::size_t> counts;
    comm.allgatherv(std::span<const double>(send), recv, counts);
    std::vector<double> want;
    for (int r = 0; r < p; ++r) {
      const auto x = input<double>(r, static_cast<std::size_t>(r % 3) * 5, 21);
      want.insert(want.end(), x.begin(), x.end());
      CHECK(counts[static_cast<std::size_t>(r)] == x.size());
    }
    CHECK(same_bytes(recv, want));
  }
  SUBCASE("allgather") {
    const auto send = input<std::int32_t>(me, 17, 22);
    std::vector<std::int32_t> recv(17 * static_cast<std::size_t>(p));
    comm.allgather(std::span<const std::int32_t>(send), std::span<std::int32_t>(recv));
    for (int r = 0; r < p; ++r) {
      const auto x = input<std::int32_t>(r, 17, 22);
      CHECK(std::equal(x.begin(), x.end(), recv.begin() + 17 * r));
    }
  }
  SUBCASE("alltoallv: block (s -> d) holds s + 2 d elements") {
    std::vector<std::size_t> send_counts;
    std::vector<float> send;
    for (int d = 0; d < p; ++d) {
      const auto block = input<float>(me * 100 + d, static_cast<std::size_t>(me + 2 * d), 23);
      send.insert(send.end(), block.begin(), block.end());
      send_counts.push_back(block.size());
    }
    std::vector<float> recv;
    std::vector<std::size_t> counts;
    comm.alltoallv(std::span<const float>(send), std::span<const std::size_t>(send_counts), recv, counts);
    std::vector<float> want;
    for (int s = 0; s < p; ++s) {
      const auto block = input<float>(s * 100 + me, static_cast<std::size_t>(s + 2 * me), 23);
      want.insert(want.end(), block.begin(), block.end());
      CHECK(counts[static_cast<std::size_t>(s)] == block.size());
    }
    CHECK(same_bytes(recv, want));
  }
  SUBCASE("broadcast from every root") {
    for (int root = 0; root < p; ++root) {
      auto data = input<half>(me, 33, 24);
      comm.broadcast(std::span<half>(data), root);
      CHECK(same_bytes(data, input<half>(root, 33, 24)));
    }
    comm.barrier();
  }
  if constexpr (gradcomp::point_to_point<Comm, std::uint8_t>) {
  SUBCASE("sendrecv around a ring, sizes differ") {
    const int next = (me + 1) % p, prev = (me + p - 1) % p;
    const auto send = input<std::uint8_t>(me, static_cast<std::size_t>(10 + me), 25);
    std::vector<std::uint8_t> recv;
    comm.sendrecv(std::span<const std::uint8_t>(send), next, recv, prev);
    CHECK(same_bytes(recv, input<std::uint8_t>(prev, static_cast<std::size_t>(10 + prev), 25)));
    comm.sendrecv(std::span<const std::uint8_t>(send), -1, recv, -1);
    CHECK(recv.empty());
  }
  }
  SUBCASE("allgatherv: every rank empty, and one rank empty") {
    std::vector<float> recv(3, 1.0f);
    std::vector<std::size_t> counts;
    comm.allgatherv(std::span<const float>(), recv, counts);
    CHECK(recv.empty());
    CHECK(counts == std::vector<std::size_t>(static_cast<std::size_t>(p), 0));
    const auto send = input<float>(me, me == p - 1 ? 0 : 4, 26);
    comm.allgatherv(std::span<const float>(send), recv, counts);
    CHECK(recv.size() == static_cast<std::size_t>(4 * (p - 1)));
  }
  SUBCASE("alltoallv: nothing anywhere, and only to one rank") {
    std::vector<float> recv(2, 1.0f);
    std::vector<std::size_t> counts;
    const std::vector<std::size_t> zeros(static_cast<std::size_t>(p), 0);
    comm.alltoallv(std::span<const float>(), std::span<const std::size_t>(zeros), recv, counts);
    CHECK(recv.empty());
    std::vector<std::size_t> to_last(static_cast<std::size_t>(p), 0);
    to_last.back() = 3;
    const auto send = input<float>(me, 3, 27);
    comm.alltoallv(std::span<const float>(send), std::span<const std::size_t>(to_last), recv, counts);
    CHECK(recv.size() == (me == p - 1 ? static_cast<std::size_t>(3 * p) : 0u));
  }
  SUBCASE("broadcast and allreduce of nothing") {
    std::vector<float> none;
    comm.broadcast(std::span<float>(none), 0);
    comm.allreduce(std::span<float>(none), reduce_op::sum);
    comm.barrier();
  }
}

// Every rank passes the same bad argument, so no rank waits for another.
template <class Comm>
void bad_arguments(Comm& comm) {
  std::vector<float> v(4);
  CHECK_THROWS_AS(comm.broadcast(std::span<float>(v), comm.size()), invalid_argument);
  CHECK_THROWS_AS(comm.broadcast(std::span<float>(v), -1), invalid_argument);
  std::vector<float> recv;
  std::vector<std::size_t> counts;
  const std::vector<std::size_t> short_counts(static_cast<std::size_t>(comm.size()) + 1, 0);
  CHECK_THROWS_AS(comm.alltoallv(std::span<const float>(v), std::span<const std::size_t>(short_counts), recv, counts),
                  invalid_argument);
  std::vector<std::size_t> wrong_sum(static_cast<std::size_t>(comm.size()), 1);
  wrong_sum[0] = 10;
  CHECK_THROWS_AS(comm.alltoallv(std::span<const float>(v), std::span<const std::size_t>(wrong_sum), recv, counts),
                  invalid_argument);
  std::vector<float> small(1);
  CHECK_THROWS_AS(comm.allgather(std::span<const float>(v), std::span<float>(small)), invalid_argument);
  if constexpr (gradcomp::point_to_point<Comm, float>) {
    CHECK_THROWS_AS(comm.sendrecv(std::span<const float>(v), comm.size(), recv, -1), invalid_argument);
  }
  try {
    comm.broadcast(std::span<float>(v), 99);
    FAIL("broadcast to root 99 did not throw");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("root") != std::string::npos);
  }
  comm.barrier();  // and the communicator still works
}

}  // namespace gradcomp_test::comm_properties
