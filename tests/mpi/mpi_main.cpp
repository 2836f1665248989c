// main() of the MPI test programs: MPI is initialised around doctest, every rank runs every
// test case in the same order (so their collectives match), rank 0 reports in full and the
// others only their failures, and the exit status is the worst over the ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <gradcomp/comm/mpi.hpp>

int main(int argc, char** argv) {
  // layerwise_sgd (tests/mpi/mpi_faults.cpp) calls MPI from its communication thread.
  gradcomp::mpi_environment env(argc, argv, MPI_THREAD_SERIALIZED);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context context(argc, argv);
  if (rank != 0) context.setOption("minimal", true);
  int status = context.run();
  MPI_Allreduce(MPI_IN_PLACE, &status, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return status;
}
