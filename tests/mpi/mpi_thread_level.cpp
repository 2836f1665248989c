// layerwise_sgd runs its exchanges on a communication thread, which MPI allows only when it
// was initialised with MPI_THREAD_SERIALIZED or more. Initialised with MPI_THREAD_FUNNELED (the
// default of mpi_environment), the constructor must refuse with a message that says what to do,
// instead of MPI misbehaving in a collective later. Run with mpiexec -n 1 and 2.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <string>

#include <gradcomp/comm/mpi.hpp>
#include <gradcomp/gradcomp.hpp>

TEST_CASE("layerwise_sgd refuses an MPI initialised below MPI_THREAD_SERIALIZED") {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  REQUIRE(provided < MPI_THREAD_SERIALIZED);  // what main() asked for
  gradcomp::mpi_comm comm;
  using namespace gradcomp;
  const tensor_spec tensors[] = {{0, 100}, {1, 50}};
  const double densities[] = {0.1, 0.1};
  try {
    layerwise_sgd<compressor<topk, identity, residual>, sparse_allgather, mpi_comm> sgd(
        comm, tensors, densities);
    FAIL("the constructor accepted MPI_THREAD_FUNNELED");
  } catch (const communicator_error& e) {
    const std::string what = e.what();
    CHECK(what.find("needs MPI_THREAD_SERIALIZED") != std::string::npos);
    CHECK(what.find("MPI_THREAD_FUNNELED") != std::string::npos);
  }
  // Point-to-point and collectives on the communicator still work: nothing was started.
  std::vector<float> x = {1.0f};
  comm.allreduce(std::span<float>(x), reduce_op::sum);
  CHECK(x[0] == static_cast<float>(comm.size()));
}

int main(int argc, char** argv) {
  gradcomp::mpi_environment env(argc, argv, MPI_THREAD_FUNNELED);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context context(argc, argv);
  if (rank != 0) context.setOption("minimal", true);
  int status = context.run();
  MPI_Allreduce(MPI_IN_PLACE, &status, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return status;
}
