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
#include <span>
#include <string>
#include <vector>

#include <gradcomp/comm/mpi.hpp>

#include "../support/lying_peer.hpp"

namespace {

// The tamperer of tests/support/lying_peer.hpp, for MPI_Iallgather below.
struct mpi_tamperer {
  bool armed = false;
  bool did_lie = false;
  int skip = 0;   // messages of counts to let through first; -1: count them, lie in none
  int let_through = 0;  // messages of counts let through since arming
  std::uint64_t value = 0;
  std::vector<std::uint64_t> lying;  // the message sent instead, alive until the test waits

  void lie(std::uint64_t v, int s) {
    value = v;
    skip = s;
    let_through = 0;
    did_lie = false;
    armed = true;
  }
  [[nodiscard]] bool lied() const { return did_lie; }
  [[nodiscard]] int seen() const { return let_through; }
  void disarm() { armed = false; }
} the_tamperer;

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
    t.did_lie = true;
    const auto n = static_cast<std::size_t>(sendcount);
    t.lying.assign(n, 0);
    std::memcpy(t.lying.data(), sendbuf, n * sizeof(std::uint64_t));
    // allgatherv: this rank's count; alltoallv: what it sends to the next rank.
    t.lying[n == 1 ? 0 : static_cast<std::size_t>(rank + 1) % n] = t.value;
    return PMPI_Iallgather(t.lying.data(), sendcount, sendtype, recvbuf, recvcount, recvtype,
                           comm, request);
  }
  if (t.armed && counts) ++t.let_through;
  return PMPI_Iallgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, request);
}

namespace {

using namespace gradcomp;

// The test case's communicator (each test case makes one, destroyed before MPI_Finalize).
mpi_comm* the_comm = nullptr;
mpi_comm& comm() { return *the_comm; }

}  // namespace

TEST_CASE("counts a peer announces over MPI are bounded before anything is sized by them") {
  mpi_comm c;
  the_comm = &c;
  if (comm().size() < 2) return;  // one rank announces nothing to anyone
  // With the protocol's limit, a lie that MPI's int counts would let through; without one, a
  // lie beyond them (MPI's int counts bound a message then).
  gradcomp_test::lying_peer::collectives_refused(comm(), the_tamperer, 2147483646,
                                                 std::uint64_t{1} << 40);
}

TEST_CASE("every message of counts in every exchange of a step over MPI refuses a lying peer") {
  mpi_comm mc;
  the_comm = &mc;
  if (comm().size() < 2) return;
  gradcomp_test::lying_peer::every_counts_message_refused(comm(), the_tamperer, 2147483646,
                                                          "announced 2147483646 elements");
}
