// A peer that lies about sizes, over MPI: run with mpiexec -n 2 and 3. mpi_comm learns what
// each rank sends from a message of counts (MPI_Iallgather of uint64 counts, one per rank for
// allgatherv, a row of size() for alltoallv) before it sizes any buffer. This program puts its
// own MPI_Iallgather in front of MPI's (the profiling interface: it forwards to
// PMPI_Iallgather), and on the liar's rank replaces one entry of one such message by a huge
// count. Every rank must then throw communicator_error naming the liar and the count before
// anything is allocated or received, stay in step with the others, and a failed step must
// change nothing. Where the protocol passes a receive_limit the lie is 2^31 - 2 elements: within
// MPI's int counts, so only that bound stops it (unbounded, it would allocate 16 GiB of (index,
// value) pairs); without a limit the lie is 2^40, which MPI's int counts stop.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/runtime/bucket_engine.hpp>

#include "../support/data.hpp"
#include "../support/exchange_reference.hpp"

namespace {

struct tamperer {
  bool armed = false;
  int skip = 0;  // messages of counts to let through first; -1: count them, lie in none
  int seen = 0;  // messages of counts let through since arming
  std::uint64_t lie = 0;
  std::vector<std::uint64_t> lying;  // the message sent instead, alive until the test waits
} the_tamperer;

void arm(std::uint64_t lie, int skip) {
  the_tamperer.lie = lie;
  the_tamperer.skip = skip;
  the_tamperer.seen = 0;
  the_tamperer.armed = true;
}

}  // namespace

// The profiling interface: mpi_comm's calls (header-only, so compiled into this program) reach
// this definition; it forwards to MPI's own.
extern "C" int MPI_Iallgather(const void* sendbuf, int sendcount, MPI_Datatype sendtype,
                              void* recvbuf, int recvcount, MPI_Datatype recvtype, MPI_Comm comm,
                              MPI_Request* request) {
  auto& t = the_tamperer;
  int size = 0;
  int rank = 0;
  PMPI_Comm_size(comm, &size);
  PMPI_Comm_rank(comm, &rank);
  const bool counts = sendtype == MPI_UINT64_T && (sendcount == 1 || sendcount == size);
  if (t.armed && counts && t.skip >= 0 && t.skip-- == 0) {
    t.armed = false;
    const auto n = static_cast<std::size_t>(sendcount);
    t.lying.assign(n, 0);
    std::memcpy(t.lying.data(), sendbuf, n * sizeof(std::uint64_t));
    // allgatherv: this rank's count; alltoallv: what it sends to the next rank.
    t.lying[n == 1 ? 0 : static_cast<std::size_t>(rank + 1) % n] = t.lie;
    return PMPI_Iallgather(t.lying.data(), sendcount, sendtype, recvbuf, recvcount, recvtype,
                           comm, request);
  }
  if (t.armed && counts) ++t.seen;
  return PMPI_Iallgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, request);
}

namespace {

using namespace gradcomp;

// The test case's communicator (each test case makes one, destroyed before MPI_Finalize).
mpi_comm* the_comm = nullptr;
mpi_comm& comm() { return *the_comm; }

// Every rank runs `f` while the last rank lies (`lie` elements) in its (skip + 1)-th message
// of counts: every rank throws communicator_error with `needle` and the liar's rank in it, and
// the ranks are still in step afterwards.
void refused_everywhere(std::uint64_t lie, int skip, const std::function<void()>& f,
                        const std::string& needle) {
  const int liar = comm().size() - 1;
  if (comm().rank() == liar) arm(lie, skip);
  std::string what;
  bool right_type = false;
  try {
    f();
  } catch (const communicator_error& e) {
    right_type = true;
    what = e.what();
  } catch (const std::exception& e) {
    what = e.what();
  }
  const bool lied = comm().rank() != liar || !the_tamperer.armed;
  the_tamperer.armed = false;
  CAPTURE(what);
  CHECK(lied);
  CHECK(right_type);
  CHECK(what.find(needle) != std::string::npos);
  CHECK(what.find("rank " + std::to_string(liar)) != std::string::npos);
  // Still in step: a clean allgatherv returns every rank's own number.
  const std::vector<int> mine{comm().rank(), 7};
  std::vector<int> all;
  std::vector<std::size_t> counts;
  comm().allgatherv(std::span<const int>(mine), all, counts);
  REQUIRE(all.size() == static_cast<std::size_t>(comm().size()) * 2);
  for (int r = 0; r < comm().size(); ++r) CHECK(all[static_cast<std::size_t>(2 * r)] == r);
}

}  // namespace

TEST_CASE("counts a peer announces over MPI are bounded before anything is sized by them") {
  mpi_comm c;
  the_comm = &c;
  if (comm().size() < 2) return;  // one rank announces nothing to anyone
  const std::vector<std::byte> bytes(40);
  std::vector<std::byte> recv_bytes;
  std::vector<float> recv_floats;
  std::vector<index_value> recv_pairs;
  std::vector<std::size_t> counts;
  const auto p = static_cast<std::size_t>(comm().size());
  const std::vector<index_value> pairs(p, index_value{1, 1.0f});
  const std::vector<std::size_t> each(p, 1);
  const std::uint64_t lie = 2147483646;
  const std::string big = "announced 2147483646 elements";
  // With the protocol's limit, and without one (MPI's int counts bound a message then).
  refused_everywhere(lie, 0, [&] {
    comm().allgatherv(std::span<const std::byte>(bytes), recv_bytes, counts, receive_limit{64});
  }, big);
  refused_everywhere(std::uint64_t{1} << 40, 0, [&] {
    const std::vector<float> f(10, 1.0f);
    comm().allgatherv(std::span<const float>(f), recv_floats, counts);
  }, "announced 1099511627776 elements");
  refused_everywhere(lie, 0, [&] {
    comm().alltoallv(std::span<const index_value>(pairs), std::span<const std::size_t>(each),
                     recv_pairs, counts, receive_limit{100});
  }, big);
  refused_everywhere(std::uint64_t{1} << 40, 0, [&] {
    comm().alltoallv(std::span<const index_value>(pairs), std::span<const std::size_t>(each),
                     recv_pairs, counts);
  }, "announced 1099511627776 elements");
  // Nothing was received into the buffers: they are as the last clean call left them.
  CHECK(recv_bytes.empty());
  CHECK(recv_floats.empty());
  CHECK(recv_pairs.empty());
}

TEST_CASE("every message of counts in every exchange of a step over MPI refuses a lying peer") {
  mpi_comm mc;
  the_comm = &mc;
  if (comm().size() < 2) return;
  namespace rt = gradcomp::runtime;
  const std::size_t n = 5003;
  for (const char* ex : {"allreduce", "allgather", "gtopk", "a2a", "auto"}) {
    rt::engine_config c;
    c.exchange = ex;
    c.selector = std::string(ex) == "allreduce" ? "randomk" : "topk";
    CAPTURE(ex);
    rt::bucket_engine<mpi_comm> engine(comm(), c), clean(comm(), c);
    auto step = [&](rt::bucket_engine<mpi_comm>& e, std::uint64_t s) {
      auto g = gradcomp_test::make_input<float>(gradcomp_test::dist::laplace, n,
                                                static_cast<std::uint64_t>(comm().rank()) + 10 * s);
      e.run(3, std::span<float>(g), s, 0.01);
      e.commit();
      return g;
    };
    // How many messages of counts the liar sends in one step (the first step calibrates
    // 'auto', so count on the second).
    (void)step(engine, 0);
    if (comm().rank() == comm().size() - 1) arm(0, -1);
    (void)step(engine, 1);
    int messages = the_tamperer.seen;
    the_tamperer.armed = false;
    MPI_Bcast(&messages, 1, MPI_INT, comm().size() - 1, MPI_COMM_WORLD);
    CAPTURE(messages);
    CHECK(messages >= 2);  // the bucket's agreement and at least one exchange message
    for (int k = 0; k < messages; ++k) {
      CAPTURE(k);
      refused_everywhere(2147483646, k, [&] { (void)step(engine, 2); },
                         "announced 2147483646 elements");
    }
    // The failed steps changed nothing: step 2 now equals that of an engine that never failed.
    const auto got = step(engine, 2);
    (void)step(clean, 0);
    (void)step(clean, 1);
    CHECK(gradcomp_test::same_bits(got, step(clean, 2)));
  }
}
